"""Dynamic-sampling filters over a finished, scored group: None keeps it, a string is why it is dropped.

A dropped group is counted with its reason; the manager over-samples so that
`rollout_batch_size` groups still survive.
"""

from __future__ import annotations

from typing import Any

from slimish.types import Sample


def nonzero_std(ctx: Any, group: list[Sample]) -> str | None:
    """Drop groups whose rewards are all equal (DAPO's dynamic sampling): with group-normalised
    advantages they are all zero, so the group would cost a training step and teach nothing.
    Dict rewards compare by `rollout.reward_key`, or as whole dicts when it is not set."""
    key = ctx.config.rollout.reward_key
    rewards = [s.reward_value(key) if key is not None else s.reward for s in group]
    if len(group) > 1 and all(r == rewards[0] for r in rewards):
        return f"zero reward variance (all {len(group)} rewards {rewards[0]!r})"
    return None
