"""Credit that counts a trajectory once: a conversation split into segments (context compaction)
or fanned out into branches weighs in its group's baseline as one trajectory, for every
estimator; infra-failed trajectories leave the loss and the baseline.

The segments come from a real gateway session (a real engine, the `openai` SDK, a harness that
compacts its history mid-run); the advantages are computed by the path the trainer takes.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from helpers import running_router

from slimish.formats.model import ModelFormat
from slimish.gateway.server import Gateway
from slimish.trainer.advantages import credit_weights, trajectory_advantages
from slimish.trainer.batch import trajectory_index
from slimish.trainer.config import ADVANTAGES
from slimish.types import Sample, SampleStatus

GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py): these tests only generate
OPENING = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about 7."}]
THREE = {"temperature": 0, "max_tokens": 3, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def router(engine) -> Iterator[str]:
    with running_router(worker_urls=[engine], health_check_interval=0.5) as url:
        yield url


def captured(router: str, tok: Any, agent: Any) -> list[Sample]:
    async def main() -> list[Sample]:
        gateway = Gateway(router, ModelFormat(tok))
        await gateway.start()
        try:
            client = openai.AsyncOpenAI(base_url=gateway.session_base_url("s"), api_key="x", max_retries=0, timeout=60)
            await agent(client)
            return gateway.pop_samples("s", Sample(prompt=OPENING, group_id=0, index=0))
        finally:
            await gateway.stop()

    return asyncio.run(main())


async def compacting_harness(client: openai.AsyncOpenAI) -> None:
    """Two turns, then the history replaced by a summary (what context compaction does), two more."""
    messages: list[Any] = list(OPENING)
    for _ in range(2):
        reply = await client.chat.completions.create(model="m", messages=messages, **THREE)
        messages += [reply.choices[0].message, {"role": "user", "content": "Go on."}]
    messages = [OPENING[0], {"role": "user", "content": "Summary of the talk so far: 7 is odd. Go on."}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="m", messages=messages, **THREE)
        messages += [reply.choices[0].message, {"role": "user", "content": "Go on."}]


async def subagent_harness(client: openai.AsyncOpenAI) -> None:
    """A main conversation and a subagent that starts from its first turn, their turns interleaved."""
    first = await client.chat.completions.create(model="m", messages=OPENING, **THREE)
    main_history = [*OPENING, first.choices[0].message, {"role": "user", "content": "Continue."}]
    sub_history = [*OPENING, first.choices[0].message, {"role": "user", "content": "Subtask: check it."}]
    for _ in range(2):
        for history in (sub_history, main_history):
            reply = await client.chat.completions.create(model="m", messages=history, **THREE)
            history += [reply.choices[0].message, {"role": "user", "content": "More."}]


def advantages(name: str, groups: list[list[Sample]], credit: str = "broadcast") -> list[float]:
    """The trainer's path: trajectories of the flattened groups, their advantages, the credit rule."""
    trajectory, group = trajectory_index(groups)
    rewards = torch.tensor([s.reward for g in groups for s in g], dtype=torch.float32)
    weights = torch.tensor(credit_weights(credit, trajectory))
    return trajectory_advantages(name, rewards, torch.tensor(trajectory), torch.tensor(group), weights).tolist()


def single(reward: float, tid: str) -> Sample:
    return Sample(
        prompt="p",
        tokens=[1, 2],
        response_length=1,
        loss_mask=[1],
        rollout_logprobs=[0.0],
        reward=reward,
        trajectory_id=tid,
        status=SampleStatus.COMPLETED,
    )


def test_compaction_makes_two_segments_of_one_trajectory_that_count_once(router: str, tok: Any) -> None:
    segments = captured(router, tok, compacting_harness)
    assert [s.metadata["capture"]["how"] for s in segments] == [["start", "continue"], ["fork", "continue"]]
    assert [s.loss_mask.count(1) for s in segments] == [6, 6]
    for s in segments:
        s.reward, s.trajectory_id = 1.0, "A"
    unsplit = single(1.0, "A")
    others = [single(0.0, "B"), single(1.0, "C"), single(0.0, "D")]
    other_group = [single(1.0, "E"), single(0.0, "F"), single(0.0, "G"), single(0.0, "H")]  # the batch's other prompt
    for name in ADVANTAGES:  # every estimator, uneven segment counts included
        split = advantages(name, [[*segments, *others], other_group])
        whole = advantages(name, [[unsplit, *others], other_group])
        assert split[:2] == pytest.approx([whole[0]] * 2, abs=1e-6), name  # both segments carry the unsplit advantage
        assert split[2:] == pytest.approx(whole[1:], abs=1e-6), name  # and nobody else's baseline moved
    # The credit rules share the trajectory's advantage out over its segments.
    whole_a = advantages("grpo", [[unsplit, *others]])[0]
    assert advantages("grpo", [[*segments, *others]], "split")[:2] == pytest.approx([whole_a / 2] * 2, abs=1e-6)
    assert advantages("grpo", [[*segments, *others]], "last")[:2] == pytest.approx([0.0, whole_a], abs=1e-6)


def test_a_subagent_is_a_branch_whose_shared_turn_is_trained_once(router: str, tok: Any) -> None:
    branches = captured(router, tok, subagent_harness)
    assert [s.metadata["capture"]["branch"] for s in branches] == [0, 1]
    assert [s.metadata["capture"]["segments"] for s in branches] == [1, 1]  # one root: branches, not forks
    n = branches[0].prompt_length
    shared = branches[0].tokens[: n + 3]
    assert branches[1].tokens[: n + 3] == shared  # both hold the first turn ...
    masks = [s.loss_mask[:3] for s in branches]
    assert masks == [[1, 1, 1], [0, 0, 0]]  # ... trained in one only
    assert [s.loss_mask.count(1) for s in branches] == [9, 6]  # 1 shared + 2 own turns, and 2 own turns


INFRA_PLUGIN = """
import sys
from rollout_plugins import math
from slimish.gateway.harness import HarnessLimits, run_harness
from slimish.types import SampleStatus

async def rollout(ctx, sample):
    if sample.index == 0:  # this trajectory's environment hangs past its budget
        run = await run_harness([sys.executable, "-c", "import time; time.sleep(60)"], {}, HarnessLimits(wall_s=1.0))
        run.cleanup()
        sample.status, sample.error = SampleStatus.INFRA_FAILED, run.infra_error
        return sample
    return await math.rollout(ctx, sample)
"""


@pytest.mark.slow
def test_a_harness_killed_by_its_budget_is_infra_failed_and_the_run_goes_on(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Two RL steps in which one trajectory of every group is killed by its time budget: those are
    absent from the loss and the baseline (groups of 3 train), counted, and the run goes on."""
    from helpers import ROOT

    from slimish.metrics import read_metrics

    plugin = tmp_path / "infra_plugin.py"
    plugin.write_text(INFRA_PLUGIN)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "slimish.train",
        f"model={tiny_model_dir}",
        f"run_dir={run_dir}",
        "steps=2",
        "data.source=task:max_digit",
        f"rollout.rollout_fn={plugin}:rollout",
        "rollout.filter_fn=null",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=8",
        "eval.every=0",
        "checkpoint.every=0",
        "sft.steps=0",
    ]
    import subprocess

    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in read_metrics(run_dir) if r["step"] >= 1]
    assert [r["rollout/infra_failed"] for r in rows] == [2.0, 2.0]  # one per group, two groups a step
    assert [r["rollout/groups_kept"] for r in rows] == [2.0, 2.0] and all(r["rollout/groups_failed"] == 0 for r in rows)
    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert len(trained) == 2
