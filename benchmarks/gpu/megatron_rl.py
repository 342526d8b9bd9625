"""GPU check of the Megatron trainer: TE spec, bf16, a few RL steps, each followed by a weight push.

Runs under torchrun on a CUDA machine (it refuses to run without one):

    torchrun --nproc-per-node 1 benchmarks/gpu/megatron_rl.py                     # small llama, TP=1
    torchrun --nproc-per-node 2 benchmarks/gpu/megatron_rl.py --tp 2 --model PATH # an HF llama/qwen directory

The trainer is `MegatronTrainer` in bf16 (fp32 main weights in Megatron's optimiser) on
Megatron-Core's Transformer Engine layer spec (`trainer.megatron_spec=te`: the pre-norms fused
into `linear_qkv` / `linear_fc1`, which megatron_bridge's `te` name table maps). Without an
importable `transformer_engine` it warns and uses the local spec.

Engines. The built-in engine gets the first GPU no trainer rank uses (GPU number `world size`)
in bf16, and every push reaches it over NCCL straight into its CUDA parameters. Without a spare
GPU it runs on the CPU in fp32 and pushes go over gloo (NCCL refuses two ranks of one group on
one GPU). `--engine-device` overrides the choice; `--engine-device cuda:0` on a one-GPU machine
puts it beside the trainer, pushed over gloo, which is the way to check the engine's CUDA path
there. An SGLang server (bf16, NCCL) is pushed too when `sglang` is installed and one more GPU is
spare.

Per step: rank 0 samples `--prompts` x `--n` responses from the built-in engine (random prompt
ids, temperature 1, the engine's logprobs; reward: the first response token is even), every rank
trains on them, then the weights are pushed. Printed: setup seconds, then per step rollout, train
and push seconds, push GB/s and the train/mismatch metric. Checks (exit 1 if one fails): the
model holds the spec's tensors (TE: `linear_qkv.layer_norm_weight`), the train metrics are
finite, every pushed tensor is served exactly (built-in engine: all names; SGLang: the first rows
of every name), and the engines report the pushed weight version.

Written without a GPU and not run on one yet: the CPU parts (bridge names on a stand-in TE spec,
the engine's device handling) are tested in tests/, the rest is for a GPU machine to show.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from smoke import importable, random_prompts, rollouts, served_differs, served_version  # same directory

from slimish.config import load_run_config
from slimish.engine.config import EngineConfig
from slimish.launch.local import engine_process
from slimish.launch.sglang import sglang_process
from slimish.tiny_model import make_tiny_model
from slimish.trainer.config import WeightSyncConfig
from slimish.trainer.weight_sync import WeightSync


@dataclass
class EnginePlacement:
    device: str  # the built-in engine's engine.device
    backend: str  # its weight-update group
    dtype: str
    sglang_gpu: int | None  # None: no GPU left for SGLang


def place_engines(requested: str, world: int, gpus: int) -> EnginePlacement:
    """GPUs 0..world-1 are the trainer's. NCCL needs the engine on a GPU of its own, so a GPU the
    trainer uses (or the CPU) means gloo."""
    device = requested if requested != "auto" else (f"cuda:{world}" if gpus > world else "cpu")
    index = int(device.partition(":")[2] or 0) if device.startswith("cuda") else None
    backend = "nccl" if index is not None and index >= world else "gloo"
    taken = {index} if index is not None else set()
    spare = [g for g in range(world, gpus) if g not in taken]
    return EnginePlacement(device, backend, "float32" if index is None else "bfloat16", spare[0] if spare else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory; default: the `small` tiny llama")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--spec",
        choices=("auto", "te", "local"),
        default="auto",
        help="Megatron layer spec; auto: te when transformer_engine imports, else local",
    )
    parser.add_argument(
        "--engine-device",
        default="auto",
        help="the built-in engine's device: auto (a spare GPU, else cpu), cpu or cuda:K",
    )
    parser.add_argument("--out", default="runs/bench-megatron-rl")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("megatron_rl: needs a CUDA machine (the CPU path is tests/test_megatron_backend.py)")
        return 2
    t_start = time.perf_counter()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = args.spec
    if spec == "auto":
        spec = "te" if importable("transformer_engine.pytorch") is None else "local"
        if spec == "local" and rank == 0:
            print("WARNING: transformer_engine does not import; Megatron runs on the local spec, not TE's")
    if args.engine_device != "auto":
        EngineConfig(model="unused", device=args.engine_device)  # refuses a bad name before anything starts
    place = place_engines(args.engine_device, world, torch.cuda.device_count())
    out = Path(args.out)
    model = args.model or str(out / "model")
    if rank == 0 and args.model is None and not (out / "model" / "config.json").exists():
        make_tiny_model(out / "model", arch="llama", size="small", seed=0)
    dist.barrier()
    from slimish.trainer.megatron_backend import MegatronTrainer  # after the process group: ~12 s import

    overrides = [
        f"model={model}",
        "data.source=unused",
        "trainer.backend=megatron",
        f"trainer.tp={args.tp}",
        f"trainer.pp={args.pp}",
        "trainer.dtype=bfloat16",
        f"trainer.megatron_spec={spec}",
        "trainer.lr=1e-5",
        f"steps={args.steps}",
    ]
    trainer = MegatronTrainer(load_run_config(None, overrides))
    t_trainer = time.perf_counter()
    failures: list[str] = []
    fused = [n for n in trainer.model.state_dict() if n.endswith("linear_qkv.layer_norm_weight")]
    if (spec == "te") != bool(fused):
        failures.append(f"rank {rank}: spec {spec} but {len(fused)} linear_qkv.layer_norm_weight tensors in the model")
    with ExitStack() as stack:
        engines: dict[str, str] = {}
        syncs: dict[str, WeightSync] = {}
        if rank == 0:
            print(
                f"world {world} (tp {args.tp}, pp {args.pp}), {torch.cuda.device_count()} GPUs, model {model}, "
                f"spec {spec}, bf16; trainer built in {t_trainer - t_start:.1f} s"
            )
            print(f"builtin engine: {place.device}, {place.dtype}, pushed over {place.backend}")
            engines["builtin"] = stack.enter_context(
                engine_process(model, log_path=out / "engine.log", device=place.device, dtype=place.dtype)
            ).url
            syncs["builtin"] = stack.enter_context(
                WeightSync(WeightSyncConfig(backend=place.backend), [engines["builtin"]])
            )
            if importlib.util.find_spec("sglang") is None:
                print("sglang: not installed, skipped")
            elif place.sglang_gpu is None:
                print(
                    f"sglang: skipped, no spare GPU ({torch.cuda.device_count()} GPUs, {world} trainer ranks, "
                    f"builtin engine on {place.device})"
                )
            else:
                argv = ["--dtype", "bfloat16", "--mem-fraction-static", "0.5", "--base-gpu-id", str(place.sglang_gpu)]
                engines["sglang"] = stack.enter_context(
                    sglang_process(model, argv, log_path=out / "sglang.log").start(900)
                ).url
                syncs["sglang"] = stack.enter_context(WeightSync(WeightSyncConfig(backend="nccl"), [engines["sglang"]]))
            print(f"engines up in {time.perf_counter() - t_trainer:.1f} s: {', '.join(engines)}", flush=True)
        names = [list(engines)]
        dist.broadcast_object_list(names, src=0)  # every rank takes part in each push's gather
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            groups = None
            if rank == 0:
                groups = rollouts(
                    engines["builtin"], random_prompts(step, args.prompts), args.n, step * 1000, args.max_new_tokens
                )
            box = [groups]
            dist.broadcast_object_list(box, src=0)
            t1 = time.perf_counter()
            metrics = trainer.train_step(box[0], step)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
            failures += [f"step {step}: {k} is {metrics[k]}" for k in bad]
            line = f"step {step}: rollout {t1 - t0:.2f} s, train {t2 - t1:.2f} s, mismatch {metrics.get('train/mismatch', 0):.4f}"
            for name in names[0]:
                if rank == 0:
                    push = syncs[name].push(trainer.export(), step)
                    line += f", push {name} {push['seconds']:.2f} s ({push['gb_per_s']:.2f} GB/s)"
                else:
                    for _ in trainer.hf_tensors():  # this rank's part of rank 0's gather
                        pass
            if rank == 0:
                print(line, flush=True)
        exported = {n: t.clone() for n, t in trainer.hf_tensors()}
        if rank == 0:
            for name, url in engines.items():
                bad = served_differs(
                    url, exported, None if name == "builtin" else 4, place.dtype if name == "builtin" else "bfloat16"
                )
                version = served_version(url)
                failures += [f"{name}: serves other values of {n}" for n in bad]
                if version != str(args.steps):
                    failures.append(f"{name}: reports weight version {version!r}, pushed {args.steps}")
                print(
                    f"{name}: {len(exported) - len(bad)}/{len(exported)} tensors served exactly, weight version {version}"
                )
    gathered: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, failures)
    dist.destroy_process_group()
    failures = [f for part in gathered for f in part]
    if rank == 0:
        print(f"total {time.perf_counter() - t_start:.1f} s")
        print("OK" if not failures else "FAILED:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    sys.exit(main())
