"""The training loop as users run it (`python -m slimish.train`), killed and resumed.

A SIGKILLed trainer resumes from its newest checkpoint with `--resume auto`; the prompts the
surviving history trained on are each trained exactly once, with none skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slimish.trainer.checkpoint import checkpoint_dir

pytestmark = pytest.mark.slow

STEPS, GROUPS = 6, 2


def _prompts(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n")
    return path


def _argv(model: Path, run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "slimish.train",
        f"model={model}",
        f"run_dir={run_dir}",
        f"data.source={data}",
        f"steps={STEPS}",
        f"rollout.rollout_batch_size={GROUPS}",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=6",
        "rollout.filter_fn=null",
        "checkpoint.every=1",
        "checkpoint.keep=2",
        "eval.every=0",
        "trainer.lr=1e-3",
        *extra,
    ]


def _trained(run_dir: Path) -> list[dict]:
    path = run_dir / "trained_prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_two_ranks_train_checkpoint_and_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The follower rank's side of the loop (the weight export, the checkpoint's state and
    barrier), which one-rank runs never take: 2 steps on 2 ranks checkpointing each, then a
    resume on 2 ranks to step 3."""
    data, run_dir = _prompts(tmp_path / "prompts.jsonl", 20), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for steps, extra in ((2, ()), (3, ("--resume", "auto"))):
        done = subprocess.run(
            _argv(tiny_model_dir, run_dir, data, f"steps={steps}", "trainer.nproc=2", *extra),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and [r["step"] for r in _trained(run_dir)] == [1, 2, 3]
    trained = [gid for r in _trained(run_dir) for gid in r["group_ids"]]
    assert sorted(trained) == list(range(3 * GROUPS))  # each prompt once, across the resume
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step_00000002", "step_00000003"]


# The trainer killed at a chosen point of a chosen step, from inside: this launcher patches the
# point to SIGKILL its own process, then runs `python -m slimish.train` as usual.
KILLER = """
import os, signal, sys
point, at = sys.argv.pop(1), int(sys.argv.pop(1))
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
def wrap(owner, name, before=None, after=None):
    original = getattr(owner, name)
    def patched(*args, **kwargs):
        if before and before(*args, **kwargs): die()
        out = original(*args, **kwargs)
        if after and after(*args, **kwargs): die()
        return out
    setattr(owner, name, patched)
from slimish.rollout.manager import RolloutManager
from slimish.trainer import checkpoint
from slimish.trainer.torch_backend import TorchTrainer
from slimish.trainer.weight_sync import WeightSync
if point == "rollout":  # while the step's second group is being taken: the first is in flight
    wrap(RolloutManager, "_take", before=lambda self, v: self.next_group_id == (at - 1) * {groups} + 1)
elif point == "train":  # the step's gradients applied, nothing pushed or saved
    wrap(TorchTrainer, "train_step", after=lambda self, groups, step, demos=None: step == at)
elif point == "push":  # the engines paused, the broadcast not begun
    wrap(WeightSync, "_push_buckets", before=lambda self, named, version: version == at)
elif point == "checkpoint":  # the state written to the temporary directory, not yet renamed
    wrap(checkpoint, "_fsync_dir", before=lambda path: path.name.startswith(".tmp-step_%08d" % at))
from slimish.train import main
sys.exit(main(sys.argv[1:]))
""".replace("{groups}", str(GROUPS))


# One run killed at each point in turn, each kill in the next step (a resume is killed again).
KILLS = {"rollout": 2, "train": 3, "push": 4, "checkpoint": 5}


def test_killed_at_each_chosen_point_resumes_training_every_prompt_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    data, run_dir = _prompts(tmp_path / "prompts.jsonl", 100), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for point, at in KILLS.items():
        argv = _argv(tiny_model_dir, run_dir, data, *(["--resume", "auto"] if at > min(KILLS.values()) else []))
        killer = [sys.executable, "-c", KILLER, point, str(at), *argv[3:]]
        first = subprocess.run(killer, env=env, capture_output=True, text=True, timeout=300)
        assert first.returncode == -9, (point, first.stderr[-3000:])
        saved = sorted(p.name for p in checkpoint_dir(run_dir).iterdir())
        assert saved[-1] == f"step_{at - 1:08d}", (point, saved)  # the killed step's checkpoint is not there
        assert (point == "checkpoint") == any(name.startswith(".tmp-") for name in saved)  # killed mid-write: ignored
    second = subprocess.run(
        _argv(tiny_model_dir, run_dir, data, "--resume", "auto"), env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    lineage: dict[int, list[int]] = {}
    for row in _trained(run_dir):  # a step re-run after a resume replaces the killed run's record
        lineage[row["step"]] = row["group_ids"]
    trained = [gid for step in sorted(lineage) for gid in lineage[step]]
    assert sorted(lineage) == list(range(1, STEPS + 1))
    assert len(trained) == len(set(trained)) == STEPS * GROUPS, trained
    assert sorted(trained) == list(range(STEPS * GROUPS))  # the data stream in order: every prompt exactly once
    assert (run_dir / "hf" / "config.json").exists()
