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
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first.pop("time") > 0 and first == {
        "step": 0,
        "reward/mean": 0.0,
        "time/step": 1.5,
        "note": "x",
    }  # all kept, as given


def test_console_prints_one_line_per_step_and_a_summary(tmp_path, capsys, monkeypatch):
    """Every console key at its widest still fits one 80-column line (it used to wrap)."""
    monkeypatch.setenv("COLUMNS", "80")
    log = RunLog(tmp_path, total_steps=2, console=True)
    wide = {
        "reward/mean": 0.123,
        "eval/accuracy": 0.5,
        "response/length": 1234.5,
        "train/kl": 1.2e-3,
        "train/mismatch": 3e-7,
        "time/step": 123.4,
        "time/weight_push": 10.25,
    }
    log.log(1, wide)
    log.log(2, {**wide, "reward/mean": 0.75})
    log.message(log.summary())
    log.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == [
        "step 1: reward 0.123 acc 0.500 len 1234 kl 1e-03 mism 3e-07 t 123.4s push 10.2s",
        "step 2: reward 0.750 acc 0.500 len 1234 kl 1e-03 mism 3e-07 t 123.4s push 10.2s",
    ] and all(len(line) <= 80 for line in lines)
    assert lines[2] == "reward 0.123 -> 0.750, acc 0.500 -> 0.500, len 1234 -> 1234"
