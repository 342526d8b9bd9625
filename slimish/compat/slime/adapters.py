"""slime's rollout, reward and filter functions wrapped in slimish's shapes.

- rollout: `async def generate(args, sample, sampling_params[, evaluation])` becomes
  `async def fn(ctx, sample)`: the function gets a slime `Sample` of slimish's (`samples.to_slime`),
  slime's `args` and sampling params (`namespace`), posts to the router itself (`calls.post`
  records the replies), and its sample is copied back (`samples.copy_back`).
- reward: `async def rm(args, sample)` becomes `async def fn(ctx, sample)`; a group rm becomes
  `@group_reward async def fn(ctx, samples)`.
- filter: `def f(args, samples, **kwargs) -> DynamicFilterOutput | bool` becomes
  `def fn(ctx, group) -> str | None` (the reason, or f"slime filter {name}" when it gave none).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

from slimish.compat.slime.calls import Call, running
from slimish.compat.slime.namespace import slime_args, slime_dotted, slime_sample_class, slime_sampling_params
from slimish.compat.slime.samples import copy_back, reward_value, to_slime
from slimish.plugins import group_reward
from slimish.rollout.api import trajectory_of
from slimish.types import Sample


def _named(wrapper: Callable[..., Any], fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Name the adapter after the slime function (no `__wrapped__`: its signature is slimish's)."""
    wrapper.__name__ = wrapper.__qualname__ = getattr(fn, "__name__", name)
    wrapper.__module__ = getattr(fn, "__module__", wrapper.__module__)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__slime_function__ = fn  # type: ignore[attr-defined]
    return wrapper


def adapt_rollout(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    try:
        takes_evaluation = "evaluation" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_evaluation = False

    path = slime_dotted(fn, name)  # the function running, also for an eval dataset's own

    async def rollout(ctx: Any, sample: Sample) -> Sample | list[Sample]:
        ctx.resumable = False  # a cut-off slime sample restarts from its prompt
        given = to_slime(ctx, sample, fresh=True)
        call = Call(ctx, given, record=True)
        args, params = slime_args(ctx), slime_sampling_params(ctx)
        args.custom_generate_function_path = path
        with running(call):
            if takes_evaluation:
                out = await fn(args, given, params, evaluation=bool(sample.metadata.get("eval")))
            else:
                out = await fn(args, given, params)
        outs = out if isinstance(out, list) else [out]
        S = slime_sample_class()
        if not outs or not all(isinstance(o, S) for o in outs):
            raise TypeError(
                f"the slime function {name} returned {type(out).__name__}; expected a slime Sample or a "
                "non-empty list of them (slime.utils.types.Sample)"
            )
        results = []
        # Fan-out samples the function rewarded one by one (slime's multi-agent) are trajectories
        # of their own: one trajectory carries one reward in slimish.
        own_rewards = len(outs) > 1 and all(o.reward is not None for o in outs)
        base = trajectory_of(sample)
        for k, o in enumerate(outs):
            target = (
                sample
                if o is given
                else Sample(
                    prompt=copy.deepcopy(sample.prompt),
                    label=sample.label,
                    group_id=sample.group_id,
                    index=sample.index,
                    trajectory_id=sample.trajectory_id,
                    metadata=copy.deepcopy(sample.metadata),
                )
            )
            copy_back(ctx, o, target, call.replies, name)
            if own_rewards:
                target.trajectory_id = f"{base}/{k}"
            results.append(target)
        counted = next((s for s in results if s is sample), results[0])
        counted.metadata["retokenized_mismatch"] = call.mismatches
        return results if isinstance(out, list) else results[0]

    return _named(rollout, fn, name)


def adapt_reward(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    path = slime_dotted(fn, name)

    async def reward(ctx: Any, sample: Sample) -> Any:
        if ctx.args.get("group_rm"):
            raise ValueError(
                f"rollout.args.group_rm is set but the slime rm {name} takes one sample; name its second "
                "parameter `samples` to have it called with the whole group"
            )
        args = slime_args(ctx)
        args.custom_rm_path = path
        with running(Call(ctx)):
            return reward_value(await fn(args, to_slime(ctx, sample)))

    return _named(reward, fn, name)


def adapt_group_reward(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    path = slime_dotted(fn, name)

    async def reward(ctx: Any, samples: list[Sample]) -> list[Any]:
        args = slime_args(ctx, group_rm=True)
        args.custom_rm_path = path
        with running(Call(ctx)):
            rewards = await fn(args, [to_slime(ctx, s) for s in samples])
        if hasattr(rewards, "tolist"):
            rewards = rewards.tolist()
        if not isinstance(rewards, (list, tuple)):
            raise TypeError(
                f"the slime group rm {name} returned {type(rewards).__name__}; expected a list with one reward per sample"
            )
        return [reward_value(r) for r in rewards]

    return group_reward(_named(reward, fn, name))


def adapt_filter(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):

        async def async_filter(ctx: Any, group: list[Sample]) -> str | None:
            return _drop_reason(await fn(slime_args(ctx), [to_slime(ctx, s) for s in group]), name)

        return _named(async_filter, fn, name)

    def keep_or_drop(ctx: Any, group: list[Sample]) -> str | None:
        return _drop_reason(fn(slime_args(ctx), [to_slime(ctx, s) for s in group]), name)

    return _named(keep_or_drop, fn, name)


def _drop_reason(out: Any, name: str) -> str | None:
    """A slime filter's answer as slimish's: None keeps, a string is why the group is dropped.
    `DynamicFilterOutput` (slimish's or slime's own) or, as older slime filters return, a bool."""
    keep = getattr(out, "keep", out)
    if bool(keep):
        return None
    reason = getattr(out, "reason", None)
    return str(reason) if reason else f"slime filter {name}"
