"""The Megatron backend on mixture-of-experts models with expert parallelism 2 (gloo, allgather
dispatcher): the bridge's logits (equal to EP=1's and HF's) and export, training steps equal to
the torch backend's (one process, every expert local), a resumed checkpoint, the names a push
sends, and routing replay (R3, R2) equal to the torch backend's. Both MoE families: Qwen3-MoE
and Qwen2-MoE (a gated shared expert). Without the lockstep, a rank aborts in the dispatcher's
all-gather (gloo: sizes differ) and the launch fails.

This process takes the reference steps with TorchTrainer; one torchrun launch of
tests/megatron_moe_worker.py (2 ranks) does the Megatron side. The batches are the torch
backend tests' (tests/test_megatron_backend.py): a rank with nothing to train on in the second
step, ptx demonstrations fewer than ranks x updates: unequal micro-batch counts per rank, which
expert parallelism must run in lockstep (the launch's wait is bounded: a hang fails the test).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:  # find_spec: no ~12 s Megatron import here
    pytest.skip("megatron-core is not installed (pip install -e '.[dev]')", allow_module_level=True)

from helpers import torchrun_ranks  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_trainer_torch import FEATURES, config, ptx_demos, two_steps_batches  # noqa: E402

from slimish.trainer.torch_backend import TorchTrainer  # noqa: E402
from slimish.types import Sample  # noqa: E402

pytestmark = pytest.mark.timeout(600)
WORKER = Path(__file__).with_name("megatron_moe_worker.py")
ARCHS = ("qwen3_moe", "qwen2_moe")
OVERRIDES = ["trainer.micro_batch_tokens=40", *FEATURES, "algorithm.ptx_coef=0.5"]
TOL = 1e-5
# Routing replay runs: R3 (the engine's routes) and R2 (the old-logprob pass's own).
REPLAYS = {
    "r3": ["algorithm.routing_replay=r3"],
    "r2": ["algorithm.routing_replay=r2", "algorithm.recompute_old_logprobs=true"],
}


def with_routes(groups: list[list[Sample]], layers: int, top_k: int, experts: int, seed: int) -> None:
    """Random engine routes for every position but the last (distinct experts per token): most
    differ from the trainer's own, so replaying them changes the logprobs."""
    rng = np.random.default_rng(seed)
    for s in (s for g in groups for s in g):
        rows = [rng.permutation(experts)[:top_k] for _ in range((len(s.tokens) - 1) * layers)]
        s.routed_experts = np.array(rows, dtype=np.int32).reshape(-1, layers, top_k)


def replayed(model_dir: Path, mode: str, first: list[list[Sample]], demos: list[Sample]) -> dict:
    """TorchTrainer with routing replay `mode`: the batch's logprobs, then one RL step."""
    trainer = TorchTrainer(config(model_dir, *OVERRIDES, *REPLAYS[mode]))
    logprobs = [t.tolist() for t in trainer.logprobs([s for g in first for s in g])]
    metrics = trainer.train_step(first, 1, demos)
    return {"logprobs": logprobs, "metrics": metrics, "weights": dict(trainer.hf_tensors())}


def reference(model_dir: Path) -> dict:
    """The two RL steps with TorchTrainer: batches, demonstrations, weights after each step, metrics;
    then, with engine routes on the first batch, one step under each routing replay."""
    trainer = TorchTrainer(config(model_dir, *OVERRIDES))
    steps = two_steps_batches(trainer)
    demos = [ptx_demos(trainer, step) for step in (1, 2)]
    plain = [t.tolist() for t in trainer.logprobs([s for g in steps[0] for s in g])]
    spec = {
        "model": str(model_dir),
        "batches": [[[s.to_dict() for s in group] for group in batch] for batch in steps],
        "demos": [[s.to_dict() for s in d] for d in demos],
        "overrides": [f"model={model_dir}", "data.source=unused", "trainer.lr=1e-4", "steps=4", *OVERRIDES],
        "replays": REPLAYS,
    }
    routed = copy.deepcopy(steps[0])
    cfg = trainer.model.config
    with_routes(routed, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts, seed=3)
    spec["routed"] = [[s.to_dict() for s in group] for group in routed]
    replays = {mode: replayed(model_dir, mode, copy.deepcopy(routed), demos[0]) for mode in REPLAYS}
    metrics, weights = [], []
    for step, batch in enumerate(steps, 1):
        metrics.append(trainer.train_step(batch, step, demos[step - 1]))
        weights.append({n: t.clone() for n, t in trainer.hf_tensors()})
    return {"spec": spec, "metrics": metrics, "weights": weights, "replays": replays, "plain_logprobs": plain}


@pytest.fixture(scope="module")
def run(tiny_qwen3_moe_dir, tiny_qwen2_moe_dir, tiny_model_dir, tmp_path_factory) -> tuple[dict, dict, Path]:
    """(the torch references per arch, rank 0's worker results, the worker's output directory)."""
    out = tmp_path_factory.mktemp("megatron_moe")
    refs = {arch: reference(d) for arch, d in zip(ARCHS, (tiny_qwen3_moe_dir, tiny_qwen2_moe_dir))}
    spec = {
        "archs": {arch: ref["spec"] for arch, ref in refs.items()},
        "dense_model": str(tiny_model_dir),
        "layouts": [{"name": "ep2", "tp": 1, "pp": 1, "ep": 2, "resume": True}],
    }
    (out / "spec.json").write_text(json.dumps(spec))
    return refs, torchrun_ranks(WORKER, [str(out / "spec.json"), str(out)], out)[0], out


