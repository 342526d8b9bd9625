"""torchrun worker for tests/test_megatron_moe.py: the Megatron backend on MoE models with expert
parallelism 2, in one launch of 2 ranks (Megatron's import dominates the cost).

For each MoE family: the bridge at EP=2 (logits against HF and EP=1, the export round trip),
then the trainer's two RL steps at EP=2 (one expert group of 2) via megatron_backend_worker's
`run_layout` (rank 0's `hf_tensors`, what a push sends, after each step; a checkpoint resumed),
and routing replay (R3, R2) at EP=2: the logprobs of a
batch with engine routes and one RL step on it. Rank 0 writes the results.

    python -m torch.distributed.run --nproc-per-node 2 tests/megatron_moe_worker.py SPEC.json OUT_DIR
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from gloo_rank import rank_main
from megatron_backend_worker import run_layout
from megatron_worker import diff, full_logits, hf_model, tokens

from megatron_bridge.config import load_hf_config
from megatron_bridge.hf_io import hf_tensors
from megatron_bridge.model import build_model, load_hf_weights
from megatron_bridge.weights import export_hf, stage_params
from slimish.trainer.megatron_backend import ps
from slimish.types import Sample

results: dict = {}


def check_bridge(arch: str, path: str) -> None:
    """EP=1 and EP=2 logits against HF's; at EP=2 this rank's state keys, and the export (every
    expert gathered) against the checkpoint, bit for bit."""
    cfg = load_hf_config(path)
    ids = tokens(cfg.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf_model(path)(ids).logits
    logits = {}
    for ep in (1, 2):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
        model = build_model(cfg).eval()
        load_hf_weights(model, cfg, path)
        logits[ep] = full_logits(model, ids)[..., : cfg.vocab_size]
    results[f"{arch}/logits_diff"] = diff(logits[2], ref)
    results[f"{arch}/ep2_vs_ep1"] = diff(logits[2], logits[1])
    ep_rank = ps.get_expert_model_parallel_rank()
    keys = {k for k in model.state_dict() if not k.endswith("._extra_state")}
    results[f"{arch}/state_keys_ok"] = int(keys == {p.megatron for p in stage_params(cfg, 0, 1, ep_rank, 2)})
    exported = list(export_hf(model, cfg))
    with hf_tensors(path) as get:
        results[f"{arch}/export_diff"] = max(diff(t, get(n)) for n, t in exported)
    results[f"{arch}/export_names"] = [n for n, _ in exported]


def check_replay(arch: str, run: dict, out: Path) -> None:
    """Per routing replay mode at EP=2: the logprobs of the routed batch, then one RL step on it
    (metrics; rank 0 saves the weights)."""
    from slimish.config import load_run_config
    from slimish.trainer.megatron_backend import MegatronTrainer

    routed = [[Sample.from_dict(s) for s in group] for group in run["routed"]]
    demos = [Sample.from_dict(s) for s in run["demos"][0]]
    for mode, overrides in run["replays"].items():
        ps.destroy_model_parallel()
        cfg = load_run_config(None, [*run["overrides"], *overrides, "trainer.backend=megatron", "trainer.ep=2"])
        trainer = MegatronTrainer(cfg)
        results[f"{arch}/{mode}/logprobs"] = [t.tolist() for t in trainer.logprobs([s for g in routed for s in g])]
        results[f"{arch}/{mode}/metrics"] = trainer.train_step(routed, 1, demos)
        weights = {n: t.clone() for n, t in trainer.hf_tensors()}
        if dist.get_rank() == 0:
            torch.save(weights, out / f"{arch}_{mode}_weights.pt")


def check_refusals(spec: dict) -> None:
    """The trainer's parallel sizes, refused with the field named: EP on a dense model, TP>1 on MoE."""
    from slimish.config import load_run_config
    from slimish.trainer.megatron_backend import MegatronTrainer

    run = next(iter(spec["archs"].values()))
    for key, overrides in {
        "dense_ep2": [f"model={spec['dense_model']}", "trainer.ep=2"],
        "moe_tp2": [f"model={run['model']}", "trainer.tp=2"],
    }.items():
        ps.destroy_model_parallel()
        try:
            MegatronTrainer(load_run_config(None, [*run["overrides"], "trainer.backend=megatron", *overrides]))
        except ValueError as exc:
            results[f"refused/{key}"] = str(exc)


def main(spec: dict, out: Path) -> None:
    check_refusals(spec)
    for arch, run in spec["archs"].items():
        check_bridge(arch, run["model"])
        check_replay(arch, run, out)
        for layout in spec["layouts"]:
            name = f"{arch}_{layout['name']}"
            results[name] = run_layout(run, {**layout, "name": name}, out)


if __name__ == "__main__":
    rank_main(main, results)
