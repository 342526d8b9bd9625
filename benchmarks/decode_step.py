"""CPU time of one engine decode step, in-process (no HTTP), beside its roofline, and where it goes.

`engine_throughput.py` measures the whole engine; this isolates the decode step that dominates
it, so a change to the runner can be judged in seconds rather than minutes: `--batch` requests of
`--context` random tokens are admitted by the engine's own scheduler (not started: no thread),
then `--steps` calls of its decode step (forward, sampling at temperature 1, the per-token
bookkeeping) are timed by process CPU time, which contention on shared cores distorts far less
than wall time. They are timed in an engine's steady state: the running batch's slab already has
the capacity the timed steps reach, as an earlier batch as long leaves it (a fresh engine's growth
of the slab, a one-time cost per width reached, is printed apart). Beside it, the roofline bound,
measured alone in the same process and interleaved with the steps (`--rounds`), so that drifting
load hits both alike:
  projections - every linear layer of the model in turn (LM head included) at [B, in] rows, as a
                step runs them: the weights cycle out of cache; the faster of `F.linear` (MKL)
                and the packed oneDNN kernel the engine uses (slimish/engine/packed.py);
  KV          - each layer's K and V streamed once at the steps' mean context by two batched
                matmuls over contiguous buffers: the scores q K^T over [B x kv_heads, context,
                head_dim], then the faster of P V over V in that layout and V^T P^T over V
                stored transposed (the engine's, slimish/engine/attention.py).
The step over their sum is the ratio the engine is judged by (benchmarks/README.md). The decode
FLOP rate (2 x parameters x rows per step) is printed against the fp32 GEMM rate of the same
process at [B, hidden] x [hidden, intermediate]. `--profile` adds the split of the profiled time
(torch.profiler) into linear layers, attention, sampling, other ops, and time outside any op
(Python), then the top ops.

    .venv/bin/python benchmarks/decode_step.py --batch 32 --context 128 --profile
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from engine_throughput import bench_model, gemm_rate, model_arguments  # noqa: E402  (same directory)
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402

from slimish.engine import packed as packed_kernel  # noqa: E402
from slimish.engine import sampling  # noqa: E402
from slimish.engine.config import DECODE_ATTENTION_BACKENDS, EngineConfig  # noqa: E402
from slimish.engine.runner import Runner, load_model  # noqa: E402
from slimish.engine.scheduler import LogprobWish, Scheduler, Sequence  # noqa: E402
from slimish.protocol import SamplingParams  # noqa: E402

# aten ops by where the time goes; anything else is "other ops" (norms, rotary, element-wise, copies)
GROUPS = {
    "linear": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"),
    "attention": (
        "aten::bmm",
        "aten::baddbmm",  # the scores, with the mask added (slimish/engine/attention.py)
        "aten::_softmax",
        "aten::masked_fill_",
        "aten::logical_not",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ),
}
SAMPLING = "sampling"  # a profiler range around `sample`: its ops are counted there
WARMUP_STEPS = 4  # the slab's capacity, the allocator, packed weights, lazy inits


def cpu_time(fn: Callable[[], object], calls: int) -> float:
    """Process CPU seconds per call of `fn`."""
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls


class DecodeBench:
    """The engine's scheduler (its thread not started) holding `batch` requests prefilled to
    `context` tokens and warmed up, which `step` moves on by one decode step.

    After the warm-up the running batch's slab grows to room for the `steps` more that the caller
    will take, as an engine that has served a batch that long leaves it ("a later batch reuses the capacity"): the steps are then
    timed in that steady state, not with a fresh engine's growths, a one-time cost per width
    reached (a copy of the slab into freshly faulted pages) that the bound's preallocated buffers
    do not pay either. `growth` holds that growth's CPU seconds."""

    def __init__(self, model: PreTrainedModel, batch: int, context: int, backend: str, steps: int) -> None:
        self.runner = Runner(model, EngineConfig.page_size, None, decode_attention_backend=backend)
        self.scheduler = Scheduler(self.runner, batch, batch * context, share_prefills=False)
        g = torch.Generator().manual_seed(0)
        for i, prompt in enumerate(torch.randint(0, model.config.vocab_size, (batch, context), generator=g).tolist()):
            params = SamplingParams(temperature=1.0, max_new_tokens=1 << 20, sampling_seed=i)
            self.scheduler.waiting.append(
                Sequence(f"r{i}", prompt, params, set(), LogprobWish(), lambda *_: None, lambda *_: "")
            )
        self.scheduler._admit()
        if len(self.scheduler.running) != batch:
            raise RuntimeError(f"admitted {len(self.scheduler.running)} of {batch} requests")
        for _ in range(WARMUP_STEPS):
            self.step()
        start = time.process_time()
        self.scheduler.batch.slab.reserve(batch, self.width + steps)  # a fresh engine's growth: fresh pages
        self.growth = time.process_time() - start

    @property
    def width(self) -> int:
        return self.scheduler.batch.width

    def growth_summary(self) -> str:
        capacity = self.scheduler.batch.slab.capacity[1]
        return (
            f"a fresh engine's growth of the slab to {capacity} columns: {self.growth * 1e3:.1f} ms, once per "
            f"~{capacity // 8} steps at this width (runner.DECODE_GROWTH): {self.growth / (capacity / 8) * 1e3:.1f} "
            f"ms a step while a fresh batch grows; not in the step above (the capacity an earlier batch left)"
        )

    def step(self) -> None:
        self.scheduler._decode()


