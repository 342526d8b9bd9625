"""GPU check of `launch.engine_kind: sglang`: a few RL steps of `slimish train` with a real SGLang engine; timings and self-checks.

    python benchmarks/gpu/sglang_rl.py                          # small tiny llama, torch trainer, 3 steps (~3-5 min)
    python benchmarks/gpu/sglang_rl.py --backend megatron       # the Megatron-Core trainer instead
    python benchmarks/gpu/sglang_rl.py --model PATH --steps 5   # an HF llama / qwen2 / qwen3 directory

The run is the real entry point (`torchrun -m slimish.train`, one rank): the launcher starts
`python -m sglang.launch_server` from `launch.sglang_args`, waits for its health, puts a router in
front of it; the trainer pushes its weights after every step over a NCCL group with the server.
NCCL refuses two ranks of one group on the same GPU, so first a 10-second probe forms such a
group: with two or more GPUs the server takes GPU 1 and the push is NCCL; with one GPU the probe
decides, and when NCCL refuses the run pushes by `weight_sync.transport=disk` (said so loudly).

Printed: the probe's outcome, the SGLang command line, per step rollout / train / push seconds,
and the whole run's wall time. Checks (exit 1 if one fails): the run exits 0, every step trained
`--prompts` groups, and step k's samples carry weight version k-1 as the SGLang server reported
it (so each push reached the server and was served).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slimish.net import free_port
from slimish.metrics import read_metrics
from slimish.tiny_model import make_tiny_model


def _probe_rank(rank: int, port: int, result: "mp.Queue") -> None:
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))  # fmt: skip
        t = torch.full((1 << 18,), float(rank == 0), device="cuda")
        dist.broadcast(t, src=0)
        torch.cuda.synchronize()
        result.put((rank, bool(t.eq(1).all()), ""))
        dist.destroy_process_group()
    except Exception as exc:  # the outcome is the message: NCCL's "Duplicate GPU detected"
        result.put((rank, False, f"{type(exc).__name__}: {str(exc).splitlines()[-1] if str(exc) else ''}"))


def nccl_same_gpu() -> tuple[bool, str]:
    """Whether two processes on GPU 0 can form a NCCL group and broadcast (bounded: 120 s)."""
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_probe_rank, args=(r, port, result)) for r in range(2)]
    for p in procs:
        p.start()
    outcomes = []
    try:
        for _ in procs:
            outcomes.append(result.get(timeout=120))
    except Exception:
        outcomes.append((-1, False, "no answer within 120 s"))
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    ok = len(outcomes) == 2 and all(o[1] for o in outcomes)
    return ok, "; ".join(o[2] for o in outcomes if o[2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory; default: the `small` tiny llama")
    parser.add_argument("--backend", choices=("torch", "megatron"), default="torch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="groups per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang --mem-fraction-static (the trainer shares GPU 0)")
    parser.add_argument("--out", default="runs/bench-sglang-rl")
    args = parser.parse_args()
    if not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None:
        print("sglang_rl: needs a CUDA machine with sglang installed (the CPU path is tests/test_launch_sglang.py)")
        return 2
    out = Path(args.out).absolute()
    model = args.model or str(out / "model")
    if args.model is None and not (out / "model" / "config.json").exists():
        make_tiny_model(out / "model", arch="llama", size="small", seed=0)

    sglang_args = ["--mem-fraction-static", str(args.mem_fraction), "--dtype", "bfloat16"]
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        sglang_args += ["--base-gpu-id", "1"]
        transport = ["weight_sync.backend=nccl"]
        print(f"{gpus} GPUs: trainer on GPU 0, SGLang on GPU 1, weight sync over NCCL")
    else:
        started = time.perf_counter()
        ok, why = nccl_same_gpu()
        print(f"NCCL, two ranks on one GPU: {'works' if ok else 'refused'} ({time.perf_counter() - started:.1f} s){': ' + why if why else ''}")
        if ok:
            transport = ["weight_sync.backend=nccl"]
        else:
            transport = ["weight_sync.transport=disk", f"weight_sync.disk_dir={out / 'pushes'}"]
            print("ONE GPU: NCCL cannot join trainer and server on it, so this run pushes by disk, NOT NCCL; "
                  "give it a second GPU for the NCCL path")  # fmt: skip
    run_dir = out / f"run-{args.backend}-{int(time.time())}"
    overrides = [f"model={model}", f"run_dir={run_dir}", f"steps={args.steps}", "data.source=task:max_digit",
                 "launch.engine_kind=sglang", f"launch.sglang_args=[{','.join(sglang_args)}]",
                 f"trainer.backend={args.backend}", "trainer.dtype=bfloat16", "weight_sync.dtype=bfloat16",
                 "rollout.filter_fn=null", f"rollout.rollout_batch_size={args.prompts}",
                 f"rollout.n_samples_per_prompt={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 "eval.every=0", "checkpoint.every=0", *transport]  # fmt: skip
    argv = ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "slimish.train", *overrides]
    print("sglang command line: python -m sglang.launch_server --model-path", model, "--host 127.0.0.1 --port <free>", *sglang_args)
    print("run:", " ".join(argv), flush=True)
    started = time.perf_counter()
    done = subprocess.run(argv, env={**os.environ, "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}, timeout=3000)
    wall = time.perf_counter() - started

    failures = [] if done.returncode == 0 else [f"slimish train exited with {done.returncode} (logs: {run_dir / 'logs'})"]
    rows = [r for r in read_metrics(run_dir) if r["step"] >= 1] if (run_dir / "metrics.jsonl").exists() else []
    first = read_metrics(run_dir)[0] if rows else {}
    if first.get("step") == 0:
        print(f"initial push {first.get('time/weight_push', float('nan')):.2f} s")
    for r in rows:
        print(f"step {r['step']}: rollout {r.get('time/rollout', float('nan')):.2f} s, train {r.get('time/train', float('nan')):.2f} s, "
              f"push {r.get('time/weight_push', float('nan')):.2f} s, step {r.get('time/step', float('nan')):.2f} s")  # fmt: skip
    print(f"run wall time {wall:.1f} s (SGLang start, model load and {args.steps} steps)")
    if len(rows) != args.steps:
        failures.append(f"{len(rows)} steps logged, expected {args.steps}")
    trained_file = run_dir / "trained_prompts.jsonl"
    trained = [json.loads(line) for line in trained_file.read_text().splitlines()] if trained_file.exists() else []
    for t in trained:
        if len(t["group_ids"]) != args.prompts:
            failures.append(f"step {t['step']} trained {len(t['group_ids'])} groups, expected {args.prompts}")
        if any(v != [t["step"] - 1] for v in t["versions"]):
            failures.append(f"step {t['step']}: samples carry weight versions {t['versions']}, expected [{t['step'] - 1}]")
    print("OK" if not failures else "FAILED:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
