"""Async training end to end: the quickstart, shortened, with the rollout running beside the
trainer under a staleness bound. It must learn as the sync loop does (tests/test_quickstart.py),
train no token staler than the bound, and every trained sample's versions must be pushes that
happened before its step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_quickstart

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # minutes on a loaded machine


@pytest.mark.parametrize("bound, pause_mode, mask", [(1, "retract", False), (2, "abort", True)])
def test_async_quickstart_learns_within_the_staleness_bound(tmp_path: Path, bound: int, pause_mode: str, mask: bool) -> None:
    rows = run_quickstart(tmp_path, "steps=10", "eval.every=10", "mode=async", f"buffer.max_staleness={bound}",
                          f"weight_sync.pause_mode={pause_mode}", f"rollout.partial_rollout={pause_mode == 'abort'}",
                          f"buffer.mask_stale_tokens={mask}")  # fmt: skip
    run_dir = tmp_path / "run"
    before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    assert before < 0.3 and after >= before + 0.1, f"held-out accuracy {before} -> {after} after 10 async RL steps"
    assert all(r["rollout/staleness_max"] <= bound for r in rows[1:])
    assert max(r["rollout/staleness_max"] for r in rows[1:]) >= 1  # the rollout did run ahead

    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(1, 11))
    for t in trained:
        for versions in t["versions"]:  # version v = the weights pushed after step v (0: the start)
            assert versions and all(t["step"] - 1 - bound <= v <= t["step"] - 1 for v in versions), t
    ids = [i for t in trained for i in t["group_ids"]]
    assert len(ids) == len(set(ids))  # no prompt trained twice
