"""User functions named `module:function` or `path/to/file.py:function` (the rollout, reward and
filter functions and every hook), imported and checked before any server starts.

A wrong path, a missing function, a plain `def` where `async def` is needed or a wrong number of
parameters fails here, at start-up, with a message that says which and how to fix it, instead of
as a failed sample an hour into a run. A spec starting `slime:` names a function written in
slime's signatures: `slimish.compat.load_function` adapts it (the run's start-up loads through
it); this module only refuses such a spec, saying where it belongs.

Kinds, the config value (or flag) that names each, and the shape it must have:
- rollout (`--rollout-fn`): `async def fn(ctx, sample) -> Sample | list[Sample]`; marked with
  `@resumable` (slimish.rollout.api) it continues a partial sample itself
- reward (`--reward-fn`): `async def fn(ctx, sample) -> float | dict`, or the group form
  `@group_reward async def fn(ctx, samples) -> list[float | dict]` (the decorator, from
  `slimish.rollout.rewards`, is what marks it: a group reward sees the whole finished group)
- filter (`--filter-fn`): `def fn(ctx, group) -> str | None` (or `async def`, or `fn(group)`): None
  keeps the group, a string is the reason it is dropped
- sample_hook (`rollout.sample_hook`): `async def fn(ctx, sample) -> None`, on every sample the
  rollout function returned, before scoring
- reward_post (`rollout.reward_post_fn`): `def fn(ctx, group) -> list[float | dict]` (or async):
  a scored group's rewards replaced (e.g. a length penalty, a group-relative bonus)
- credit (`algorithm.segment_credit`): `def fn(samples) -> list[float]`: each sample's share of its
  trajectory's advantage
- advantage (`algorithm.advantage`): `def fn(rewards, group) -> Tensor`: one advantage per
  trajectory `[T]`, in place of the built-in estimators (`rewards` `[T]` float32, a trajectory's
  reward after any KL-in-reward; `group` `[T]` int64, its group's index 0..G-1); it gets no
  gradient; a wrong shape or dtype, or a non-finite value, fails the step naming the key
- policy_loss (`algorithm.loss`): `def fn(logprobs, old_logprobs, advantages, mask) -> Tensor`:
  the per-token policy loss `[B, T]`, in place of the clipped surrogate; every input is `[B, T]`
  (`advantages` the sample's advantage at each of its tokens, `mask` 1.0 where trained, and
  `logprobs` equal to `old_logprobs` where it is 0). Masked, TIS-weighted, reduced by
  `algorithm.loss_reduction`, plus the KL and entropy terms as for the built-in losses; its
  clip_* stats are 0 and its ratio stat is the token ratio
- data (`data.source`, `eval.source`): `def fn(cfg, split) -> Iterable[dict]`: prompt rows, each
  as a JSONL line would hold it (read with `data.prompt_key` / `label_key`); `cfg` the data
  config, `split` train (or test for evaluation). Called once per split: the list it yields is
  the dataset, so it must be deterministic (a resumed run's cursor indexes into it). A value
  with ':' that is not `task:NAME` and not an existing path is a function
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

SLIME_PREFIX = "slime:"
SLIME_ADAPTS = ("rollout", "reward", "filter")  # the kinds a `slime:` spec may name


class LoadError(ValueError):
    """A user function that cannot be used; the message names the flag, the spec and the fix."""


class Loader(Protocol):
    """What loads a spec: `load_function` here, or `slimish.compat.load_function`, which also adapts
    `slime:` specs (the run's start-up hands that one down to the rollout side)."""

    def __call__(self, spec: str, kind: str, flag: str | None = None) -> Callable[..., Any]: ...


@dataclass(frozen=True)
class Kind:
    flag: str  # the flag or config value that names it, for messages
    shapes: tuple[tuple[str, ...], ...]  # the parameter lists it may take; the first is the one to write
    must_be_async: bool = False


KINDS: dict[str, Kind] = {
    "rollout": Kind("--rollout-fn", (("ctx", "sample"),), True),
    "reward": Kind("--reward-fn", (("ctx", "sample"),), True),
    "group_reward": Kind("--reward-fn", (("ctx", "samples"),), True),
    "filter": Kind("--filter-fn", (("ctx", "group"), ("group",))),
    "sample_hook": Kind("rollout.sample_hook", (("ctx", "sample"),), True),
    "reward_post": Kind("rollout.reward_post_fn", (("ctx", "group"),)),
    "credit": Kind("algorithm.segment_credit", (("samples",),)),
    "advantage": Kind("algorithm.advantage", (("rewards", "group"),)),
    "policy_loss": Kind("algorithm.loss", (("logprobs", "old_logprobs", "advantages", "mask"),)),
    "data": Kind("data.source", (("cfg", "split"),)),
}


def group_reward(fn: Callable[..., Awaitable[list[Any]]]) -> Callable[..., Awaitable[list[Any]]]:
    """Marks `async def fn(ctx, samples) -> list[float | dict]` as a reward over a whole finished
    group (one reward per sample, in order), e.g. a pairwise judge or a group-relative score.
    Users import it from `slimish.rollout.rewards`; it lives here because the mark decides the
    shape a reward is checked against."""
    fn.__slimish_group_reward__ = True  # type: ignore[attr-defined]
    return fn


def is_group_reward(fn: Any) -> bool:
    return getattr(fn, "__slimish_group_reward__", False) is True


def load_function(spec: str, kind: str, flag: str | None = None) -> Callable[..., Any]:
    """The function `spec` names, checked for `kind` (a key of KINDS but group_reward, which a
    reward marked `@group_reward` is); `flag` names the config value in messages when it is not
    the kind's usual one. A filter that takes only the group is given a `ctx` parameter."""
    if kind not in KINDS or kind == "group_reward":
        raise ValueError(f"kind must be one of {', '.join(k for k in KINDS if k != 'group_reward')}, got {kind!r}")
    flag = flag or KINDS[kind].flag
    if spec.startswith(SLIME_PREFIX):
        raise LoadError(f"{flag} {spec!r}: {_slime_refusal(kind, flag)}")
    fn, name = find_function(spec, flag)
    if kind == "reward" and is_group_reward(fn):
        kind = "group_reward"
    shape = check_shape(flag, spec, name, fn, KINDS[kind])
    if kind == "filter" and shape == ("group",):
        return _with_ctx(fn)
    return fn


def _slime_refusal(kind: str, flag: str) -> str:
    if kind in SLIME_ADAPTS:
        return (
            "a `slime:` spec is adapted by slimish.compat.load_function (as `slimish train` and `slimish rollout` "
            "load); this caller takes slimish functions only"
        )
    return (
        "a `slime:` spec names a slime custom generate, reward (rm) or dynamic-sampling filter function; "
        f"{flag} takes a slimish function: drop the `slime:` prefix"
    )


def find_function(spec: str, flag: str, shown: str | None = None) -> tuple[Callable[..., Any], str]:
    """The callable `spec` (`module:function` or `path/to/file.py:function`) names, and its
    name; `shown` is the spec as the user wrote it, for messages."""
    shown = shown or spec
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise LoadError(
            f"{flag} {shown!r}: expected `module:function` (e.g. rollout_plugins.math:rollout) or `path/to/file.py:function`"
        )
    module = (
        _import_file(flag, shown, where)
        if where.endswith(".py") or "/" in where or os.sep in where
        else _import_module(flag, shown, where)
    )
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(
            k
            for k, v in vars(module).items()
            if inspect.isfunction(v) and not k.startswith("_") and v.__module__ == module.__name__
        )
        raise LoadError(
            f"{flag} {shown!r}: {where} has no function {name!r}; it defines: {', '.join(defined) or 'no public functions'}"
        )
    if not callable(fn):
        raise LoadError(f"{flag} {shown!r}: {name} is a {type(fn).__name__}, not a function")
    return fn, name


def check_shape(flag: str, spec: str, name: str, fn: Callable[..., Any], kind: Kind) -> tuple[str, ...] | None:
    """Which of the kind's parameter lists `fn` takes (None when it cannot be inspected)."""
    want = f"{'async ' if kind.must_be_async else ''}def {name}({', '.join(kind.shapes[0])})"
    if kind.must_be_async and not (
        inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    ):
        raise LoadError(f"{flag} {spec!r}: {name} must be an async function (it is called with await); write `{want}`")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins and C callables: nothing to check
    for params in kind.shapes:
        try:
            signature.bind(*params)
            return params
        except TypeError:
            continue
    raise LoadError(
        f"{flag} {spec!r}: {name}{signature} cannot be called with ({', '.join(kind.shapes[0])}); write `{want}`"
    ) from None


def _with_ctx(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(ctx: Any, group: Any) -> Any:
        return fn(group)

    return call


def _import_module(flag: str, spec: str, where: str) -> ModuleType:
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name and (where == exc.name or where.startswith(exc.name + ".")):
            raise LoadError(
                f"{flag} {spec!r}: no module named {exc.name!r}; check the spelling and that it is importable from "
                f"{os.getcwd()} (or on PYTHONPATH), or give a file path `path/to/file.py:{spec.rpartition(':')[2]}`"
            ) from None
        raise LoadError(f"{flag} {spec!r}: importing {where} failed: {exc}") from exc
    except Exception as exc:
        raise LoadError(f"{flag} {spec!r}: importing {where} raised {type(exc).__name__}: {exc}") from exc


def _import_file(flag: str, spec: str, where: str) -> ModuleType:
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise LoadError(
            f"{flag} {spec!r}: no file {where} (looked for {path}); paths are relative to the current directory {os.getcwd()}"
        )
    if path.suffix != ".py":
        raise LoadError(f"{flag} {spec!r}: {where} is not a .py file")
    # One module per file path, registered so that dataclasses and pickling inside it work.
    mod_name = f"slimish_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise LoadError(f"{flag} {spec!r}: running {where} raised {type(exc).__name__}: {exc}") from exc
    return module
