"""A black-box CLI harness, trained as is: `--rollout-fn rollout_plugins.cli_harness:rollout`.

    python -m rollout_plugins.harness_task.task runs/sum.jsonl --n 512
    slimish train --config C --rollout-fn rollout_plugins.cli_harness:rollout data.source=runs/sum.jsonl

The agent (`harness_task/agent.py`) is a separate program that knows nothing of slimish: it runs
unmodified in a fresh working directory holding the task's files, with its model API pointed at
this sample's gateway session by environment variables (`ctx.agent_env()`). The gateway records
the exact tokens of every model call; the reward is read from what the program left behind
(`answer.txt`). A run whose environment failed (timed out, killed by a signal, did not start, or
never reached the model) says nothing about the policy: its samples come back `infra_failed`,
left out of the loss and of the group's baseline, instead of scored 0. Copy this file, replace
the command line, the files and the checker with your harness's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rollout_plugins.harness_task.task import score, task_files
from slimish.gateway.harness import HarnessLimits, HarnessRun, run_harness
from slimish.types import Sample, SampleStatus

AGENT = Path(__file__).resolve().parent / "harness_task" / "agent.py"
LIMITS = HarnessLimits(wall_s=120.0, cpu_s=60, memory_mb=2048)


async def rollout(ctx, sample: Sample) -> list[Sample]:
    files = task_files(sample.prompt, sample.metadata)
    env, readable = await ctx.agent_env(), [AGENT.parent]  # the sandbox shows the program its own code
    with await run_harness([sys.executable, str(AGENT)], env, LIMITS, files, readable=readable) as run:
        reward = score(run.workdir, sample.label)
    return scored(ctx, sample, run, reward)


def scored(ctx, sample: Sample, run: HarnessRun, reward: float | None) -> list[Sample]:
    """The session's captured samples, each with the run's reward, or all `infra_failed` when the
    run says nothing about the policy (the harness runners of rollout_plugins share this end)."""
    samples = ctx.captured_samples()  # one per exact-token segment of the session
    error = run.infra_error or (None if samples else no_model_call(run))
    if error is not None:
        return [infra_failed(s, error) for s in samples or [sample]]
    for s in samples:
        s.reward = reward
    return samples


def no_model_call(run: HarnessRun) -> str:
    """A run that never reached the model has nothing to train on and nothing to say about the policy."""
    return f"the harness made no model call (exit code {run.exit_code}): {run.stderr[-500:].strip()}"


def infra_failed(sample: Sample, error: str) -> Sample:
    sample.status, sample.error = SampleStatus.INFRA_FAILED, error
    return sample
