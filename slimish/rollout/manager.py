"""The rollout manager: prompts in, finished and scored groups of samples out, into the buffer.

One step (`run_step`) takes prompts from the data stream, makes a group of `n_samples_per_prompt`
samples for each (`group_id` = the prompt's position in the stream, `index` = 0..n-1), runs the
group through the user's functions (slimish/rollout/pipeline.py: the rollout function on each
sample, at most `max_concurrency` samples in flight, then the finished group scored and filtered).
It keeps starting groups, up to `over_sampling` times the number still needed, until
`rollout_batch_size` groups have survived; then it aborts what is left (`POST /abort_request
{"abort_all": true}` on the router, which fans it out to every engine) and requeues those prompts
for the next step. With `partial_rollout`, a leftover group's finished samples and its aborted
single-turn samples are kept and resumed next step (multi-turn samples restart: a conversation's
state is not kept).

Nothing is silently lost (slimish/rollout/stats.py keeps the accounts): every prompt taken ends
kept, filtered, failed or requeued. A sample whose rollout or reward function raises is marked
failed with the error text and the run goes on; its whole group is dropped as failed, counted
once, because a group with a hole would bias group-relative advantages.

In async mode (`produce`) there is no end of step: groups keep running while the trainer trains,
up to what `buffer.max_staleness` lets it train on (see `produce`), and the trainer takes its
batches with `next_batch`. The same accounting holds; a group in flight at a checkpoint is saved
as a requeued prompt, so a resume runs it again instead of losing it.

The end-of-step abort is engine-wide: do not run `evaluate` concurrently with the end of a step.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slimish.buffer import Buffer
from slimish.client import ServerError
from slimish.rollout import evaluation
from slimish.rollout.api import RolloutRuntime
from slimish.rollout.data import PromptData
from slimish.rollout.functions import RolloutFunctions
from slimish.rollout.pipeline import FINISHED, Pipeline, failed, new_sample
from slimish.rollout.stats import EnginesBehind, RolloutStalled, Tally, batch_metrics
from slimish.types import Sample, SampleStatus

if TYPE_CHECKING:
    from slimish.rollout.evaluation import EvalSet

ABORT_RETRY_S = 1.0  # while leftovers are still running, the abort is re-sent this often (late arrivals)
STALE_ROUNDS = 3  # a sync step rolls out this often at most for groups too stale to train (`_rolled_out`)

log = logging.getLogger(__name__)


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
        fns: RolloutFunctions,
        on_group: GroupCallback | None = None,
    ) -> None:
        self.runtime, self.data, self.buffer, self.fns = runtime, data, buffer, fns
        self.cfg = runtime.cfg.rollout
        self.pipeline = Pipeline(runtime, fns)
        self.tally = Tally(self.cfg, self.pipeline.idle)
        self.on_group = on_group  # called with every finished group: (group, None) kept, (group, reason) dropped
        self.requeued: deque[_Prompt] = deque()
        self.next_group_id = 0
        self.staleness = buffer.staleness
        self.version = 0  # the weights the engines serve (set by `weights_pushed`)
        self.producer: asyncio.Task | None = None  # async mode: `produce`, from `start` to `stop`
        self._stop_producing = asyncio.Event()
        self._inflight: dict[int, _Prompt] = {}  # group id -> its prompt, while its group runs
        self._changed = asyncio.Event()  # a new version, or a group went into the buffer

    @property
    def counters(self) -> Counter[str]:
        """The run's counters (slimish/rollout/stats.py)."""
        return self.tally.counters

    # ---- a training step --------------------------------------------------------------------

    async def run_step(self, current_version: int = 0) -> dict[str, Any]:
        """Fill the buffer with `rollout_batch_size` more groups that survive filtering."""
        self.tally.mark()
        need = self.cfg.rollout_batch_size
        kept = await self._fill(need, current_version)
        return {**self.tally.stats(self.tally.kept, len(self.requeued)), "groups_short": need - kept}

    async def _fill(self, need: int, current_version: int) -> int:
        """Roll out until `need` more groups survived filtering, or the prompt cap is spent
        (`max_prompts_factor * need` prompts); how many survived."""
        abort = asyncio.Event()
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
                        raise RolloutStalled(self.tally.stall_message(taken, kept))
                    if kept < need:
                        log.warning("rollout step: %s", self.tally.stall_message(taken, kept))
                    break
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                kept += sum(t.result() for t in done)
        finally:
            await self._stop(tasks, abort)
        return kept

    def _refill(self, n: int) -> int:
        """`keep_when_insufficient`: the step's newest filtered groups (up to `n`) go into the
        buffer after all (recorded again, as kept, marked `refilled`); how many did."""
        if not self.cfg.keep_when_insufficient:
            return 0
        refill = self.tally.filtered[-n:] if n > 0 else []
        for group, reason in refill:
            self.tally.refill(group, reason)
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
        self.tally.mark()
        try:
            while not stop.is_set():
                owed = self.staleness.groups_ahead(self.version - start, batch) + self.buffer.dropped_stale - dropped0
                wanted = owed - (self.counters["groups_kept"] - kept0)
                while len(tasks) < math.ceil(self.cfg.over_sampling * wanted):
                    if taken_unkept >= limit:
                        raise RolloutStalled(self.tally.stall_message(taken_unkept, 0))
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
        Async: wait for the producer to have it. The groups come in the order their prompts were
        taken, not the order they finished: the trainer's float sums follow the batch's order, and
        finishing order depends on timing (the loss differed by an ulp between runs of one seed)."""
        n = self.cfg.rollout_batch_size
        if self.producer is None:
            groups, stats = await self._rolled_out(n, version)
            waited = stats["seconds"]
        else:
            groups, stats = await self._produced(n, version)
            waited = stats["wait_seconds"]
        groups.sort(key=lambda group: group[0].group_id)
        if stats["errors"]:  # the counts are in the metrics; the reasons are said here
            log.warning(
                "rollout: %d groups failed, %d samples failed on infrastructure (retried) since the last batch; first errors: %s",
                stats["groups_failed"],
                stats["infra_failed"],
                "; ".join(stats["errors"][:3]),
            )
        return groups, batch_metrics(groups, stats, self.buffer, version, waited)

    async def _rolled_out(self, n_groups: int, version: int) -> tuple[list[list[Sample]], dict[str, Any]]:
        """Sync: `n_groups` groups rolled out now, and the stats since. Groups too stale for the
        trainer at `version` (made by an engine serving older weights than were pushed) are
        dropped by the buffer and rolled out again, up to `STALE_ROUNDS` times, as the async
        producer makes up for them; then the run stops naming each engine's weight version,
        rather than hand the trainer an empty batch."""
        self.tally.mark()
        batch: list[list[Sample]] = []
        for _ in range(STALE_ROUNDS):
            dropped = self.buffer.dropped_stale
            await self._fill(n_groups - len(batch), version)
            batch += self.buffer.get_batch(n_groups - len(batch), version)
            if len(batch) == n_groups or self.buffer.dropped_stale == dropped:  # full, or the prompt cap spent
                return batch, {**self.tally.stats(batch, len(self.requeued)), "groups_short": n_groups - len(batch)}
        raise EnginesBehind(
            f"{STALE_ROUNDS} rollout rounds in a row made groups too stale for the trainer at version {version} "
            f"(buffer.max_staleness={self.staleness.bound}; {self.buffer.dropped_stale} groups dropped so far): an "
            f"engine serves older weights than were pushed. Weight versions served: {await self._served_versions()}"
        )

    async def _served_versions(self) -> str:
        """Each engine's weight version, by the router's fan-out of `/get_weight_version` (or the
        engine's own reply, when the run talks to one engine), for an error message."""
        client = self.runtime.client
        try:
            reply = await client.request("POST", "/get_weight_version", {})
            if "workers" not in reply:
                return f"{client.base_url}: {reply['weight_version']}"
            return ", ".join(f"{w['url']}: {(w.get('body') or {}).get('weight_version')}" for w in reply["workers"])
        except (ServerError, KeyError, TypeError, AttributeError) as exc:
            return f"unknown ({client.base_url} did not say: {exc})"

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
        stats = {**self.tally.stats(batch, len(self.requeued)), "wait_seconds": time.perf_counter() - waited}
        self.tally.mark()
        return batch, stats

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
        n = self.cfg.n_samples_per_prompt
        samples = [prompt.partial.get(i) or new_sample(prompt.row, prompt.group_id, i) for i in range(n)]
        self._inflight[prompt.group_id] = prompt
        try:  # every await is in here: a cancelled group is requeued, so its prompt is not lost
            results = await asyncio.gather(*(self.pipeline.run_sample(s, abort) for s in samples))
            group = self._without_infra_failed([s for out, _ in results for s in out])
            if not group:  # every trajectory's environment failed: nothing to learn from this prompt
                self.tally.filter_reasons["infra_failed"] += 1
                self.counters["groups_filtered"] += 1
                return False
            if not failed(group) and any(s.status in (SampleStatus.ABORTED, SampleStatus.PENDING) for s in group):
                self._leftover(prompt, results)
                return False
            reason = await self.pipeline.finish(group)
        except asyncio.CancelledError:
            self._requeue(_Prompt(prompt.group_id, prompt.row))
            raise
        finally:
            del self._inflight[prompt.group_id]
        if failed(group):
            error = next(s.error for s in group if s.status == SampleStatus.FAILED)
            self._finish(group, "groups_failed", f"failed: {error}")
            return False
        if reason is not None:
            self._finish(group, "groups_filtered", reason)
            return False
        self._add(group)
        self._finish(group, "groups_kept", None)
        return True

    def _add(self, group: list[Sample]) -> None:
        self.buffer.add(group)
        self.tally.kept.append(group)
        self._changed.set()

    def _without_infra_failed(self, group: list[Sample]) -> list[Sample]:
        """The group without the trajectories whose environment failed (`infra_failed`): they say
        nothing about the policy, so they are neither trained nor part of the baseline."""
        broken = {s.trajectory_id for s in group if s.status == SampleStatus.INFRA_FAILED}
        if not broken:
            return group
        self.counters["infra_failed"] += len(broken)
        self.tally.errors.extend(
            f"{s.group_id}/{s.index} infra: {s.error}" for s in group if s.status == SampleStatus.INFRA_FAILED
        )
        if self.on_group is not None:  # kept in the record, marked
            self.on_group([s for s in group if s.trajectory_id in broken], "infra_failed")
        return [s for s in group if s.trajectory_id not in broken]

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
        """A finished group counted, handed to `on_group`; a run failing the same way stops here."""
        self.tally.finish(group, outcome, dropped)
        if self.on_group is not None:
            self.on_group(group, dropped)
        self.tally.count_failures(group if outcome == "groups_failed" else [])

    # ---- evaluation and state ---------------------------------------------------------------

    async def evaluate(self, eval_set: EvalSet) -> dict[str, float]:
        """One held-out set's metrics (slimish/rollout/evaluation.py), on this manager's engines
        and concurrency limit; nothing is trained or counted in the rollout counters."""
        return await evaluation.evaluate(self.pipeline, eval_set)

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
            **self.tally.state_dict(),
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
        self.tally.load_state_dict(state)
