"""MegatronTrainer: the same RL steps as TorchTrainer under TP, PP and DP, its weights pushed into a
real engine, its checkpoints resumed, and (slow) the quickstart learning with it.

The batches are the torch-backend tests' (random tokens, multi-turn loss masks, rollout logprobs =
the policy's + noise, so ratios clip; the second step has a rank and a mini-batch with nothing to
train on), with every loss feature on. This process takes the two steps with TorchTrainer; one
torchrun launch of tests/megatron_backend_worker.py (2 ranks) takes them with Megatron at each
layout, and the tests compare.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:  # find_spec: no ~12 s Megatron import here
    pytest.skip("megatron-core is not installed (pip install -e '.[dev]')", allow_module_level=True)

from helpers import run_quickstart, torchrun_ranks  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_trainer_torch import FEATURES, config, ptx_demos, two_steps_batches  # noqa: E402
from test_weight_sync import served  # noqa: E402

from slimish.launch.local import engine_process  # noqa: E402
from slimish.trainer.torch_backend import TorchTrainer  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # the worker launch is ~60 s alone, several times that on a loaded machine
WORKER = Path(__file__).with_name("megatron_backend_worker.py")
OVERRIDES = ["trainer.micro_batch_tokens=40", *FEATURES, "algorithm.ptx_coef=0.5"]
LAYOUTS = ("tp1_dp2", "tp2", "pp2")
TOL = 1e-5
METRICS = (
    "train/loss",
    "train/policy_loss",
    "train/grad_norm",
    "train/kl",
    "train/entropy",
    "train/clip_frac",
    "train/mismatch",
    "train/ratio",
    "train/tis",
    "train/ptx_loss",
    "reward/mean",
)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict:
    """The two steps with TorchTrainer (one process): batches, weights after each step, metrics."""
    trainer = TorchTrainer(config(tiny_model_dir, *OVERRIDES))
    steps = two_steps_batches(trainer)
    plain = [[[s.to_dict() for s in group] for group in batch] for batch in steps]
    demos = [ptx_demos(trainer, step) for step in (1, 2)]
    metrics, weights = [], []
    for step, batch in enumerate(steps, 1):
        metrics.append(trainer.train_step(batch, step, demos[step - 1]))
        weights.append({n: t.clone() for n, t in trainer.hf_tensors()})
    return {
        "batches": plain,
        "demos": [[s.to_dict() for s in d] for d in demos],
        "metrics": metrics,
        "weights": weights,
    }


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, tmp_path_factory):
    with engine_process(
        tiny_model_dir, log_path=tmp_path_factory.mktemp("logs") / "engine.log", weight_sync_timeout_s=120
    ) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def run(reference, tiny_model_dir, engine_url, tmp_path_factory) -> tuple[dict, Path]:
    """The worker on 2 ranks: rank 0's results per layout, and its output directory."""
    out = tmp_path_factory.mktemp("megatron_backend")
    layouts = [
        {"name": "tp1_dp2", "tp": 1, "pp": 1},
        {"name": "tp2", "tp": 2, "pp": 1, "resume": True, "engine_url": engine_url},
        {"name": "pp2", "tp": 1, "pp": 2},
    ]
    spec = {
        "batches": reference["batches"],
        "demos": reference["demos"],
        "layouts": layouts,
        "overrides": [f"model={tiny_model_dir}", "data.source=unused", "trainer.lr=1e-4", "steps=4", *OVERRIDES],
    }
    (out / "spec.json").write_text(json.dumps(spec))
    return torchrun_ranks(WORKER, [str(out / "spec.json"), str(out)], out)[0], out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rl_steps_equal_the_torch_backend(run, reference, layout):
    results, out = run
    for step in (1, 2):
        diff = max_diff(reference["weights"][step - 1], torch.load(out / f"{layout}_step{step}.pt"))
        assert diff <= TOL, (step, diff)
    for ours, theirs in zip(results[layout]["metrics"], reference["metrics"]):
        assert ours.keys() == theirs.keys()
        for key in METRICS:
            assert ours[key] == pytest.approx(theirs[key], rel=TOL, abs=TOL), key
    assert reference["metrics"][0]["train/clip_frac"] > 0  # the comparison has power: ratios clip


def test_steps_move_the_weights(reference, tiny_model_dir):
    """Guards the equality test above: the two reference steps really change every layer."""
    initial = dict(TorchTrainer(config(tiny_model_dir, *OVERRIDES)).hf_tensors())
    assert max_diff(initial, reference["weights"][1]) > 10 * TOL


def test_resumed_checkpoint_takes_the_same_step(run, reference):
    results, _ = run
    assert results["tp2"]["resume_diff"] == 0.0
    assert results["tp2"]["resumed_metrics"]["train/loss"] == results["tp2"]["metrics"][1]["train/loss"]


def test_tp2_push_leaves_the_engine_serving_the_export(run, engine_url):
    _, out = run
    exported = load_file(out / "tp2_hf" / "model.safetensors")
    assert max_diff(exported, torch.load(out / "tp2_step2.pt")) == 0.0
    for name, tensor in exported.items():
        assert torch.equal(served(engine_url, name, tensor.shape[0]), tensor.float()), name


def test_save_hf_loads_with_from_pretrained(run, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out = run
    model = AutoModelForCausalLM.from_pretrained(out / "tp2_hf", dtype=torch.float32)
    state, exported = model.state_dict(), torch.load(out / "tp2_step2.pt")
    assert sorted(state) == sorted(exported) and all(torch.equal(state[n], exported[n]) for n in state)
    assert (
        AutoTokenizer.from_pretrained(out / "tp2_hf").vocab_size
        == AutoTokenizer.from_pretrained(tiny_model_dir).vocab_size
    )


def test_parallel_sizes_are_checked():
    from slimish.config import load_run_config

    with pytest.raises(SystemExit, match="trainer.tp, trainer.pp and trainer.ep need trainer.backend=megatron"):
        load_run_config(None, ["model=m", "data.source=unused", "trainer.tp=2"])


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.timeout(1500)
def test_short_quickstart_learns_with_megatron(tmp_path: Path) -> None:
    """tests/test_quickstart.py with `trainer.backend=megatron`: SFT leaves accuracy near chance,
    ten GRPO steps raise it."""
    rows = run_quickstart(tmp_path, "trainer.backend=megatron", "steps=10", "eval.every=10")
    before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    assert before < 0.3, f"SFT alone should leave accuracy near chance, got {before}"
    assert after >= before + 0.1, f"held-out accuracy {before} -> {after} after 10 RL steps"
    assert all(r["train/mismatch"] < 1e-4 for r in rows[1:])  # fp32 engine and trainer agree