def projection_seconds(model: PreTrainedModel, rows: int, kernel: str, calls: int = 3) -> float:
    """CPU seconds of every linear layer of `model` in turn at `rows` rows (the weights cycle out
    of cache, as in a step): `kernel` "mkl" is `F.linear`, "packed" the engine's oneDNN one."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
    packed = {m: packed_kernel.pack(m.weight) for m in linears} if kernel == "packed" else {}

    def once() -> None:
        for m in linears:
            x = inputs[m.in_features]
            if packed:
                packed_kernel.linear(x, packed[m], m.bias)
            else:
                torch.nn.functional.linear(x, m.weight, m.bias)

    with torch.inference_mode():
        once()
        return cpu_time(once, calls)


def kv_seconds(model: PreTrainedModel, rows: int, context: int, calls: int = 3) -> float:
    """CPU seconds to stream every layer's K and V once at `context`: the two batched matmuls of a
    one-token query over contiguous buffers (no mask, no softmax), V in whichever of its two
    layouts streams faster."""
    cfg = model.config
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d, n = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, rows * kv
    keys = [torch.randn(n, context, d) for _ in range(cfg.num_hidden_layers)]
    values = [torch.randn(n, context, d) for _ in range(cfg.num_hidden_layers)]  # [n, context, d]: P V
    transposed = [torch.randn(n, d, context) for _ in range(cfg.num_hidden_layers)]  # V^T: V^T P^T
    query = torch.randn(n, heads // kv, d)

    def plain() -> None:
        for k, v in zip(keys, values):
            torch.bmm(torch.bmm(query, k.transpose(1, 2)), v)

    def stored_transposed() -> None:
        for k, v in zip(keys, transposed):
            torch.bmm(v, torch.bmm(query, k.transpose(1, 2)).transpose(1, 2))

    plain()  # warm-up
    stored_transposed()
    return min(cpu_time(plain, calls), cpu_time(stored_transposed, calls))


@dataclass
class Roofline:
    """Medians over the interleaved rounds, in CPU seconds per step."""

    step: float
    mkl: float  # projections by F.linear
    packed: float  # projections by the packed kernel
    kv: float
    ratios: list[float]  # step / bound of each round

    @property
    def projections(self) -> float:
        return min(self.mkl, self.packed) if self.packed else self.mkl

    @property
    def bound(self) -> float:
        return self.projections + self.kv

    def summary(self, rows: int) -> str:
        return (
            f"B={rows}: decode step {self.step * 1e3:.1f} ms; bound {self.bound * 1e3:.1f} ms = projections "
            f"{self.projections * 1e3:.1f} (MKL {self.mkl * 1e3:.1f}, packed {self.packed * 1e3:.1f}) + KV "
            f"{self.kv * 1e3:.1f}; step / bound {self.step / self.bound:.2f}x "
            f"(rounds {min(self.ratios):.2f}-{max(self.ratios):.2f}x)"
        )


def roofline(bench: DecodeBench, rounds: int, steps: int) -> Roofline:
    """`rounds` x (`steps` decode steps, then the bound's parts at their mean context)."""
    model, rows = bench.runner.model, len(bench.scheduler.running)
    has_packed = packed_kernel.available(model)
    parts: dict[str, list[float]] = {"step": [], "mkl": [], "packed": [], "kv": []}
    for _ in range(rounds):
        mean_context = bench.width + (steps + 1) / 2
        parts["step"].append(cpu_time(bench.step, steps))
        parts["mkl"].append(projection_seconds(model, rows, "mkl"))
        parts["packed"].append(projection_seconds(model, rows, "packed") if has_packed else 0.0)
        parts["kv"].append(kv_seconds(model, rows, round(mean_context)))
    ratios = [
        s / ((min(m, p) if p else m) + kv)
        for s, m, p, kv in zip(parts["step"], parts["mkl"], parts["packed"], parts["kv"])
    ]
    return Roofline(*(statistics.median(parts[k]) for k in ("step", "mkl", "packed", "kv")), ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128, help="tokens per row before the timed steps")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps in all")
    ap.add_argument(
        "--rounds", type=int, default=4, help="the steps are timed in this many rounds, each beside the bound"
    )
    model_arguments(ap)
    ap.add_argument(
        "--decode-attention-backend", default=EngineConfig.decode_attention_backend, choices=DECODE_ATTENTION_BACKENDS
    )
    ap.add_argument(
        "--profile", action="store_true", help="then print where the timed steps spent their time (torch.profiler)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = load_model(str(bench_model(args.model_size, args.arch, args.model_cache)), "float32", torch.device("cpu"))
    n_params = sum(p.numel() for p in model.parameters())
    timed = args.steps * (2 if args.profile else 1)  # the rounds', then the profile's
    bench = DecodeBench(model, args.batch, args.context, args.decode_attention_backend, timed)
    line = roofline(bench, args.rounds, args.steps // args.rounds)
    rate = 2 * n_params * args.batch / line.step / 1e9
    gemm = gemm_rate(args.batch, model.config.hidden_size, model.config.intermediate_size)
    print(f"{args.decode_attention_backend}, context {args.context} -> {bench.width}: {line.summary(args.batch)}")
    print(bench.growth_summary())
    print(f"decode {rate:.1f} GFLOP/s, GEMM {gemm:.1f} GFLOP/s ({rate / gemm:.0%})")
    if args.profile:
        profile_steps(bench, args.steps)


def profile_steps(bench: DecodeBench, steps: int) -> None:
    """The split of `steps` more steps' time under torch.profiler, then its top ops."""
    import slimish.engine.scheduler as scheduler_module

    def sample(*args, **kwargs):
        with record_function(SAMPLING):
            return sampling.sample(*args, **kwargs)

    scheduler_module.sample = sample  # the scheduler's name for it: its ops are counted as sampling
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = time.perf_counter()
        for _ in range(steps):
            bench.step()
        wall = time.perf_counter() - wall
    scheduler_module.sample = sampling.sample
    ops = prof.key_averages()
    by_group = {name: sum(e.self_cpu_time_total for e in ops if e.key in keys) / 1e6 for name, keys in GROUPS.items()}
    by_group[SAMPLING] = sum(e.cpu_time_total for e in ops if e.key == SAMPLING) / 1e6
    in_ops = sum(e.self_cpu_time_total for e in ops) / 1e6
    by_group["other ops"] = in_ops - sum(by_group.values())
    by_group["outside ops (Python)"] = max(wall - in_ops, 0.0)
    print("split of the profiled time: " + ", ".join(f"{k} {v / wall:.0%}" for k, v in by_group.items()))
    print(ops.table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
