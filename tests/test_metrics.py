"""The run log writes what it is given to JSONL and TensorBoard, and `slimish plot` draws it."""

from __future__ import annotations

import json

import pytest

from slimish.metrics import RunLog, read_metrics
from slimish.plot import plot


def test_run_log_and_plot(tmp_path):
    log = RunLog(tmp_path, total_steps=3, console=False)
    for step in range(4):
        log.log(step, {"reward/mean": step / 4, "time/step": 1.5, "note": "x"})
    log.log(3, {"eval/accuracy": 0.9})  # a later row for the same step merges into it
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["reward/mean"] == 0.75 and rows[3]["eval/accuracy"] == 0.9
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
    assert any((tmp_path / "tb").iterdir())
    out = plot(tmp_path)
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="no metric"):
        plot(tmp_path, keys=["train/nothing"])
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
