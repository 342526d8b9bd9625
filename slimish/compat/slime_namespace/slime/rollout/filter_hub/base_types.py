"""slime.rollout.filter_hub.base_types: what a dynamic-sampling filter returns.

slimish reads `keep` and `reason` (the group's drop reason); `keep_when_insufficient` has no
per-group counterpart in slimish (its `rollout.keep_when_insufficient` applies to every group).
"""

from __future__ import annotations

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


__all__ = ["DynamicFilterOutput", "call_dynamic_filter"]
