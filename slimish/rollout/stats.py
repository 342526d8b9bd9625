"""The rollout's accounting: its counters, what they report per batch, and the two ways they stop
a run (`RolloutStalled`, `RolloutFailing`).

Nothing is silently lost. Every prompt taken ends in exactly one of: a group in the buffer
(`groups_kept`), a group dropped by the filter (`groups_filtered`, with its reason), a failed group
(`groups_failed`), or the requeue (`requeued_pending`). Sample counters: completed / truncated /
failed over finished groups, aborted for samples cut off at a step's end, filtered for the samples
of filtered groups.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from slimish.buffer import Buffer
from slimish.rollout.evaluation import mean
from slimish.rollout.pipeline import IdleClock, signature
from slimish.types import Sample, SampleStatus, trajectories

if TYPE_CHECKING:
    from slimish.rollout.config import RolloutConfig

COUNTERS = (
    "prompts_taken",
    "groups_kept",
    "groups_filtered",
    "groups_failed",
    "requeued",
    "completed",
    "truncated",
    "aborted",
    "failed",
    "filtered",
    "partial_resumed",
    "partial_stale",
    "infra_failed",
    "forks",
    "realignments",
    "groups_refilled",
    "retokenized_mismatch",
)


class RolloutStalled(RuntimeError):
    """A step took `max_prompts_factor * rollout_batch_size` prompts and no group survived."""


class EnginesBehind(RolloutStalled):
    """A sync step's groups kept coming out too stale to train on: an engine serves older weights
    than the trainer pushed (slimish/rollout/manager.py, `_rolled_out`)."""


class RolloutFailing(RuntimeError):
    """`rollout.max_consecutive_failures` groups in a row failed the same way: an error certain to
    repeat, so the run stops instead of spending its prompts on it."""


class Tally:
    """The run's counters (`counters`, `filter_reasons`: saved with a checkpoint), and what the
    interval since `mark` kept, filtered and failed: the next stats describe that interval."""

    def __init__(self, cfg: RolloutConfig, idle: IdleClock) -> None:
        self.cfg, self.idle = cfg, idle
        self.counters: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self.filter_reasons: Counter[str] = Counter()
        self._failing: tuple[tuple[str, ...], int] = ((), 0)  # the last failure's signature, groups in a row
        self.mark()

    def mark(self) -> None:
        """Start the interval the next stats describe."""
        self._since = (time.perf_counter(), Counter(self.counters), Counter(self.filter_reasons))
        self.kept: list[list[Sample]] = []
        self.filtered: list[tuple[list[Sample], str]] = []  # (group, reason): `keep_when_insufficient` takes them
        self.samples = 0
        self.errors: list[str] = []

    def finish(self, group: list[Sample], outcome: str, dropped: str | None) -> None:
        """Count a finished group: `outcome` groups_kept / groups_filtered / groups_failed, and
        `dropped` (the reason) written into each dropped sample's metadata."""
        self.counters[outcome] += 1
        self.samples += len(group)
        if outcome == "groups_filtered":
            assert dropped is not None
            self.filter_reasons[dropped] += 1
            self.counters["filtered"] += len(group)
            self.filtered.append((group, dropped))
        for s in group:
            if s.status.value in self.counters:
                self.counters[s.status.value] += 1
            if dropped is not None:
                s.metadata["dropped"] = dropped
        for samples in trajectories(group).values():  # a captured session's forks and realignments, once per trajectory
            capture = samples[0].metadata.get("capture")
            if isinstance(capture, dict):
                self.counters["forks"] += max(0, int(capture.get("segments", 1)) - 1)
                self.counters["realignments"] += int(capture.get("realignments", 0))
        self.counters["retokenized_mismatch"] += sum(int(s.metadata.get("retokenized_mismatch", 0)) for s in group)
        if outcome == "groups_failed":
            self.errors.extend(f"{s.group_id}/{s.index}: {s.error}" for s in group if s.error)

    def refill(self, group: list[Sample], reason: str) -> None:
        """A filtered group recorded again, as kept, marked `refilled` (`keep_when_insufficient`)."""
        self.counters["groups_filtered"] -= 1
        self.counters["filtered"] -= len(group)
        self.counters["groups_kept"] += 1
        self.counters["groups_refilled"] += 1
        self.filter_reasons[reason] -= 1
        for s in group:
            s.metadata.pop("dropped", None)
            s.metadata["refilled"] = reason

    def count_failures(self, group: list[Sample]) -> None:
        """Stop the run when `max_consecutive_failures` groups in a row failed the same way (the
        same function, exception type and place): that error will not go away by itself. `group`
        is the failed group, or empty for any other outcome."""
        failed = next((s for s in group if s.status == SampleStatus.FAILED), None)
        key = signature(failed) if failed is not None else ()
        last, count = self._failing
        count = count + 1 if key and key == last else int(bool(key))
        self._failing = (key, count)
        limit = self.cfg.max_consecutive_failures
        if limit and count >= limit:
            assert failed is not None
            raise RolloutFailing(
                f"{count} groups in a row failed the same way (rollout.max_consecutive_failures={limit}): "
                f"{failed.error}. Fix it (at {failed.metadata.get('error_at', 'unknown place')})"
            )

    def stats(self, kept_groups: list[list[Sample]], requeued_pending: int) -> dict[str, Any]:
        """Counts since `mark`; reward and length over `kept_groups` (the batch)."""
        started, before, reasons_before = self._since
        now = time.perf_counter()
        seconds = now - started
        kept = [s for g in kept_groups for s in g]
        stats: dict[str, Any] = {k: self.counters[k] - before[k] for k in COUNTERS}
        stats.update(
            requeued_pending=requeued_pending,
            filter_reasons=dict(self.filter_reasons - reasons_before),
            errors=self.errors[:10],
            seconds=seconds,
            samples_per_s=self.samples / seconds if seconds > 0 else 0.0,
            reward_mean=mean([s.reward_value(self.cfg.reward_key) for s in kept]),
            response_length_mean=mean([float(s.response_length) for s in kept]),
            truncated_fraction=mean([float(s.status == SampleStatus.TRUNCATED) for s in kept]),
            segments_per_trajectory=len(kept) / max(1, sum(len(trajectories(g)) for g in kept_groups)),
            engine_idle_fraction=self.idle.fraction_since_last(now),
        )
        return stats

    def stall_message(self, taken: int, kept: int) -> str:
        _, before, reasons_before = self._since
        failed = self.counters["groups_failed"] - before["groups_failed"]
        filtered = self.counters["groups_filtered"] - before["groups_filtered"]
        reasons = dict(self.filter_reasons - reasons_before)
        errors = "; ".join(self.errors[:3]) or "none"
        return (
            f"rollout step took {taken} prompts (rollout.max_prompts_factor={self.cfg.max_prompts_factor} x "
            f"rollout_batch_size={self.cfg.rollout_batch_size}) but only {kept} groups survived: {failed} failed, "
            f"{filtered} filtered {reasons or ''}. First errors: {errors}. If the model has solved the task (rewards "
            "all 1), stop earlier or use harder prompts; else fix the rollout / reward function, or loosen "
            "rollout.filter_fn (null keeps every group)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.counters), "filter_reasons": dict(self.filter_reasons)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters = Counter({k: 0 for k in COUNTERS})
        self.counters.update(state["counters"])
        self.filter_reasons = Counter(state["filter_reasons"])


def batch_metrics(
    groups: list[list[Sample]], stats: dict[str, Any], buffer: Buffer, version: int, waited: float
) -> dict[str, float]:
    """A batch's `rollout/...` metrics from its stats, its groups' staleness at `version`, and
    `time/rollout`: `waited`, how long the trainer waited for it."""
    metrics = {f"rollout/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float)) and k != "seconds"}
    for reason, count in stats["filter_reasons"].items():
        metrics[f"rollout/filtered/{reason}"] = float(count)
    lags = Counter(buffer.staleness.lag(g, version) for g in groups)
    for lag, count in sorted(lags.items()):
        metrics[f"rollout/staleness/{lag}"] = float(count)
    metrics["rollout/staleness_max"] = float(max(lags, default=0))
    metrics["rollout/dropped_stale_groups"] = float(buffer.dropped_stale)  # ever: never trained
    metrics["rollout/masked_stale_tokens"] = float(buffer.masked_stale_tokens)  # ever
    metrics["time/rollout"] = waited
    return metrics
