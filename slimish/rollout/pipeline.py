"""One group through the user's functions: each sample through the rollout function (at most
`rollout.max_concurrency` samples in flight), then the finished group scored (reward function,
or the rewards the rollout function set), its lengths penalised (`rollout.overlong_*`), scored by
the teacher (on-policy distillation), its rewards post-processed (`rollout.reward_post_fn`), and
filtered (filter function).

A function that raises or returns junk fails the sample (the whole group, for a function of the
group) with the error text and the place in the user's code (`fail`); the run goes on. What
becomes of a group, kept, dropped or requeued, is the manager's (slimish/rollout/manager.py).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import os
import site
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from slimish.rollout.api import RolloutContext, RolloutRuntime, is_resumable, trajectory_of
from slimish.rollout.functions import RolloutFunctions
from slimish.rollout.rewards import is_group_reward, overlong_penalty
from slimish.types import Sample, SampleStatus, trajectories

FINISHED = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


class Pipeline:
    """The user's functions over samples and groups, for training groups and evaluation alike;
    `idle` clocks the time no sample is in flight."""

    def __init__(self, runtime: RolloutRuntime, fns: RolloutFunctions) -> None:
        self.runtime, self.fns, self.cfg = runtime, fns, runtime.cfg.rollout
        self.semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
        self.idle = IdleClock()

    async def run_sample(
        self,
        sample: Sample,
        abort: asyncio.Event | None,
        sampling_params: dict[str, Any] | None = None,
        rollout_fn: Callable[..., Any] | None = None,
    ) -> tuple[list[Sample], bool]:
        """The rollout function (the run's, or an eval set's) on one sample: (the samples it
        returned, whether they can be resumed)."""
        rollout_fn = rollout_fn or self.fns.rollout_fn
        if sample.status in FINISHED:  # kept from an earlier step
            return [sample], False
        async with self.semaphore:
            if abort is not None and abort.is_set():
                return [sample], True  # never started: stays pending
            ctx = RolloutContext(self.runtime, sample, sampling_params, abort)
            self.idle.enter()
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
                    if self.fns.sample_hook is not None and s.status in FINISHED:
                        phase = "sample hook"
                        await self.fns.sample_hook(RolloutContext(self.runtime, s, sampling_params), s)
                        phase = "rollout fn"
                    s.check()
            except Exception as exc:
                fail(sample, phase, exc)
                return [sample], False
            finally:
                ctx.release()
                self.idle.leave()
            return returned, ctx.resumable or is_resumable(rollout_fn)

    async def finish(self, group: list[Sample]) -> str | None:
        """A training group whose samples all finished (or failed): scored, length-penalised,
        scored by the teacher, then filtered; the filter's reason to drop it, or None. Failed
        samples are marked, not raised."""
        if not failed(group):
            await self.score(group, self.fns.reward_fn)
            self.overlong(group)
            await self.score_teacher(group)
        if failed(group):
            return None
        try:
            return await self.filter(group)
        except Exception as exc:
            for s in group:
                fail(s, "filter fn", exc)
            return None

    async def score(self, group: list[Sample], reward_fn: Callable[..., Any] | None) -> None:
        """Rewards for a finished group, one per trajectory: a reward fn scores each trajectory's
        last sample (where its answer is), or the rollout fn set it there; every sample of the
        trajectory then carries it. A reward fn that raises or returns junk fails the sample."""
        by_trajectory = trajectories(group)
        lasts = [samples[-1] for samples in by_trajectory.values()]
        if reward_fn is None:
            for s in lasts:
                if s.reward is None and not self.runtime.cfg.algorithm.opd.task_reward:
                    s.reward = 0.0  # pure distillation: the teacher trains, no task reward is needed
                elif s.reward is None:
                    fail(s, "no reward: the rollout fn set none and rollout.reward_fn is not set")
        elif is_group_reward(reward_fn):
            await self._group_reward(group, reward_fn)
        else:

            async def one(s: Sample) -> None:
                try:
                    s.reward = _reward(await reward_fn(RolloutContext(self.runtime, s), s))
                except Exception as exc:
                    fail(s, "reward fn", exc)

            await asyncio.gather(*(one(s) for s in lasts))
        for samples in by_trajectory.values():
            last = samples[-1]
            if last.status != SampleStatus.FAILED:
                try:
                    last.reward_value(self.cfg.reward_key)
                except ValueError as exc:
                    fail(last, "reward", exc)
            for s in samples[:-1]:
                if last.status == SampleStatus.FAILED:
                    s.status, s.error = SampleStatus.FAILED, last.error
                    s.metadata["error_at"] = last.metadata.get("error_at")
                else:
                    s.reward = copy.deepcopy(last.reward)
        if self.fns.reward_post is not None and not failed(group):
            await self._post_process(group)

    async def _group_reward(self, group: list[Sample], reward_fn: Callable[..., Any]) -> None:
        """A `@group_reward` fn: one call, one reward per sample of the group, in order."""
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
                fail(s, "reward fn", exc)

    def overlong(self, group: list[Sample]) -> None:
        """`rollout.overlong_*` on a scored training group: the soft length penalty on each
        trajectory's reward (kept as `metadata["overlong_penalty"]`), truncated samples out of the
        loss. Before the filter, so a group that differs only in length is not dropped as uniform."""
        cfg = self.cfg
        if failed(group):
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

    async def score_teacher(self, group: list[Sample]) -> None:
        """On-policy distillation: the teacher's log-probs of every finished sample's response
        (`Sample.teacher_logprobs`), once per final response; a failed call fails the sample."""
        teacher = self.runtime.teacher
        if teacher is None or failed(group):
            return

        async def one(s: Sample) -> None:
            try:
                await teacher.score(s)
            except Exception as exc:
                fail(s, "teacher", exc)

        await asyncio.gather(*(one(s) for s in group if s.teacher_logprobs is None))

    async def _post_process(self, group: list[Sample]) -> None:
        """`rollout.reward_post_fn` over a scored group: its list replaces the rewards (each
        sample's own is kept as `metadata["raw_reward"]`)."""
        try:
            rewards = self.fns.reward_post(RolloutContext(self.runtime, None), group)  # type: ignore[misc]
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
                fail(s, "reward post-process", exc)

    async def filter(self, group: list[Sample]) -> str | None:
        """The filter fn's verdict: None keeps the group, a string is why it is dropped."""
        if self.fns.filter_fn is None:
            return None
        reason = self.fns.filter_fn(RolloutContext(self.runtime, None), group)
        if inspect.isawaitable(reason):
            reason = await reason
        if reason is not None and not isinstance(reason, str):
            raise TypeError(
                f"the filter fn returned {_describe_value(reason)}; expected None (keep) or a str (the reason to drop)"
            )
        return reason


class IdleClock:
    """Seconds with no rollout sample in flight: what the engines idle, as the rollout sees it.
    Read once per batch, over the time since the last read (in sync mode: training included)."""

    def __init__(self) -> None:
        self.busy, self.idle, self.since = 0, 0.0, time.perf_counter()
        self.read_at, self.read_idle = self.since, 0.0

    def fraction_since_last(self, now: float) -> float:
        """The idle share of the time from the last read's `now` to this one's. Idle time is
        counted up to `now` too, not to the moment of the call: a read that comes late (a loaded
        machine, a batch that was ready at once) would otherwise count idle time past the interval
        it divides by (1.27 seen in CI)."""
        idle = self.idle + (now - self.since if self.busy == 0 else 0.0)
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


def new_sample(row: dict[str, Any], group_id: int, index: int) -> Sample:
    """Sample `index` of group `group_id`, for a prompt row (`{"prompt", "label", "metadata"}`)."""
    return Sample(
        prompt=copy.deepcopy(row["prompt"]),
        label=row["label"],
        group_id=group_id,
        index=index,
        metadata=copy.deepcopy(row["metadata"]),
    )


def failed(group: list[Sample]) -> bool:
    return any(s.status == SampleStatus.FAILED for s in group)


def fail(sample: Sample, phase: str, exc: BaseException | None = None) -> None:
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


def signature(sample: Sample) -> tuple[str, ...]:
    """What makes two failures "the same": the phase and exception type (the error's first two
    fields, as `fail` writes them) and the place."""
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