def checkpoint(model_dir: str) -> dict[str, tuple[list[int], str]]:
    with safe_open(Path(model_dir) / "model.safetensors", "pt") as f:
        return {n: (list(f.get_slice(n).get_shape()), "torch.float32") for n in f.keys()}  # noqa: SIM118 (not iterable)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("arch", ARCHS)
def test_bridge_at_ep2_matches_hf_and_ep1(run, arch):
    refs, results, _ = run
    assert results[f"{arch}/logits_diff"] < TOL
    assert results[f"{arch}/ep2_vs_ep1"] < TOL
    assert results[f"{arch}/state_keys_ok"] == 1  # this rank holds experts 0-3 as local_experts.0-3
    assert results[f"{arch}/export_diff"] == 0.0  # every expert gathered, bit for bit
    assert sorted(results[f"{arch}/export_names"]) == sorted(checkpoint(refs[arch]["spec"]["model"]))


@pytest.mark.parametrize("arch", ARCHS)
def test_ep2_push_sends_the_checkpoint_names(run, arch):
    """What rank 0's `hf_tensors` yields at EP=2 (a push's tensors): the checkpoint's names,
    shapes and dtypes, every expert of both ranks."""
    refs, _, out = run
    sent = torch.load(out / f"{arch}_ep2_step2.pt")
    assert {n: (list(t.shape), str(t.dtype)) for n, t in sent.items()} == checkpoint(refs[arch]["spec"]["model"])


@pytest.mark.parametrize("arch", ARCHS)
def test_ep2_steps_equal_the_torch_backend(run, arch):
    """Two RL steps at EP=2 (the second with a rank that has nothing to train on, ptx demonstrations
    over the updates: unequal micro-batch counts run in lockstep) equal TorchTrainer's."""
    refs, results, out = run
    for step in (1, 2):
        assert max_diff(refs[arch]["weights"][step - 1], torch.load(out / f"{arch}_ep2_step{step}.pt")) <= TOL, step
    for ours, theirs in zip(results[f"{arch}_ep2"]["metrics"], refs[arch]["metrics"]):
        for key in ("train/loss", "train/grad_norm", "train/kl", "train/ptx_loss"):
            assert ours[key] == pytest.approx(theirs[key], rel=TOL, abs=TOL), key


@pytest.mark.parametrize("arch", ARCHS)
def test_ep2_checkpoint_resumes_the_same_step(run, arch):
    _, results, _ = run
    assert results[f"{arch}_ep2"]["resume_diff"] == 0.0
    assert results[f"{arch}_ep2"]["resumed_metrics"]["train/loss"] == results[f"{arch}_ep2"]["metrics"][1]["train/loss"]


@pytest.mark.parametrize("arch", ARCHS)
def test_r3_logprobs_equal_the_torch_backends_replayed_ones(run, arch):
    """The same samples and engine routes through both backends (Megatron at EP=2): equal replayed
    logprobs; the routes matter (they differ from the unreplayed ones)."""
    refs, results, _ = run
    ours, theirs = results[f"{arch}/r3/logprobs"], refs[arch]["replays"]["r3"]["logprobs"]
    plain = refs[arch]["plain_logprobs"]
    assert max(max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(ours, theirs)) <= TOL
    assert max(max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(ours, plain)) > 100 * TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", REPLAYS)
def test_replayed_step_equals_the_torch_backends(run, arch, mode):
    """One RL step under replay at EP=2 equals the torch backend's: weights (the router's included:
    the replayed experts' weights keep its gradient) and the routing metrics."""
    refs, results, out = run
    ref = refs[arch]["replays"][mode]
    weights = torch.load(out / f"{arch}_{mode}_weights.pt")
    assert max_diff(ref["weights"], weights) <= TOL
    router = "model.layers.0.mlp.gate.weight"
    start = load_file(Path(refs[arch]["spec"]["model"]) / "model.safetensors")[router]
    assert (weights[router] - start).abs().max() > 10 * TOL
    ours = results[f"{arch}/{mode}/metrics"]
    for key in ("train/loss", "train/grad_norm", "train/route_agreement", "train/route_replayed"):
        assert ours[key] == pytest.approx(ref["metrics"][key], rel=TOL, abs=TOL), key
    if mode == "r3":  # random engine routes: the trainer's own mostly differ; the forwards applied them all
        assert ours["train/route_agreement"] < 0.5 and ours["train/route_replayed"] == 1.0


def test_parallel_sizes_are_refused_by_name(run):
    _, results, _ = run
    assert "trainer.ep=2" in results["refused/dense_ep2"] and "needs a MoE model" in results["refused/dense_ep2"]
    assert "trainer.tp=2: Megatron trains a MoE model" in results["refused/moe_tp2"]
