"""torchrun worker for tests/test_megatron_backend.py: the Megatron trainer under every layout, in one launch.

Why one launch: importing Megatron costs 12-25 s per process. Per layout (`tp`, `pp` of 2 ranks;
data parallelism fills the rest) it builds a `MegatronTrainer`, takes the two RL steps the spec
gives, and has rank 0 write the HF export after each (`OUT/{layout}_step{k}.pt`) and the metrics.
With `resume` it also checkpoints after step 1 and checks that a fresh trainer loaded from it
takes step 2 identically. With `engine_url` it pushes the weights after step 2 to that engine
(rank 0 runs WeightSync, the other rank takes part in the TP gather) and saves the HF directory.
Megatron's parallel state is re-initialised between layouts.

    python -m torch.distributed.run --nproc-per-node 2 tests/megatron_backend_worker.py SPEC.json OUT_DIR
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from gloo_rank import rank_main

from slimish.config import load_run_config
from slimish.trainer.config import WeightSyncConfig
from slimish.trainer.megatron_backend import MegatronTrainer, ps
from slimish.trainer.weight_sync import WeightSync
from slimish.types import Sample


def batches(spec: dict) -> list[list[list[Sample]]]:
    return [[[Sample.from_dict(s) for s in group] for group in batch] for batch in spec["batches"]]


def demos(spec: dict, step: int) -> list[Sample]:
    """Step `step`'s ptx demonstrations (the spec's overrides set algorithm.ptx_coef)."""
    return [Sample.from_dict(s) for s in spec["demos"][step - 1]]


def export(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in trainer.hf_tensors()}  # collective: every rank iterates


def run_layout(spec: dict, layout: dict, out: Path) -> dict:
    ps.destroy_model_parallel()
    overrides = [
        *spec["overrides"],
        "trainer.backend=megatron",
        f"trainer.tp={layout['tp']}",
        f"trainer.pp={layout['pp']}",
        f"trainer.ep={layout.get('ep', 1)}",
    ]
    cfg = load_run_config(None, overrides)
    name, rank = layout["name"], dist.get_rank()
    trainer = MegatronTrainer(cfg)
    first, second = batches(spec)
    result: dict = {"metrics": [trainer.train_step(first, 1, demos(spec, 1))]}
    weights = export(trainer)
    if layout.get("resume"):
        state = trainer.state_dict()  # collective; complete on rank 0
        if rank == 0:
            torch.save(state, out / f"{name}_state.pt")
    result["metrics"].append(trainer.train_step(second, 2, demos(spec, 2)))
    final = export(trainer)
    if rank == 0:
        torch.save(weights, out / f"{name}_step1.pt")
        torch.save(final, out / f"{name}_step2.pt")
    if layout.get("resume"):
        dist.barrier()
        resumed = MegatronTrainer(cfg)
        resumed.load_state_dict(torch.load(out / f"{name}_state.pt", weights_only=False))  # every rank, as train.py
        result["resumed_metrics"] = resumed.train_step(batches(spec)[1], 2, demos(spec, 2))
        again = export(resumed)
        if rank == 0:
            result["resume_diff"] = max((again[n] - final[n]).abs().max().item() for n in final)
    if layout.get("engine_url"):
        push_to_engine(trainer, layout["engine_url"], out / f"{name}_hf")
    return result


def push_to_engine(trainer: MegatronTrainer, url: str, hf_dir: Path) -> None:
    if dist.get_rank() == 0:
        with WeightSync(WeightSyncConfig(timeout_s=60.0, bucket_mb=0.1), [url]) as sync:
            sync.push(trainer.export(), 2)
    else:
        trainer.join_export()
    trainer.save_hf(str(hf_dir))


def main(spec: dict, out: Path) -> None:
    for layout in spec["layouts"]:
        RESULTS[layout["name"]] = run_layout(spec, layout, out)


RESULTS: dict = {}

if __name__ == "__main__":
    rank_main(main, RESULTS)
