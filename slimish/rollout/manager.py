"""The rollout manager: prompts in, finished and scored groups of samples out, into the buffer.

One step (`run_step`) takes prompts from the data stream, makes a group of `n_samples_per_prompt`
samples for each (`group_id` = the prompt's position in the stream, `index` = 0..n-1), runs the
rollout function on each sample with at most `max_concurrency` samples in flight, then scores the
finished group (reward function) and filters it (filter function). It keeps starting groups, up
to `over_sampling` times the number still needed, until `rollout_batch_size` groups have
survived; then it aborts what is left (`POST /abort_request {"abort_all": true}` on the router,
which fans it out to every engine) and requeues those prompts for the next step. With
`partial_rollout`, a leftover group's finished samples and its aborted single-turn samples are
kept and resumed next step (multi-turn samples restart: a conversation's state is not kept).

Nothing is silently lost. Every prompt taken ends in exactly one of: a group in the buffer
(`groups_kept`), a group dropped by the filter (`groups_filtered`, with its reason), a failed group
(`groups_failed`), or the requeue (`requeued_pending`). A sample whose rollout or reward function
raises is marked failed with the error text and the run goes on; its whole group is dropped as
failed, counted once, because a group with a hole would bias group-relative advantages. Sample
counters: completed / truncated / failed over finished groups, aborted for samples cut off at a
step's end, filtered for the samples of filtered groups.

In async mode (`produce`) there is no end of step: groups keep running while the trainer trains,
up to what `buffer.max_staleness` lets it train on (see `produce`), and the trainer takes its
batches with `next_batch`. The same accounting holds; a group in flight at a checkpoint is saved
as a requeued prompt, so a resume runs it again instead of losing it.

The end-of-step abort is engine-wide: do not run `evaluate` concurrently with the end of a step.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import os
import site
import sys
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slimish.buffer import Buffer
from slimish.client import ServerError
from slimish.rollout.api import RolloutContext, RolloutRuntime, is_resumable, trajectory_of
from slimish.rollout.data import PromptData
from slimish.rollout.evaluation import EvalSet, mean, summarize
from slimish.rollout.loader import load_functions
from slimish.rollout.rewards import is_group_reward, overlong_penalty
from slimish.types import Sample, SampleStatus, trajectories

FINISHED = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
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
ABORT_RETRY_S = 1.0  # while leftovers are still running, the abort is re-sent this often (late arrivals)

log = logging.getLogger(__name__)


class RolloutStalled(RuntimeError):
    """A step took `max_prompts_factor * rollout_batch_size` prompts and no group survived."""


class RolloutFailing(RuntimeError):
    """`rollout.max_consecutive_failures` groups in a row failed the same way: an error certain to
    repeat, so the run stops instead of spending its prompts on it."""


@dataclass
class _Prompt:
    """A prompt taken from the stream, waiting for its group (again, when requeued)."""

    group_id: int
    row: dict[str, Any]  # {"prompt", "label", "metadata"}
    partial: dict[int, Sample] = field(default_factory=dict)  # index -> sample kept from an earlier step


GroupCallback = Callable[[list[Sample], "str | None"], None]


class RolloutManager:
    def __init__(
        self,
        runtime: RolloutRuntime,
        data: PromptData,
        buffer: Buffer,
        rollout_fn: Callable[..., Any],
        reward_fn: Callable[..., Any] | None = None,
        filter_fn: Callable[..., Any] | None = None,
        sample_hook: Callable[..., Any] | None = None,
        reward_post: Callable[..., Any] | None = None,
        on_group: GroupCallback | None = None,
    ) -> None:
        self.runtime, self.data, self.buffer = runtime, data, buffer
        self.cfg = runtime.cfg.rollout
        self.rollout_fn, self.reward_fn, self.filter_fn = rollout_fn, reward_fn, filter_fn
        self.sample_hook, self.reward_post = sample_hook, reward_post
        self._failing: tuple[tuple[str, ...], int] = ((), 0)  # the last failure's signature, groups in a row
        self.on_group = on_group  # called with every finished group: (group, None) kept, (group, reason) dropped
        self.semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
        self.requeued: deque[_Prompt] = deque()
        self.next_group_id = 0
        self.counters: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self.filter_reasons: Counter[str] = Counter()
        self.staleness = buffer.staleness
        self.version = 0  # the weights the engines serve (set by `weights_pushed`)
        self.producer: asyncio.Task | None = None  # async mode: `produce`, from `start` to `stop`
        self._stop_producing = asyncio.Event()
        self._inflight: dict[int, _Prompt] = {}  # group id -> its prompt, while its group runs
        self._changed = asyncio.Event()  # a new version, or a group went into the buffer
        self._idle = _IdleClock()
        self._mark()

    @classmethod
    def from_config(
        cls, runtime: RolloutRuntime, data: PromptData, buffer: Buffer, on_group: GroupCallback | None = None
    ) -> "RolloutManager":
        return cls(runtime, data, buffer, *load_functions(runtime.cfg.rollout), on_group=on_group)

    # ---- a training step --------------------------------------------------------------------

    async def run_step(self, current_version: int = 0) -> dict[str, Any]:
        """Fill the buffer with `rollout_batch_size` more groups that survive filtering."""
        self._mark()
        need, abort = self.cfg.rollout_batch_size, asyncio.Event()
        limit = math.ceil(self.cfg.max_prompts_factor * need)
        tasks: set[asyncio.Task[bool]] = set()
        kept = taken = 0
        try:
            while kept < need:
                while len(tasks) < math.ceil(self.cfg.over_sampling * (need - kept)) and taken < limit:
                    tasks.add(asyncio.create_task(self._run_group(self._take(current_version), abort)))
                    taken += 1
                if not tasks:  # the prompt cap is spent: train on what survived, if anything did
                    kept += self._refill(need - kept)
                    if kept == 0:
                        raise RolloutStalled(self._stall_message(taken, kept))
                    if kept < need:
                        log.warning("rollout step: %s", self._stall_message(taken, kept))
                    break
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                kept += sum(t.result() for t in done)
        finally:
            await self._stop(tasks, abort)
        return {**self._stats(self._step["kept"]), "groups_short": need - kept}

    def _refill(self, n: int) -> int:
        """`keep_when_insufficient`: the step's newest filtered groups (up to `n`) go into the
        buffer after all (recorded again, as kept, marked `refilled`); how many did."""
        if not self.cfg.keep_when_insufficient:
            return 0
        refill = self._step["filtered"][-n:] if n > 0 else []
        for group, reason in refill:
            self.counters["groups_filtered"] -= 1
            self.counters["filtered"] -= len(group)
            self.counters["groups_kept"] += 1
            self.counters["groups_refilled"] += 1
            self.filter_reasons[reason] -= 1
            for s in group:
                s.metadata.pop("dropped", None)
                s.metadata["refilled"] = reason
            self._add(group)
            if self.on_group is not None:
                self.on_group(group, None)
        return len(refill)

    # ---- async mode -------------------------------------------------------------------------

    async def produce(self, stop: asyncio.Event) -> None:
        """Keep groups coming while the trainer trains, until `stop` is set.

        Groups are started only while fewer than `(pushes so far + 1 + max_staleness)` batches
        have gone into the buffer (plus what the buffer dropped as stale): a group started
        later would come out too stale to train on. With max_staleness 1 the rollout runs one
        batch ahead of the trainer. In flight at a push, a request does what
        `weight_sync.pause_mode` says; its tokens record the versions that made them."""
        batch = self.cfg.rollout_batch_size
        start, kept0, dropped0 = self.version, self.counters["groups_kept"], self.buffer.dropped_stale
        limit = math.ceil(self.cfg.max_prompts_factor * batch)
        tasks: set[asyncio.Task[bool]] = set()
        taken_unkept = 0  # prompts taken since a group was last kept: the stall guard
        self._mark()
        try:
            while not stop.is_set():
                owed = self.staleness.groups_ahead(self.version - start, batch) + self.buffer.dropped_stale - dropped0
                wanted = owed - (self.counters["groups_kept"] - kept0)
                while len(tasks) < math.ceil(self.cfg.over_sampling * wanted):
                    if taken_unkept >= limit:
                        raise RolloutStalled(self._stall_message(taken_unkept, 0))
                    tasks.add(asyncio.create_task(self._run_group(self._take(self.version), stop)))
                    taken_unkept += 1
                for task in await self._wait_change(*tasks, stop.wait()):
                    tasks.discard(task)
                    if task.result():
                        taken_unkept = 0
        finally:
            await self._stop(tasks, stop)

    async def start(self, version: int) -> None:
        """Async mode: the rollout runs from now on, beside training, until `stop`."""
        await self.weights_pushed(version)
        self.producer = asyncio.create_task(self.produce(self._stop_producing))

    async def stop(self) -> None:
        """Stop producing; groups in flight are requeued (they run again after a resume)."""
        if self.producer is not None:
            self._stop_producing.set()
            await asyncio.gather(self.producer, return_exceptions=True)

    async def weights_pushed(self, version: int) -> None:
        """The engines serve `version` now: production may run ahead by one more batch."""
        self.version = version
        self._changed.set()

    async def next_batch(self, version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """The batch the trainer at `version` trains on next, no group staler than the bound, and
        its metrics; `time/rollout` is how long the trainer waited for it. Sync: roll it out now.
        Async: wait for the producer to have it."""
        n = self.cfg.rollout_batch_size
        if self.producer is None:
            stats = await self.run_step(version)
            groups, waited = self.buffer.get_batch(n, version), stats["seconds"]
        else:
            groups, stats = await self._produced(n, version)
            waited = stats["wait_seconds"]
        return groups, self._batch_metrics(groups, stats, version, waited)

    async def _produced(self, n_groups: int, version: int) -> tuple[list[list[Sample]], dict[str, Any]]:
        """`n_groups` groups from the producer, waiting for them; the stats since the last
        batch. A producer that failed fails this."""
        assert self.producer is not None
        batch: list[list[Sample]] = []
        waited = time.perf_counter()
        while True:
            batch += self.buffer.get_batch(n_groups - len(batch), version)
            if len(batch) == n_groups:
                break
            if self.producer.done():
                self.producer.result()  # raises what stopped it
                raise RuntimeError("the rollout producer stopped before the batch was full")
            await self._wait_change(self.producer)
        stats = {**self._stats(batch), "wait_seconds": time.perf_counter() - waited}
        self._mark()
        return batch, stats

    def _batch_metrics(
        self, groups: list[list[Sample]], stats: dict[str, Any], version: int, waited: float
    ) -> dict[str, float]:
        if stats["errors"]:  # the counts are in the metrics; the reasons are said here
            log.warning(
                "rollout: %d groups failed, %d samples failed on infrastructure (retried) since the last batch; first errors: %s",
                stats["groups_failed"],
                stats["infra_failed"],
                "; ".join(stats["errors"][:3]),
            )
        metrics = {f"rollout/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float)) and k != "seconds"}
        for reason, count in stats["filter_reasons"].items():
            metrics[f"rollout/filtered/{reason}"] = float(count)
        lags = Counter(self.staleness.lag(g, version) for g in groups)
        for lag, count in sorted(lags.items()):
            metrics[f"rollout/staleness/{lag}"] = float(count)
        metrics["rollout/staleness_max"] = float(max(lags, default=0))
        metrics["rollout/dropped_stale_groups"] = float(self.buffer.dropped_stale)  # ever: never trained
        metrics["rollout/masked_stale_tokens"] = float(self.buffer.masked_stale_tokens)  # ever
        metrics["time/rollout"] = waited
        return metrics

    async def _wait_change(self, *waitables: Any) -> set[asyncio.Future]:
        """Until a version change, a kept group, or one of `waitables` is done; returns the
        given futures among them that are done."""
        self._changed.clear()
        given = [w for w in waitables if isinstance(w, asyncio.Future)]
        mine = [
            asyncio.ensure_future(w) for w in (self._changed.wait(), *waitables) if not isinstance(w, asyncio.Future)
        ]
        done, _ = await asyncio.wait([*given, *mine], return_when=asyncio.FIRST_COMPLETED)
        for f in mine:
            f.cancel()
        return {f for f in done if f in given}

    def _take(self, current_version: int) -> _Prompt:
        """A requeued prompt first (dropping kept samples already too stale to train on), else a new one."""
        if self.requeued:
            prompt = self.requeued.popleft()
            for i, s in list(prompt.partial.items()):
                if self.staleness.too_stale([s], current_version):
                    del prompt.partial[i]
                    self.counters["partial_stale"] += 1
            self.counters["partial_resumed"] += sum(s.status == SampleStatus.PENDING for s in prompt.partial.values())
            return prompt
        row = next(self.data)
        self.counters["prompts_taken"] += 1
        self.next_group_id += 1
        return _Prompt(self.next_group_id - 1, row)

    async def _stop(self, tasks: set[asyncio.Task[bool]], abort: asyncio.Event) -> None:
        """Abort the leftovers and wait for them to hand back their partial samples; cancel
        (and requeue) what has not returned within `abort_timeout`."""
        if not tasks:
            return
        abort.set()
        deadline = time.monotonic() + self.cfg.abort_timeout
        while tasks and time.monotonic() < deadline:
            try:
                await self.runtime.client.abort(abort_all=True)
            except ServerError:
                pass  # an engine that is gone has nothing left to abort; the wait below is bounded
            _, tasks = await asyncio.wait(tasks, timeout=min(ABORT_RETRY_S, max(0.0, deadline - time.monotonic())))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one group --------------------------------------------------------------------------

    async def _run_group(self, prompt: _Prompt, abort: asyncio.Event) -> bool:
        """Run, score and filter one group; True when it went into the buffer."""
        samples = [prompt.partial.get(i) or self._new_sample(prompt, i) for i in range(self.cfg.n_samples_per_prompt)]
        self._inflight[prompt.group_id] = prompt
        try:  # every await is in here: a cancelled group is requeued, so its prompt is not lost
            results = await asyncio.gather(*(self._run_sample(s, abort) for s in samples))
            group = self._without_infra_failed([s for out, _ in results for s in out])
            if not group:  # every trajectory's environment failed: nothing to learn from this prompt
                self.filter_reasons["infra_failed"] += 1
                self.counters["groups_filtered"] += 1
                return False
            if not any(s.status == SampleStatus.FAILED for s in group):
                if any(s.status in (SampleStatus.ABORTED, SampleStatus.PENDING) for s in group):
                    self._leftover(prompt, results)
                    return False
                await self._score(group, self.reward_fn)
                self._overlong(group)
                await self._score_teacher(group)
            reason = None
            if not any(s.status == SampleStatus.FAILED for s in group):
                try:
                    reason = await self._filter(group)
                except Exception as exc:
                    for s in group:
                        _fail(s, "filter fn", exc)
        except asyncio.CancelledError:
            self._requeue(_Prompt(prompt.group_id, prompt.row))
            raise
        finally:
            del self._inflight[prompt.group_id]
        if any(s.status == SampleStatus.FAILED for s in group):
            error = next(s.error for s in group if s.status == SampleStatus.FAILED)
            self._finish(group, "groups_failed", f"failed: {error}")
            return False
        if reason is not None:
            self.filter_reasons[reason] += 1
            self.counters["filtered"] += len(group)
            self._step["filtered"].append((group, reason))
            self._finish(group, "groups_filtered", reason)
            return False
        self._add(group)
        self._finish(group, "groups_kept", None)
        return True

    def _add(self, group: list[Sample]) -> None:
        self.buffer.add(group)
        self._step["kept"].append(group)
        self._changed.set()

    def _new_sample(self, prompt: _Prompt, index: int) -> Sample:
        row = prompt.row
        return Sample(
            prompt=copy.deepcopy(row["prompt"]),
            label=row["label"],
            group_id=prompt.group_id,
            index=index,
            metadata=copy.deepcopy(row["metadata"]),
        )

    def _without_infra_failed(self, group: list[Sample]) -> list[Sample]:
        """The group without the trajectories whose environment failed (`infra_failed`): they say
        nothing about the policy, so they are neither trained nor part of the baseline."""
        broken = {s.trajectory_id for s in group if s.status == SampleStatus.INFRA_FAILED}
        if not broken:
            return group
        self.counters["infra_failed"] += len(broken)
        self._step["errors"].extend(
            f"{s.group_id}/{s.index} infra: {s.error}" for s in group if s.status == SampleStatus.INFRA_FAILED
        )
        if self.on_group is not None:  # kept in the record, marked
            self.on_group([s for s in group if s.trajectory_id in broken], "infra_failed")
        return [s for s in group if s.trajectory_id not in broken]

    async def _run_sample(
        self,
        sample: Sample,
        abort: asyncio.Event | None,
        sampling_params: dict[str, Any] | None = None,
        rollout_fn: Callable[..., Any] | None = None,
    ) -> tuple[list[Sample], bool]:
        """The rollout function (the run's, or an eval set's) on one sample: (the samples it
        returned, whether they can be resumed)."""
        rollout_fn = rollout_fn or self.rollout_fn
        if sample.status in FINISHED:  # kept from an earlier step
            return [sample], False
        async with self.semaphore:
            if abort is not None and abort.is_set():
                return [sample], True  # never started: stays pending
            ctx = RolloutContext(self.runtime, sample, sampling_params, abort)
            self._idle.enter()
            phase = "rollout fn"
            try:
                out = await rollout_fn(ctx, sample)
                returned = [out] if isinstance(out, Sample) else out
                if not isinstance(returned, list) or not returned or not all(isinstance(s, Sample) for s in returned):
                    raise TypeError(
                        f"the rollout fn returned {_describe_value(out)}; expected a Sample or a non-empty list of Samples"
                    )
                trajectory = trajectory_of(sample)
                for s in returned:
                    s.trajectory_id = s.trajectory_id or trajectory  # what one call returned
                    if s.status == SampleStatus.PENDING:
                        raise ValueError(
                            f"sample {s.group_id}/{s.index} came back pending: append model tokens with "
                            "ctx.generate_sample / ctx.chat / ctx.append_model (they set the status)"
                        )
                    s.response = self.runtime.tokenizer.decode(s.response_ids)
                    if self.sample_hook is not None and s.status in FINISHED:
                        phase = "sample hook"
                        await self.sample_hook(RolloutContext(self.runtime, s, sampling_params), s)
                        phase = "rollout fn"
                    s.check()
            except Exception as exc:
                _fail(sample, phase, exc)
                return [sample], False
            finally:
                ctx.release()
                self._idle.leave()
            return returned, ctx.resumable or is_resumable(rollout_fn)

    def _leftover(self, prompt: _Prompt, results: list[tuple[list[Sample], bool]]) -> None:
        """A group cut off by the end-of-step abort: its prompt goes back to the front of the line,
        with (partial_rollout) the samples worth keeping."""
        partial: dict[int, Sample] = {}
        for i, (out, resumable) in enumerate(results):
            self.counters["aborted"] += sum(s.status == SampleStatus.ABORTED for s in out)
            if not self.cfg.partial_rollout or len(out) != 1:
                continue
            s = out[0]
            if s.status in FINISHED:
                partial[i] = s
            elif s.status == SampleStatus.ABORTED and resumable and s.response_length:
                s.status = SampleStatus.PENDING
                partial[i] = s
        self._requeue(_Prompt(prompt.group_id, prompt.row, partial))

    def _requeue(self, prompt: _Prompt) -> None:
        self.requeued.append(prompt)
        self.counters["requeued"] += 1

    def _finish(self, group: list[Sample], outcome: str, dropped: str | None) -> None:
        self.counters[outcome] += 1
        self._step["samples"] += len(group)
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
            self._step["errors"].extend(f"{s.group_id}/{s.index}: {s.error}" for s in group if s.error)
        if self.on_group is not None:
            self.on_group(group, dropped)
        self._count_failures(group if outcome == "groups_failed" else [])

    def _count_failures(self, group: list[Sample]) -> None:
        """Stop the run when `max_consecutive_failures` groups in a row failed the same way (the
        same function, exception type and place): that error will not go away by itself."""
        failed = next((s for s in group if s.status == SampleStatus.FAILED), None)
        signature = _signature(failed) if failed is not None else ()
        last, count = self._failing
        count = count + 1 if signature and signature == last else int(bool(signature))
        self._failing = (signature, count)
        limit = self.cfg.max_consecutive_failures
        if limit and count >= limit:
            assert failed is not None
            raise RolloutFailing(
                f"{count} groups in a row failed the same way (rollout.max_consecutive_failures={limit}): "
                f"{failed.error}. Fix it (at {failed.metadata.get('error_at', 'unknown place')}) and resume with --resume auto"
            )

    async def _score(self, group: list[Sample], reward_fn: Callable[..., Any] | None) -> None:
        """Rewards for a finished group, one per trajectory: a reward fn scores each trajectory's
        last sample (where its answer is), or the rollout fn set it there; every sample of the
        trajectory then carries it. A reward fn that raises or returns junk fails the sample."""
        key = self.cfg.reward_key
        by_trajectory = trajectories(group)
        lasts = [samples[-1] for samples in by_trajectory.values()]
        if reward_fn is None:
            for s in lasts:
                if s.reward is None and not self.runtime.cfg.algorithm.opd.task_reward:
                    s.reward = 0.0  # pure distillation: the teacher trains, no task reward is needed
                elif s.reward is None:
                    _fail(s, "no reward: the rollout fn set none and rollout.reward_fn is not set")
        elif is_group_reward(reward_fn):
            try:
                rewards = await reward_fn(RolloutContext(self.runtime, None), group)
                if not isinstance(rewards, list) or len(rewards) != len(group):
                    raise TypeError(
                        f"the group reward fn returned {_describe_value(rewards)}; expected a list of {len(group)} rewards"
                    )
                for s, r in zip(group, rewards):
                    s.reward = _reward(r)
            except Exception as exc:
                for s in group:
                    _fail(s, "reward fn", exc)
        else:

            async def one(s: Sample) -> None:
                try:
                    s.reward = _reward(await reward_fn(RolloutContext(self.runtime, s), s))
                except Exception as exc:
                    _fail(s, "reward fn", exc)

            await asyncio.gather(*(one(s) for s in lasts))
        for samples in by_trajectory.values():
            last = samples[-1]
            if last.status != SampleStatus.FAILED:
                try:
                    last.reward_value(key)
                except ValueError as exc:
                    _fail(last, "reward", exc)
            for s in samples[:-1]:
                if last.status == SampleStatus.FAILED:
                    s.status, s.error = SampleStatus.FAILED, last.error
                    s.metadata["error_at"] = last.metadata.get("error_at")
                else:
                    s.reward = copy.deepcopy(last.reward)
        if self.reward_post is not None and not any(s.status == SampleStatus.FAILED for s in group):
            await self._post_process(group)

    def _overlong(self, group: list[Sample]) -> None:
        """`rollout.overlong_*` on a scored training group: the soft length penalty on each
        trajectory's reward (kept as `metadata["overlong_penalty"]`), truncated samples out of the
        loss. Before the filter, so a group that differs only in length is not dropped as uniform."""
        cfg = self.cfg
        if any(s.status == SampleStatus.FAILED for s in group):
            return
        if cfg.overlong_filter:
            for s in group:
                s.exclude_from_loss = s.exclude_from_loss or s.status == SampleStatus.TRUNCATED
        if not cfg.overlong_buffer:
            return
        limit = cfg.overlong_max_tokens or cfg.max_new_tokens
        for samples in trajectories(group).values():
            penalty = overlong_penalty(
                sum(sum(s.loss_mask) for s in samples), limit, cfg.overlong_buffer, cfg.overlong_penalty
            )
            for s in samples:
                s.metadata["overlong_penalty"] = penalty
                if isinstance(s.reward, dict):
                    s.reward = {**s.reward, cfg.reward_key: s.reward_value(cfg.reward_key) + penalty}
                else:
                    s.reward = s.reward_value() + penalty

    async def _score_teacher(self, group: list[Sample]) -> None:
        """On-policy distillation: the teacher's log-probs of every finished sample's response
        (`Sample.teacher_logprobs`), once per final response; a failed call fails the sample."""
        teacher = self.runtime.teacher
        if teacher is None or any(s.status == SampleStatus.FAILED for s in group):
            return

        async def one(s: Sample) -> None:
            try:
                await teacher.score(s)
            except Exception as exc:
                _fail(s, "teacher", exc)

        await asyncio.gather(*(one(s) for s in group if s.teacher_logprobs is None))

    async def _post_process(self, group: list[Sample]) -> None:
        """`rollout.reward_post_fn` over a scored group: its list replaces the rewards (each
        sample's own is kept as `metadata["raw_reward"]`)."""
        try:
            rewards = self.reward_post(RolloutContext(self.runtime, None), group)  # type: ignore[misc]
            if inspect.isawaitable(rewards):
                rewards = await rewards
            if not isinstance(rewards, list) or len(rewards) != len(group):
                raise TypeError(
                    f"the reward post-process returned {_describe_value(rewards)}; expected a list of {len(group)} rewards"
                )
            for s, r in zip(group, rewards):
                s.metadata["raw_reward"] = s.reward
                s.reward = _reward(r)
                s.reward_value(self.cfg.reward_key)
        except Exception as exc:
            for s in group:
                _fail(s, "reward post-process", exc)

    async def _filter(self, group: list[Sample]) -> str | None:
        if self.filter_fn is None:
            return None
        reason = self.filter_fn(RolloutContext(self.runtime, None), group)
        if inspect.isawaitable(reason):
            reason = await reason
        if reason is not None and not isinstance(reason, str):
            raise TypeError(
                f"the filter fn returned {_describe_value(reason)}; expected None (keep) or a str (the reason to drop)"
            )
        return reason

    # ---- evaluation -------------------------------------------------------------------------

    async def evaluate(self, eval_set: EvalSet) -> dict[str, float]:
        """One held-out set (`slimish.rollout.evaluation`): every prompt, n samples each, with the
        set's functions and sampling params; its metrics named `eval/...`. Nothing is trained
        or counted in the run's rollout counters."""

        async def group_of(i: int, row: dict[str, Any]) -> list[Sample]:
            prompt = _Prompt(i, {**row, "metadata": {**row["metadata"], "eval": True}})
            todo = [self._new_sample(prompt, j) for j in range(eval_set.n_samples_per_prompt)]
            runs = (self._run_sample(s, None, eval_set.sampling_params, eval_set.rollout_fn) for s in todo)
            group = [s for out, _ in await asyncio.gather(*runs) for s in out]
            scored = [s for s in group if s.status != SampleStatus.FAILED]
            if scored:
                await self._score(scored, eval_set.reward_fn)
            return group

        groups = await asyncio.gather(*(group_of(i, r) for i, r in enumerate(eval_set.rows)))
        metrics = summarize(list(groups), eval_set.n_samples_per_prompt, self.cfg.reward_key)
        return {eval_set.prefix() + k: v for k, v in metrics.items()}

    # ---- stats and state --------------------------------------------------------------------

    def _mark(self) -> None:
        """Start the interval the next stats describe."""
        self._since = (time.perf_counter(), Counter(self.counters), Counter(self.filter_reasons))
        self._step: dict[str, Any] = {"kept": [], "filtered": [], "samples": 0, "errors": []}

    def _stats(self, kept_groups: list[list[Sample]]) -> dict[str, Any]:
        """Counts since `_mark`; reward and length over `kept_groups` (the batch)."""
        started, before, reasons_before = self._since
        now = time.perf_counter()
        seconds = now - started
        kept = [s for g in kept_groups for s in g]
        stats: dict[str, Any] = {k: self.counters[k] - before[k] for k in COUNTERS}
        stats.update(
            requeued_pending=len(self.requeued),
            filter_reasons=dict(self.filter_reasons - reasons_before),
            errors=self._step["errors"][:10],
            seconds=seconds,
            samples_per_s=self._step["samples"] / seconds if seconds > 0 else 0.0,
            reward_mean=mean([s.reward_value(self.cfg.reward_key) for s in kept]),
            response_length_mean=mean([float(s.response_length) for s in kept]),
            truncated_fraction=mean([float(s.status == SampleStatus.TRUNCATED) for s in kept]),
            segments_per_trajectory=len(kept) / max(1, sum(len(trajectories(g)) for g in kept_groups)),
            engine_idle_fraction=self._idle.fraction_since_last(now),
        )
        return stats

    def _stall_message(self, taken: int, kept: int) -> str:
        _, before, reasons_before = self._since
        failed = self.counters["groups_failed"] - before["groups_failed"]
        filtered = self.counters["groups_filtered"] - before["groups_filtered"]
        reasons = dict(self.filter_reasons - reasons_before)
        errors = "; ".join(self._step["errors"][:3]) or "none"
        return (
            f"rollout step took {taken} prompts (rollout.max_prompts_factor={self.cfg.max_prompts_factor} x "
            f"rollout_batch_size={self.cfg.rollout_batch_size}) but only {kept} groups survived: {failed} failed, "
            f"{filtered} filtered {reasons or ''}. First errors: {errors}. If the model has solved the task (rewards "
            "all 1), stop earlier or use harder prompts; else fix the rollout / reward function, or loosen "
            "rollout.filter_fn (null keeps every group)"
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything the rollout side needs to resume: the data cursor, the buffer, and groups in
        flight as prompts to run again. Call it on the manager's loop (groups may be arriving)."""
        return {
            "data": self.data.state_dict(),
            "buffer": self.buffer.state_dict(),
            "next_group_id": self.next_group_id,
            # Groups in flight (async mode) are saved as requeued prompts: a resume runs them again.
            "requeued": [
                {"group_id": p.group_id, "row": p.row, "partial": [s.to_dict() for s in p.partial.values()]}
                for p in self.requeued
            ]
            + [{"group_id": p.group_id, "row": p.row, "partial": []} for p in self._inflight.values()],
            "counters": dict(self.counters),
            "filter_reasons": dict(self.filter_reasons),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "manager" in state:  # a checkpoint written before the manager owned the buffer's state
            state = {**state["manager"], "buffer": state["buffer"]}
        self.data.load_state_dict(state["data"])
        self.buffer.load_state_dict(state["buffer"])
        self.next_group_id = int(state["next_group_id"])
        self.requeued = deque(
            _Prompt(p["group_id"], copy.deepcopy(p["row"]), {d["index"]: Sample.from_dict(d) for d in p["partial"]})
            for p in state["requeued"]
        )
        self.counters = Counter({k: 0 for k in COUNTERS})
        self.counters.update(state["counters"])
        self.filter_reasons = Counter(state["filter_reasons"])


class _IdleClock:
    """Seconds with no rollout sample in flight: what the engines idle, as the rollout sees it.
    Read once per batch, over the time since the last read (in sync mode: training included)."""

    def __init__(self) -> None:
        self.busy, self.idle, self.since = 0, 0.0, time.perf_counter()
        self.read_at, self.read_idle = self.since, 0.0

    def fraction_since_last(self, now: float) -> float:
        idle = self.total()
        fraction = (idle - self.read_idle) / (now - self.read_at) if now > self.read_at else 0.0
        self.read_at, self.read_idle = now, idle
        return fraction

    def enter(self) -> None:
        if self.busy == 0:
            self.idle += time.perf_counter() - self.since
        self.busy += 1

    def leave(self) -> None:
        self.busy -= 1
        if self.busy == 0:
            self.since = time.perf_counter()

    def total(self) -> float:
        return self.idle + (time.perf_counter() - self.since if self.busy == 0 else 0.0)


def _fail(sample: Sample, phase: str, exc: BaseException | None = None) -> None:
    """Mark failed: `phase: Type: message (at file:line in function)`, the place also as
    `metadata["error_at"]` (the user's frame: see `_user_frame`); just `phase` without `exc`."""
    sample.status = SampleStatus.FAILED
    if exc is None:
        sample.error = phase
        return
    frame = _user_frame(exc)
    where = f"{frame.filename}:{frame.lineno}" if frame else None
    sample.error = f"{phase}: {type(exc).__name__}: {exc}" + (f" (at {where} in {frame.name})" if frame else "")
    sample.metadata["error_at"] = where


def _signature(sample: Sample) -> tuple[str, ...]:
    """What makes two failures "the same": the phase and exception type (the error's first two
    fields) and the place."""
    phase, _, rest = (sample.error or "").partition(": ")
    return (phase, rest.partition(":")[0], str(sample.metadata.get("error_at")))


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame in the user's code (not slimish's, not an installed library's), where
    their function raised or called what raised; the innermost frame when there is none."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = (os.path.dirname(os.path.dirname(__file__)) + os.sep, sys.prefix, sys.base_prefix, *site.getsitepackages())
    for frame in reversed(frames):
        if not frame.filename.startswith(ours) and not frame.filename.startswith("<"):
            return frame
    return frames[-1] if frames else None


def _reward(value: Any) -> float | dict[str, Any]:
    """A reward as returned: a number, or a dict of named values; in a dict, numbers become
    floats and other JSON values (a parsed answer, a flag) are kept as they are: they are
    logged with the sample, and `rollout.reward_key` must name a numeric one."""
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in value.items()}
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"the reward fn returned {_describe_value(value)}; expected a float or a dict with string keys")


def _describe_value(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
