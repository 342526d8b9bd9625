"""Rollout routing replay (R3) on both trainer backends: how far the trainer's logprobs sit from a bf16 engine's.

A tiny qwen3_moe (its experts' weights times `--expert-scale`: at the random init a tiny model's
experts barely matter, in a trained model they do) serves `--prompts` sequences of 16 prompt +
`--tokens` new tokens from one built-in engine in bf16, with logprobs and routes, per prompt set
(`--seeds`). Each set is scored by one RL step of the fp32 torch trainer (one process) and of the
Megatron backend at EP=2 (2 gloo ranks under torchrun, this file as the worker), with
`algorithm.routing_replay` none (the baseline, same run, same samples) and r3. Reported per backend
and mode: min-max over the seeds of train/route_agreement (the trainer's own top-k vs the engine's),
train/route_replayed (the routes applied vs the engine's), train/mismatch_seq_max (mean over sequences
of each one's largest |trainer - engine logprob|), train/mismatch, and the ratio none / r3 of
mismatch_seq_max.

    .venv/bin/python benchmarks/moe_r3.py                      # 3 seeds, experts x3 (~1 min)
    .venv/bin/python benchmarks/moe_r3.py --expert-scale 1 --seeds 1    # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from slimish.config import load_run_config  # noqa: E402
from slimish.launch.local import engine_process  # noqa: E402
from slimish.net import free_port  # noqa: E402
from slimish.processes import start_all  # noqa: E402
from slimish.protocol import decode_routed_experts  # noqa: E402
from slimish.tiny_model import make_tiny_model, scale_experts  # noqa: E402
from slimish.types import Sample  # noqa: E402

MODES = ("none", "r3")
METRICS = ("train/route_agreement", "train/route_replayed", "train/mismatch_seq_max", "train/mismatch")
GROUP = 4  # samples per group (the advantage's baseline); rewards alternate 0, 1 within a group
PROMPT_LEN = 16


def overrides(model: Path, mode: str) -> list[str]:
    return [f"model={model}", "data.source=unused", "trainer.dtype=float32", f"algorithm.routing_replay={mode}"]


def sample_sets(model: Path, args: argparse.Namespace, log: Path) -> list[list[list[dict]]]:
    """Per seed, the engine's samples (with logprobs and routes) in groups, as `Sample.to_dict`s."""
    cfg = json.loads((model / "config.json").read_text())
    layers, top_k = cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    engine = engine_process(model, log_path=log, dtype="bfloat16", enable_return_routed_experts=True)
    sets = []
    try:
        start_all([engine], timeout=120)
        for seed in range(args.seeds):
            prompts = np.random.default_rng(seed).integers(4, cfg["vocab_size"], (args.prompts, PROMPT_LEN)).tolist()
            sampling = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": args.tokens, "sampling_seed": seed}
            body = {"input_ids": prompts, "sampling_params": sampling, "return_logprob": True}
            r = httpx.post(f"{engine.url}/generate", json={**body, "return_routed_experts": True}, timeout=600)
            r.raise_for_status()
            samples = []
            for k, (ids, reply) in enumerate(zip(prompts, r.json())):
                s = Sample(prompt="", group_id=k // GROUP, index=k % GROUP)
                s.set_prompt(ids)
                meta = reply["meta_info"]
                routes = decode_routed_experts(meta["routed_experts"], layers, top_k)
                s.append_model(reply["output_ids"], [lp for lp, *_ in meta["output_token_logprobs"]], routes=routes)
                s.reward = float(k % 2)
                samples.append(s.to_dict())
            sets.append([samples[g : g + GROUP] for g in range(0, len(samples), GROUP)])
    finally:
        engine.stop()
    return sets


def groups_of(dicts: list[list[dict]]) -> list[list[Sample]]:
    return [[Sample.from_dict(d) for d in group] for group in dicts]


def torch_metrics(model: Path, sets: list[list[list[dict]]]) -> dict[str, list[dict]]:
    """Per mode, per seed: one RL step's metrics of a fresh fp32 TorchTrainer."""
    from slimish.trainer.torch_backend import TorchTrainer

    return {
        mode: [TorchTrainer(load_run_config(None, overrides(model, mode))).train_step(groups_of(s), 1) for s in sets]
        for mode in MODES
    }


def megatron_metrics(model: Path, sets: list[list[list[dict]]], work: Path) -> dict[str, list[dict]]:
    """The same on 2 gloo ranks at EP=2: one torchrun launch of this file; rank 0 writes the metrics."""
    spec, out = work / "spec.json", work / "megatron.json"
    spec.write_text(json.dumps({"model": str(model), "sets": sets}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), __file__, "--worker", str(spec), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"the Megatron ranks failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def worker(spec_path: str, out: str) -> None:
    """One rank of the Megatron run: per mode and seed, a fresh MegatronTrainer (EP=2) and one RL step."""
    import torch.distributed as dist

    from slimish.trainer.megatron_backend import MegatronTrainer, ps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    spec = json.loads(Path(spec_path).read_text())
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for mode in MODES:
        for dicts in spec["sets"]:
            ps.destroy_model_parallel()
            cfg = load_run_config(None, [*overrides(spec["model"], mode), "trainer.backend=megatron", "trainer.ep=2"])
            results[mode].append(MegatronTrainer(cfg).train_step(groups_of(dicts), 1))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def spread(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.4g}" if f"{lo:.4g}" == f"{hi:.4g}" else f"{lo:.4g}-{hi:.4g}"


def table(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    """One row per backend and mode; the r3 row carries the ratio none / r3 of mismatch_seq_max."""
    rows = ["| backend | replay | route_agreement | route_replayed | mismatch_seq_max | mismatch | none / r3 |"]
    rows.append("|---|---|---|---|---|---|---|")
    for backend, by_mode in results.items():
        for mode in MODES:
            cells = [spread([m[k] for m in by_mode[mode]]) for k in METRICS]
            ratio = "-"
            if mode == "r3":
                pairs = zip(by_mode["none"], by_mode["r3"])
                ratio = spread([a[METRICS[2]] / b[METRICS[2]] for a, b in pairs]) + "x"
            rows.append(f"| {backend} | {mode} | {' | '.join(cells)} | {ratio} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expert-scale", type=float, default=3.0, help="the experts' weights times this")
    parser.add_argument("--prompts", type=int, default=32, help="sequences per seed (a multiple of 4)")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per sequence")
    parser.add_argument("--seeds", type=int, default=3, help="prompt sets (and sampling seeds)")
    parser.add_argument("--backends", default="torch,megatron", help="comma-separated: torch, megatron")
    parser.add_argument("--model-cache", type=Path, default=Path("runs/bench-models"))
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    if args.prompts % GROUP or not set(args.backends.split(",")) <= {"torch", "megatron"}:
        parser.error(f"--prompts must be a multiple of {GROUP}; --backends names torch and/or megatron")
    torch.set_num_threads(1)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    base = args.model_cache / "qwen3_moe-tiny-seed0"
    if not (base / "model.safetensors").exists():
        make_tiny_model(base, arch="qwen3_moe")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = scale_experts(base, work / "model", args.expert_scale)
        sets = sample_sets(model, args, work / "engine.log")
        print(f"sampled {args.seeds} x {args.prompts} sequences of {PROMPT_LEN} + {args.tokens} tokens", flush=True)
        results = {}
        for backend in args.backends.split(","):
            results[backend] = torch_metrics(model, sets) if backend == "torch" else megatron_metrics(model, sets, work)
            print(f"{backend}: done", flush=True)
    print(f"\nqwen3_moe tiny, experts x{args.expert_scale:g}; min-max over {args.seeds} seeds")
    print("\n".join(table(results)))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
