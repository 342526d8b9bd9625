"""The quickstart (configs/quickstart.yaml) shortened: after the SFT warm start the held-out
accuracy is near chance; ten GRPO steps later it has clearly risen. The full run is `make demo`."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_quickstart

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # minutes on a loaded machine


def test_short_quickstart_raises_held_out_accuracy(tmp_path: Path) -> None:
    rows = run_quickstart(tmp_path, "steps=10", "eval.every=10")
    before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    assert before < 0.3, f"SFT alone should leave accuracy near chance, got {before}"
    assert after >= before + 0.1, f"held-out accuracy {before} -> {after} after 10 RL steps"
    assert all(r["train/mismatch"] < 1e-4 for r in rows[1:])  # fp32 engine and trainer agree
