"""CPU time of one engine decode step, in-process (no HTTP, no scheduler), and where it goes.

`engine_throughput.py` measures the whole engine; this isolates the decode step that dominates
it (forward + sampling at temperature 1), so a change to the runner can be judged in seconds
rather than minutes: a batch of `--batch` rows is prefilled to `--context` tokens, then
`--steps` steps are timed by process CPU time (contention on shared cores distorts it far less
than wall time). The decode FLOP rate (2 x parameters x rows per step) is printed against the
fp32 GEMM rate of the same process at [B, hidden] x [hidden, intermediate], as
`engine_throughput.py` does. `--profile` adds the split of the profiled time (torch.profiler)
into linear layers, attention, sampling, other ops, and time outside any op (Python), then the
top ops.

    .venv/bin/python benchmarks/decode_step.py --batch 32 --context 128 --profile
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from engine_throughput import bench_model, gemm_rate, model_arguments  # noqa: E402  (same directory)
from slimish.engine.config import DECODE_ATTENTION_BACKENDS, EngineConfig  # noqa: E402
from slimish.engine.runner import KVBatch, Runner, load_model  # noqa: E402
from slimish.engine.sampling import RowState, sample  # noqa: E402
from slimish.protocol import SamplingParams  # noqa: E402

# aten ops by where the time goes; anything else is "other ops" (norms, rotary, element-wise, copies)
GROUPS = {
    "linear": ("aten::mm", "aten::addmm"),
    "attention": (
        "aten::bmm",
        "aten::_softmax",
        "aten::masked_fill_",
        "aten::logical_not",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ),
}
SAMPLING = "sampling"  # a profiler range around `sample`: its ops are counted there


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128, help="tokens per row before the timed steps")
    ap.add_argument("--steps", type=int, default=32)
    model_arguments(ap)
    ap.add_argument(
        "--decode-attention-backend", default=EngineConfig.decode_attention_backend, choices=DECODE_ATTENTION_BACKENDS
    )
    ap.add_argument(
        "--profile", action="store_true", help="print where the timed steps spent their time (torch.profiler)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = load_model(str(bench_model(args.model_size, args.arch, args.model_cache)), "float32", torch.device("cpu"))
    n_params = sum(p.numel() for p in model.parameters())
    runner, batch = Runner(model, 16, None, decode_attention_backend=args.decode_attention_backend), KVBatch(model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.context), generator=g).tolist()
    batch.add([runner.prefill(p, None, None).slab for p in prompts], [args.context] * args.batch)
    rows = [
        RowState(SamplingParams(temperature=1.0), p, [], set(), torch.Generator().manual_seed(i))
        for i, p in enumerate(prompts)
    ]
    tokens = [p[-1] for p in prompts]

    def step() -> None:
        logits = runner.decode(batch, tokens)
        with record_function(SAMPLING):
            tokens[:] = sample(logits, rows)[0]

    for _ in range(4):  # warm-up: the slab's capacity, the allocator, lazy inits
        step()
    with profile(activities=[ProfilerActivity.CPU]) if args.profile else nullcontext() as prof:
        start, wall = time.process_time(), time.perf_counter()
        for _ in range(args.steps):
            step()
        step_cpu, wall = (time.process_time() - start) / args.steps, time.perf_counter() - wall
    rate = 2 * n_params * args.batch / step_cpu / 1e9
    gemm = gemm_rate(args.batch, model.config.hidden_size, model.config.intermediate_size)
    print(
        f"{args.decode_attention_backend}: B={args.batch} context {args.context}: {step_cpu * 1e3:.1f} ms/step (CPU), decode {rate:.1f} GFLOP/s, "
        f"GEMM {gemm:.1f} GFLOP/s ({rate / gemm:.0%})"
    )
    if args.profile:
        ops = prof.key_averages()
        by_group = {
            name: sum(e.self_cpu_time_total for e in ops if e.key in keys) / 1e6 for name, keys in GROUPS.items()
        }
        by_group[SAMPLING] = sum(e.cpu_time_total for e in ops if e.key == SAMPLING) / 1e6
        in_ops = sum(e.self_cpu_time_total for e in ops) / 1e6
        by_group["other ops"] = in_ops - sum(by_group.values())
        by_group["outside ops (Python)"] = max(wall - in_ops, 0.0)
        print("split of the profiled time: " + ", ".join(f"{k} {v / wall:.0%}" for k, v in by_group.items()))
        print(ops.table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
