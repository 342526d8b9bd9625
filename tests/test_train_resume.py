"""The training loop as users run it (`python -m slimish.train`), killed and resumed.

A SIGKILLed trainer resumes from its newest checkpoint with `--resume auto`; the prompts the
surviving history trained on are each trained exactly once, with none skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS, GROUPS = 6, 2


def _prompts(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n")
    return path


def _argv(model: Path, run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "slimish.train", f"model={model}", f"run_dir={run_dir}", f"data.source={data}",
        f"steps={STEPS}", f"rollout.rollout_batch_size={GROUPS}", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=6", "rollout.filter_fn=null", "checkpoint.every=1", "checkpoint.keep=2",
        "eval.every=0", "trainer.lr=1e-3", *extra,
    ]  # fmt: skip


def _trained(run_dir: Path) -> list[dict]:
    path = run_dir / "trained_prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_sigkill_then_resume_trains_every_prompt_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    data, run_dir = _prompts(tmp_path / "prompts.jsonl", 100), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(_argv(tiny_model_dir, run_dir, data), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while len(_trained(run_dir)) < 3:  # bounded wait for the third trained step
            assert first.poll() is None, first.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the first run trained fewer than 3 steps in 240 s"
            time.sleep(0.2)
    finally:
        first.kill()
        first.wait(timeout=30)
    killed_at = len(_trained(run_dir))
    assert killed_at < STEPS
    second = subprocess.run(_argv(tiny_model_dir, run_dir, data, "--resume", "auto"), env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    lineage: dict[int, list[int]] = {}
    for row in _trained(run_dir):  # a step re-run after the resume replaces the killed run's record
        lineage[row["step"]] = row["group_ids"]
    assert sorted(lineage) == list(range(1, STEPS + 1))
    trained = [gid for step in sorted(lineage) for gid in lineage[step]]
    assert len(trained) == len(set(trained)) == STEPS * GROUPS, trained
    assert sorted(trained) == list(range(STEPS * GROUPS))  # the data stream in order: nothing skipped
    assert (run_dir / "hf" / "config.json").exists()
