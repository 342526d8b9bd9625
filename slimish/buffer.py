"""Finished groups waiting to be trained on, oldest first, with a staleness bound.

A group's age is measured by the oldest weight version any of its tokens came from: in async
training (and with partial rollouts) a group can lag the trainer, and `max_staleness` bounds by
how many versions. A group past the bound is dropped and counted in `dropped_stale`, never
trained on silently; with `mask_stale_tokens` only its too-old tokens are masked out (a long
sample that outlived the bound still trains on its newer part). The state is plain JSON
(samples via `Sample.to_dict`), saved with checkpoints.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from slimish.types import Sample, version_number


def group_version(group: list[Sample]) -> int:
    """The oldest weight version that produced any token the group trains on (any token at all
    when it trains on none)."""
    trained = [v for s in group for v in s.trained_versions()]
    return min(trained or [version_number(v) for s in group for v in s.weight_versions] or [0])


class Buffer:
    def __init__(self, max_staleness: int = 0, mask_stale_tokens: bool = False) -> None:
        self.max_staleness = max_staleness
        self.mask_stale_tokens = mask_stale_tokens
        self.groups: deque[list[Sample]] = deque()
        self.dropped_stale = 0  # groups dropped for staleness, ever
        self.dropped_stale_samples = 0
        self.masked_stale_tokens = 0  # tokens taken out of training for staleness, ever

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: list[Sample]) -> None:
        if not group:
            raise ValueError("Buffer.add: empty group")
        self.groups.append(group)

    def get_batch(self, n_groups: int, max_staleness: int | None = None, current_version: int = 0) -> list[list[Sample]]:
        """Up to `n_groups` groups, oldest first; groups staler than `max_staleness` versions
        behind `current_version` (default: the buffer's bound) are dropped and counted on the way."""
        bound = self.max_staleness if max_staleness is None else max_staleness
        batch: list[list[Sample]] = []
        while self.groups and len(batch) < n_groups:
            group = self.groups.popleft()
            if self.mask_stale_tokens:  # train on what is fresh enough; drop only what is all too old
                self.masked_stale_tokens += sum(s.mask_older_than(current_version - bound) for s in group)
            all_masked = self.mask_stale_tokens and not any(any(s.loss_mask) for s in group)
            if current_version - group_version(group) > bound or all_masked:
                self.dropped_stale += 1
                self.dropped_stale_samples += len(group)
                continue
            batch.append(group)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "groups": [[s.to_dict() for s in g] for g in self.groups],
            "dropped_stale": self.dropped_stale,
            "dropped_stale_samples": self.dropped_stale_samples,
            "masked_stale_tokens": self.masked_stale_tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = deque([Sample.from_dict(d) for d in g] for g in state["groups"])
        self.dropped_stale = int(state["dropped_stale"])
        self.dropped_stale_samples = int(state["dropped_stale_samples"])
        self.masked_stale_tokens = int(state.get("masked_stale_tokens", 0))
