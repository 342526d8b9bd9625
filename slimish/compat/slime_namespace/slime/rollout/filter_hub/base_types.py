"""slime.rollout.filter_hub.base_types: what a dynamic-sampling filter returns.

slimish reads `keep` and `reason` (the group's drop reason); `keep_when_insufficient` has no
per-group counterpart in slimish (its `rollout.keep_when_insufficient` applies to every group).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def call_dynamic_filter(fn: Any, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    """`fn`'s answer as a DynamicFilterOutput (a bool, as older filters return, becomes `keep`)."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    out = fn(*args, **kwargs)
    return out if isinstance(out, DynamicFilterOutput) else DynamicFilterOutput(keep=bool(out))


def should_drop_dynamic_filter_output(
    output: DynamicFilterOutput, *, remaining_batch_size: int, target_data_size: int
) -> bool:
    """slime's rule for one group: drop it unless kept, or unless it asks to be kept when the
    batch would otherwise run short."""
    return not output.keep and not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


class MetricGatherer:
    """Counts a rollout's filter drops by reason, as slime's rollout metrics
    `rollout/dynamic_filter/drop_REASON`."""

    def __init__(self) -> None:
        self._drops: Counter[str] = Counter()

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        if reason:
            self._drops[reason] += 1

    def collect(self) -> dict[str, int]:
        return {f"rollout/dynamic_filter/drop_{reason}": n for reason, n in self._drops.items()}


__all__ = ["DynamicFilterOutput", "MetricGatherer", "call_dynamic_filter", "should_drop_dynamic_filter_output"]
