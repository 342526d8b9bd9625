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
from dataclasses import dataclass
from typing import Any

from slimish.schema import at_least, doc
from slimish.types import Sample


@dataclass
class BufferConfig:
    max_staleness: int = doc(0, "weight versions a trained sample may lag behind; 0 = on-policy")
    mask_stale_tokens: bool = doc(
        False,
        "Mask out the tokens older than the bound instead of dropping the whole group (async: the long tail outlives "
        "the bound, and dropping it biases training toward short samples).",
    )

    def __post_init__(self) -> None:
        at_least(0, self, "buffer.", "max_staleness")


def group_version(group: list[Sample]) -> int:
    """The oldest weight version that produced any token the group trains on (any token at all
    when it trains on none)."""
    trained = [v for s in group for v in s.trained_versions()]
    return min(trained or [v for s in group for v in s.weight_versions] or [0])


@dataclass(frozen=True)
class Staleness:
    """The staleness rule, with one owner of `buffer.max_staleness`: how many versions behind the
    trainer a trained token may lag, what the buffer does with a group past that, and how far
    ahead an async rollout may run."""

    bound: int = 0
    mask_tokens: bool = False  # mask a group's too-old tokens instead of dropping the whole group

    @classmethod
    def of(cls, cfg: BufferConfig) -> "Staleness":
        return cls(cfg.max_staleness, cfg.mask_stale_tokens)

    def lag(self, group: list[Sample], version: int) -> int:
        return version - group_version(group)

    def too_stale(self, group: list[Sample], version: int) -> bool:
        return self.lag(group, version) > self.bound

    def groups_ahead(self, pushes: int, batch_size: int) -> int:
        """Groups an async rollout may have put in the buffer after `pushes` pushes: the batch
        being trained plus `bound` more; a group started beyond that would come out too stale."""
        return (pushes + 1 + self.bound) * batch_size


class Buffer:
    def __init__(self, staleness: Staleness = Staleness()) -> None:
        self.staleness = staleness
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

    def get_batch(self, n_groups: int, version: int = 0) -> list[list[Sample]]:
        """Up to `n_groups` groups, oldest first; groups too stale for the trainer at `version`
        are dropped (or their old tokens masked) and counted on the way."""
        rule = self.staleness
        batch: list[list[Sample]] = []
        while self.groups and len(batch) < n_groups:
            group = self.groups.popleft()
            if rule.mask_tokens:  # train on what is fresh enough; drop only what is all too old
                self.masked_stale_tokens += sum(s.mask_older_than(version - rule.bound) for s in group)
            all_masked = rule.mask_tokens and not any(any(s.loss_mask) for s in group)
            if rule.too_stale(group, version) or all_masked:
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
