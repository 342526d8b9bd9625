"""Mixture-of-experts models through the whole loop (issue 41's acceptance runs): a tiny
Qwen3-MoE and the shared-expert family (Qwen2-MoE) each train 5 steps of the quickstart task
(configs/quickstart.yaml, shortened), every push landing in the engine under the checkpoint's
per-expert names, and the train-inference mismatch printed on each step's console line.

The runs are shortened to what shows the loop works: 2 prompts of 4 samples of 8 tokens a step,
no SFT warm start, no eval, no ptx, every group kept (a random model's rewards have no spread, so
the default filter would draw 8x the prompts). The policy's gradient comes from the entropy term
then, which is enough to move every step's weights.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import ROOT, SHORT_QUICKSTART, quickstart_argv
from safetensors.torch import load_file

from slimish.metrics import read_metrics

pytestmark = pytest.mark.timeout(600)

STEPS = 5
SHORT = (f"steps={STEPS}", *SHORT_QUICKSTART)


def train(tmp_path: Path, model: Path, *overrides: str, ranks: int = 1) -> tuple[list[dict], list[str]]:
    """A shortened quickstart run on `model`: its metrics rows and its console lines. With `ranks`
    > 1, through `slimish train`, which starts that many trainer ranks with torchrun."""
    argv = quickstart_argv(tmp_path, *SHORT, *overrides, model=model)
    if ranks > 1:
        argv[1:3] = ["-m", "slimish.cli", "train"]
        argv.append(f"trainer.nproc={ranks}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(tmp_path / "run"), (done.stdout + done.stderr).splitlines()


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def check_trained(tmp_path: Path, model: Path, rows: list[dict], console: list[str]) -> None:
    """5 steps trained; every step's samples came from the engine at the version pushed after the
    step before (so each push reached it); the mismatch is finite, tiny (fp32 on both sides) and
    printed; the exported model has the checkpoint's names, its experts moved."""
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert all(r["train/grad_norm"] > 0 for r in trained)
    assert [r["step"] for r in rows if "time/weight_push" in r] == list(range(STEPS + 1))  # step 0: the start
    assert all(math.isfinite(r["train/mismatch"]) and r["train/mismatch"] < 1e-4 for r in trained), trained

    printed = [line for line in console if line.startswith("step ") and " mism " in line]
    assert [line.split(":")[0] for line in printed] == [f"step {s}" for s in range(1, STEPS + 1)], console[-20:]

    versions: dict[int, set[int]] = {}
    for line in (tmp_path / "run" / "view" / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        versions.setdefault(sample["step"], set()).update(sample["weight_versions"])
    assert versions == {s: {s - 1} for s in range(1, STEPS + 1)}

    start, end = weights(model), weights(tmp_path / "run" / "hf")
    assert set(end) == set(start) and "model.layers.1.mlp.experts.7.down_proj.weight" in end
    assert not torch.equal(
        end["model.layers.0.mlp.experts.0.gate_proj.weight"], start["model.layers.0.mlp.experts.0.gate_proj.weight"]
    )


def check_replayed(rows: list[dict], replay: str) -> None:
    """Under R3 the engines were started returning routes (the run added the flag), every sample
    carried them to the trainer, and every forward applied them: `route_replayed` is exactly 1; in
    fp32 the trainer's own choices agree with the engine's too. Without replay no routes travel."""
    trained = [r for r in rows if "train/loss" in r]
    if replay == "r3":
        assert all(r["train/route_replayed"] == 1.0 and r["train/route_agreement"] > 0.99 for r in trained), trained
    else:
        assert not any("train/route_replayed" in r for r in trained)
    assert all(r["train/expert_load_max"] >= 1.0 for r in trained)


# Each family on each backend; R3 end to end on one family per backend (it costs the run nothing).
RUNS = [("qwen3_moe", "r3"), ("qwen2_moe", "none")]


@pytest.mark.parametrize(("arch", "replay"), RUNS)
def test_torch_backend_trains_five_steps(
    request: pytest.FixtureRequest, tmp_path: Path, arch: str, replay: str
) -> None:
    model = request.getfixturevalue(f"tiny_{arch}_dir")
    rows, console = train(tmp_path, model, "trainer.backend=torch", f"algorithm.routing_replay={replay}")
    check_trained(tmp_path, model, rows, console)
    check_replayed(rows, replay)


@pytest.mark.parametrize(("arch", "replay"), RUNS[::-1])
def test_megatron_backend_with_expert_parallelism_trains_five_steps(
    request: pytest.FixtureRequest, tmp_path: Path, arch: str, replay: str
) -> None:
    """2 trainer ranks, one expert group: each holds 4 of the 8 experts; the push gathers them."""
    model = request.getfixturevalue(f"tiny_{arch}_dir")
    overrides = ("trainer.backend=megatron", "trainer.ep=2", f"algorithm.routing_replay={replay}")
    rows, console = train(tmp_path, model, *overrides, ranks=2)
    check_trained(tmp_path, model, rows, console)
    check_replayed(rows, replay)
