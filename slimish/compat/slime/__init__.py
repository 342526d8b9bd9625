"""slime's custom functions, unchanged, as slimish rollout, reward and filter functions.

A spec `slime:module:function` (or `slime:path/to/file.py:function`) names a function written in
slime's signatures (github THUDM/slime, `--custom-generate-function-path`, `--custom-rm-path`,
`--dynamic-sampling-filter-path`); `load_slime_function` imports it, checks it against slime's
signature and returns it in slimish's shape (`adapters`):

- rollout: `async def generate(args, sample, sampling_params[, evaluation])` becomes
  `async def fn(ctx, sample)`. The slime function gets a slime `Sample` made from slimish's
  (`samples`), an `argparse.Namespace` of the slime arguments such code reads and slime-style
  sampling params (`namespace`). It posts to the router itself with
  `slime.utils.http_utils.post`, which is slimish's (`calls`): every `/generate` reply of the
  call is recorded, and when the function returns its bookkeeping is copied back into the
  slimish sample.
- reward: `async def rm(args, sample)` becomes `async def fn(ctx, sample)`; a group rm
  (slime's `--group-rm`), recognised by its second parameter being named `samples` (or annotated
  as a list), becomes `@group_reward async def fn(ctx, samples)`. The load happens before any
  config is read, so the parameter name decides; `rollout.args.group_rm: true` with a per-sample
  rm fails its samples with a message saying to rename the parameter.
- filter: `def f(args, samples, **kwargs) -> DynamicFilterOutput | bool` becomes
  `def fn(ctx, group) -> str | None`.

The names slime code imports come from `slimish/compat/slime_namespace/` when no real slime is
installed (`namespace`).

Re-sent text: a slime function that posts `text` (as slime's search-r1 example does) lets the
engine re-tokenise the model's earlier output; where that differs from the ids it held, the
sample's `metadata["retokenized_mismatch"]` counts the call (a warning is logged once per process).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from slimish.compat.slime.adapters import adapt_filter, adapt_group_reward, adapt_reward, adapt_rollout
from slimish.compat.slime.namespace import remember_slime_path, use_slime_namespace
from slimish.plugins import SLIME_PREFIX, Kind, check_shape, find_function

# The shapes slime documents for each kind slimish can adapt (slimish.plugins.SLIME_ADAPTS).
SLIME_KINDS: dict[str, Kind] = {
    "rollout": Kind("--rollout-fn", (("args", "sample", "sampling_params"),), True),
    "reward": Kind("--reward-fn", (("args", "sample"),), True),
    "group_reward": Kind("--reward-fn", (("args", "samples"),), True),
    "filter": Kind("--filter-fn", (("args", "samples"),)),
}
ADAPTERS = {
    "rollout": adapt_rollout,
    "reward": adapt_reward,
    "group_reward": adapt_group_reward,
    "filter": adapt_filter,
}


def load_slime_function(spec: str, kind: str, flag: str) -> Callable[..., Any]:
    """The slime function `spec` (`slime:module:function`) names, adapted to slimish's `kind`
    (rollout, reward or filter)."""
    use_slime_namespace()
    fn, name = find_function(spec.removeprefix(SLIME_PREFIX), flag, spec)
    if kind == "reward" and is_group_rm(fn):
        kind = "group_reward"
    check_shape(flag, spec, name, fn, SLIME_KINDS[kind])
    remember_slime_path(spec, fn, name)
    return ADAPTERS[kind](fn, name)


def is_group_rm(fn: Callable[..., Any]) -> bool:
    """A slime rm over a whole group (`--group-rm`): its second parameter is named `samples`, or
    is annotated as a list."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return False
    if len(params) < 2:
        return False
    second = params[1]
    annotation = second.annotation if isinstance(second.annotation, str) else repr(second.annotation)
    return second.name == "samples" or annotation.replace("typing.", "").lower().startswith("list")
