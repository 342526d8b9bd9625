"""CPU time of one engine decode step, in-process (no HTTP, no scheduler), and where it goes.

`engine_throughput.py` measures the whole engine; this isolates the decode forward that
dominates it, so a change to the runner can be judged in seconds rather than minutes: a batch
of `--batch` rows is prefilled to `--context` tokens, then `--steps` decode steps are timed by
process CPU time (contention on shared cores distorts it far less than wall time). The decode
FLOP rate (2 x parameters x rows per step) is printed against the fp32 GEMM rate of the same
process at [B, hidden] x [hidden, intermediate], as `engine_throughput.py` does. `--profile`
adds a torch.profiler table of the ops the steps spent their time in.

    .venv/bin/python benchmarks/decode_step.py --batch 32 --context 128 --profile
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.engine_throughput import bench_model, gemm_rate  # noqa: E402
from slimish.config import DECODE_ATTENTION_BACKENDS, EngineConfig  # noqa: E402
from slimish.engine.runner import KVBatch, Runner, load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128, help="tokens per row before the timed steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--model-size", default="small", choices=["small", "tiny"])
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "llama", "qwen3"])
    ap.add_argument("--model-cache", type=Path, default=Path("runs/bench-models"))
    ap.add_argument("--decode-attention-backend", default=EngineConfig.decode_attention_backend, choices=DECODE_ATTENTION_BACKENDS)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of the timed steps")
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = load_model(str(bench_model(args.model_size, args.arch, args.model_cache)), "float32", torch.device("cpu"))
    n_params = sum(p.numel() for p in model.parameters())
    runner, batch = Runner(model, 16, None, decode_attention_backend=args.decode_attention_backend), KVBatch(model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.context), generator=g).tolist()
    batch.add([runner.prefill(p, None, None).slab for p in prompts], [args.context] * args.batch)
    tokens = [p[-1] for p in prompts]
    for _ in range(4):  # warm-up: the slab's capacity, the allocator, lazy inits
        runner.decode(batch, tokens)
    with profile(activities=[ProfilerActivity.CPU]) if args.profile else nullcontext() as prof:
        start = time.process_time()
        for _ in range(args.steps):
            runner.decode(batch, tokens)
        step = (time.process_time() - start) / args.steps
    rate = 2 * n_params * args.batch / step / 1e9
    gemm = gemm_rate(args.batch, model.config.hidden_size, model.config.intermediate_size)
    print(f"{args.decode_attention_backend}: B={args.batch} context {args.context}: {step * 1e3:.1f} ms/step (CPU), decode {rate:.1f} GFLOP/s, "
          f"GEMM {gemm:.1f} GFLOP/s ({rate / gemm:.0%})")  # fmt: skip
    if args.profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
