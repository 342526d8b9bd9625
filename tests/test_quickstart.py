"""The quickstart (configs/quickstart.yaml) shortened: after the SFT warm start the held-out
accuracy is near chance; ten GRPO steps later it has clearly risen. The full run is `make demo`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slimish.metrics import read_metrics
from slimish.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_short_quickstart_raises_held_out_accuracy(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", arch="llama", size="tiny", seed=0)  # as `make demo` builds it
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "slimish.train", "--config", str(ROOT / "configs/quickstart.yaml"),
            f"model={model}", f"run_dir={run_dir}", "steps=10", "eval.every=10", "checkpoint.every=0"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(run_dir)
    before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    assert before < 0.3, f"SFT alone should leave accuracy near chance, got {before}"
    assert after >= before + 0.1, f"held-out accuracy {before} -> {after} after 10 RL steps"
    assert all(r["train/mismatch"] < 1e-4 for r in rows[1:])  # fp32 engine and trainer agree
