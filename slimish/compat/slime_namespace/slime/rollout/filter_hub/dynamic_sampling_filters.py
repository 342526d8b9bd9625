"""slime.rollout.filter_hub.dynamic_sampling_filters: the built-in dynamic-sampling filters.

`check_reward_nonzero_std` keeps a group whose rewards (`args.reward_key` of dict rewards) have
a sample standard deviation above 1e-6; a group of one sample has none and is dropped, as in slime.
"""

from __future__ import annotations

import statistics
from typing import Any

from slime.rollout.filter_hub.base_types import DynamicFilterOutput


def check_reward_nonzero_std(args: Any, samples: list, **kwargs: Any) -> DynamicFilterOutput:
    rewards = [float(s.get_reward_value(args)) for s in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list, **kwargs: Any) -> DynamicFilterOutput:
    """As `check_reward_nonzero_std`, marked keep_when_insufficient (which slimish does not read)."""
    out = check_reward_nonzero_std(args, samples, **kwargs)
    out.keep_when_insufficient = True
    return out


__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]
