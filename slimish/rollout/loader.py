"""`--rollout-fn` / `--reward-fn` / `--filter-fn`: user functions named `module:function` or
`path/to/file.py:function`, imported and checked before any server starts.

A wrong path, a missing function, a plain `def` where `async def` is needed or a wrong number of
parameters fails here, at start-up, with a message that says which and how to fix it, instead of
as a failed sample an hour into a run.

Kinds and the shapes they must have:
- rollout: `async def fn(ctx, sample) -> Sample | list[Sample]`
- reward:  `async def fn(ctx, sample) -> float | dict[str, float]`, or the group form
  `@group_reward async def fn(ctx, samples) -> list[float | dict]` (the decorator, from
  `slimish.rollout.rewards`, is what marks it: a group reward sees the whole finished group)
- filter:  `def fn(group) -> str | None` (or `async def`): None keeps the group, a string is
  the reason it is dropped
- credit:  `def fn(samples) -> list[float]` (`algorithm.segment_credit`): each sample's share
  of its trajectory's advantage
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from slimish.config import RolloutConfig
from slimish.rollout.rewards import is_group_reward


class LoadError(ValueError):
    """A user function that cannot be used; the message names the flag, the spec and the fix."""


# kind -> (flag, parameters, must be async)
KINDS: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "rollout": ("--rollout-fn", ("ctx", "sample"), True),
    "reward": ("--reward-fn", ("ctx", "sample"), True),
    "group_reward": ("--reward-fn", ("ctx", "samples"), True),
    "filter": ("--filter-fn", ("group",), False),
    "credit": ("algorithm.segment_credit", ("samples",), False),
}


def load_function(spec: str, kind: str) -> Callable[..., Any]:
    """The function `spec` names, checked for `kind` ("rollout", "reward", "filter" or "credit")."""
    if kind not in ("rollout", "reward", "filter", "credit"):
        raise ValueError(f"kind must be rollout, reward, filter or credit, got {kind!r}")
    flag = KINDS[kind][0]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise LoadError(f"{flag} {spec!r}: expected `module:function` (e.g. rollout_plugins.math:rollout) or `path/to/file.py:function`")
    module = _import_file(flag, spec, where) if where.endswith(".py") or "/" in where or os.sep in where else _import_module(flag, spec, where)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_") and v.__module__ == module.__name__)
        raise LoadError(f"{flag} {spec!r}: {where} has no function {name!r}; it defines: {', '.join(defined) or 'no public functions'}")
    if not callable(fn):
        raise LoadError(f"{flag} {spec!r}: {name} is a {type(fn).__name__}, not a function")
    if kind == "reward" and is_group_reward(fn):
        kind = "group_reward"
    _check_shape(flag, spec, name, fn, kind)
    return fn


def load_functions(cfg: RolloutConfig) -> tuple[Callable[..., Any], Callable[..., Any] | None, Callable[..., Any] | None]:
    """The rollout, reward and filter functions `cfg` names (reward and filter may be None)."""
    reward = load_function(cfg.reward_fn, "reward") if cfg.reward_fn else None
    filter_fn = load_function(cfg.filter_fn, "filter") if cfg.filter_fn else None
    return load_function(cfg.rollout_fn, "rollout"), reward, filter_fn


def _check_shape(flag: str, spec: str, name: str, fn: Callable[..., Any], kind: str) -> None:
    _, params, must_be_async = KINDS[kind]
    want = f"{'async ' if must_be_async else ''}def {name}({', '.join(params)})"
    if must_be_async and not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise LoadError(f"{flag} {spec!r}: {name} must be an async function (it is called with await); write `{want}`")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables: nothing to check
    try:
        signature.bind(*params)
    except TypeError:
        raise LoadError(f"{flag} {spec!r}: {name}{signature} cannot be called with ({', '.join(params)}); write `{want}`") from None


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
        raise LoadError(f"{flag} {spec!r}: no file {where} (looked for {path}); paths are relative to the current directory {os.getcwd()}")
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
