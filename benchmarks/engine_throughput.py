"""Output tokens/s of the built-in engine against HF `generate`, one run, same model and prompts.

For each concurrency B (default 1, 8, 32), B requests of `--prompt-len` random token ids each
generate exactly `--new-tokens` tokens (`ignore_eos`), temperature 1.0 with a sampling seed:
  engine  - a real `slimish engine` process; the B requests are sent at once by an async client
  serial  - HF `model.generate`, one request at a time (one request per round: its tok/s does
            not depend on B, so a few requests measure it)
  static  - HF `model.generate` on one static batch of the B prompts (equal lengths: no padding)
Each config gets a warm-up, then `--repeats` rounds of engine, static and serial in turn, so
that drifting load from other jobs hits all three alike. Printed: median tok/s per path, the
ratios engine/serial and engine/static against the targets (>= 4x serial at 32 concurrent,
>= 0.8x static), the same per CPU-second (CPU time of the engine process, of this process for
HF), which contention distorts far less than wall time, and CPU/wall per path (well under 100%:
that path was starved of a core). Load averages at start and end say how busy the machine was.
Last, the physical limit: each path's decode FLOP rate (2 x parameters x tokens per CPU-second)
against this process's fp32 GEMM rate at the decode shape [B, hidden] x [hidden, intermediate]
(one thread), and the share of it each path reaches; then the same share counting the prompt
tokens' prefill FLOPs too (the time holds them: a third of the FLOPs at the default lengths).
Then the engine's decode step at the largest B beside its roofline bound, both measured here in
one process (`decode_step.py`: the step by the engine's own scheduler at the mean context of a
request, prompt + new tokens / 2, in steady state, a fresh engine's growth of its KV slab printed
apart; the bound as the projections of every layer cycling plus K and V streamed once, each
measured alone), with the ratio against its target (<= 1.25x).

    .venv/bin/python benchmarks/engine_throughput.py                  # small (~30M), the real run
    .venv/bin/python benchmarks/engine_throughput.py --model-size tiny --sizes 1,4 --new-tokens 16
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 2 threads are slower here (docs/benchmarks.md, CPU facts)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402

from slimish.client import Client  # noqa: E402
from slimish.engine.config import EngineConfig  # noqa: E402
from slimish.engine.runner import load_model  # noqa: E402
from slimish.launch.local import engine_process  # noqa: E402
from slimish.tiny_model import make_tiny_model  # noqa: E402

WARMUP_TOKENS = 8
TARGET_SERIAL, TARGET_STATIC = 4.0, 0.8  # engine / serial at the largest size, engine / static at every size
TARGET_ROOFLINE = 1.25  # the engine's decode step / its measured roofline bound, at the largest size


@dataclass
class Sample:
    tokens: int
    wall: float
    cpu: float

    @property
    def rate(self) -> float:
        return self.tokens / self.wall

    @property
    def cpu_rate(self) -> float:
        return self.tokens / self.cpu


@dataclass
class Row:
    """One concurrency level: the timed rounds of each path."""

    size: int
    engine: list[Sample]
    serial: list[Sample]
    static: list[Sample]


def median(samples: list[Sample], key: Callable[[Sample], float]) -> float:
    return statistics.median(key(s) for s in samples)


def model_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags that pick the benchmark model, alike in every engine benchmark."""
    ap.add_argument("--model-size", default="small", choices=["small", "tiny"])
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "llama", "qwen3"])
    ap.add_argument("--model-cache", type=Path, default=Path("runs/bench-models"))


def bench_model(size: str, arch: str, cache: Path) -> Path:
    """Build the model once into `cache` (a random-init model of `size`, seed 0)."""
    path = cache / f"{arch}-{size}-seed0"
    if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
        make_tiny_model(path, arch=arch, size=size, seed=0)
    return path


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the engine -------------------------------------------------------------------------------


async def _engine_round(url: str, prompts: list[list[int]], new_tokens: int, seed: int) -> int:
    async with Client(url) as c:
        outs = await asyncio.gather(
            *(
                c.generate(
                    input_ids=p,
                    sampling_params={
                        "temperature": 1.0,
                        "max_new_tokens": new_tokens,
                        "ignore_eos": True,
                        "sampling_seed": seed + i,
                    },
                )
                for i, p in enumerate(prompts)
            )
        )
    lengths = [len(o.output_ids) for o in outs]
    if lengths != [new_tokens] * len(prompts):
        raise RuntimeError(f"engine returned {lengths} tokens, expected {new_tokens} each")
    return sum(lengths)


def time_engine(url: str, pid: int, prompts: list[list[int]], new_tokens: int, seed: int) -> Sample:
    wall, cpu = time.perf_counter(), cpu_seconds(pid)
    tokens = asyncio.run(_engine_round(url, prompts, new_tokens, seed))
    return Sample(tokens, time.perf_counter() - wall, cpu_seconds(pid) - cpu)


# ---- HF generate ------------------------------------------------------------------------------


@torch.inference_mode()
def time_hf(model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, seed: int) -> Sample:
    """One `generate` call on a static batch (left padding is moot: all prompts have one length)."""
    ids = torch.tensor(prompts)
    torch.manual_seed(seed)
    wall, cpu = time.perf_counter(), time.process_time()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=model.config.pad_token_id,
    )
    sample = Sample(len(prompts) * new_tokens, time.perf_counter() - wall, time.process_time() - cpu)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens, expected {new_tokens}")
    return sample


# ---- the run ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per config (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(1)
    load_start = os.getloadavg()

    model_dir = bench_model(args.model_size, args.arch, args.model_cache)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    prompts = random_prompts(max(sizes), args.prompt_len, model.config.vocab_size, args.seed)
    print(
        f"model {model_dir} ({n_params / 1e6:.1f}M params, fp32), prompt {args.prompt_len}, "
        f"new tokens {args.new_tokens}, repeats {args.repeats}, threads {torch.get_num_threads()}"
    )
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)} ({os.cpu_count()} cores)")

    rows = []
    with engine_process(model_dir, max_running_requests=max(sizes)) as engine:
        pid = engine.proc.pid
        for b in sizes:
            batch = prompts[:b]
            time_engine(engine.url, pid, batch, WARMUP_TOKENS, args.seed)
            time_hf(model, batch, WARMUP_TOKENS, args.seed)
            row = Row(b, [], [], [])
            for r in range(args.repeats):
                row.engine.append(time_engine(engine.url, pid, batch, args.new_tokens, args.seed))
                row.static.append(time_hf(model, batch, args.new_tokens, args.seed))
                row.serial.append(time_hf(model, [prompts[r % len(prompts)]], args.new_tokens, args.seed + r))
            rows.append(row)
            print(
                f"  done B={b}: engine {median(row.engine, lambda s: s.rate):.1f} tok/s, "
                f"static {median(row.static, lambda s: s.rate):.1f} tok/s",
                flush=True,
            )

    report(rows)
    flop_report(
        rows,
        n_params,
        model.config.hidden_size,
        model.config.intermediate_size,
        (args.prompt_len + args.new_tokens) / args.new_tokens,
    )
    roofline_report(model_dir, max(sizes), args.prompt_len + args.new_tokens // 2)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def report(rows: list[Row]) -> None:
    head = ("", "tok/s:", "", "", "ratio:", "", "tok/CPU-s:", "", "", "CPU ratio:", "", "CPU/wall:", "", "")
    names = (
        "B",
        "engine",
        "serial",
        "static",
        "eng/serial",
        "eng/static",
        "engine",
        "serial",
        "static",
        "eng/serial",
        "eng/static",
        "engine",
        "serial",
        "static",
    )
    lines, verdicts = [head, names], []
    biggest = max(row.size for row in rows)
    for row in rows:
        paths = (row.engine, row.serial, row.static)
        wall = [median(p, lambda s: s.rate) for p in paths]
        cpu = [median(p, lambda s: s.cpu_rate) for p in paths]
        busy = [median(p, lambda s: s.cpu / s.wall) for p in paths]
        lines.append(
            (
                str(row.size),
                *(f"{x:.1f}" for x in wall),
                f"{wall[0] / wall[1]:.2f}x",
                f"{wall[0] / wall[2]:.2f}x",
                *(f"{x:.1f}" for x in cpu),
                f"{cpu[0] / cpu[1]:.2f}x",
                f"{cpu[0] / cpu[2]:.2f}x",
                *(f"{x:.0%}" for x in busy),
            )
        )
        checks = [("static", wall[0] / wall[2], cpu[0] / cpu[2], TARGET_STATIC)]
        if row.size == biggest:
            checks.insert(0, ("serial", wall[0] / wall[1], cpu[0] / cpu[1], TARGET_SERIAL))
        for name, by_wall, by_cpu, target in checks:
            verdicts.append(
                f"B={row.size} engine/{name}: {by_wall:.2f}x wall, {by_cpu:.2f}x CPU (target >= {target}x): "
                f"{'met' if by_wall >= target else 'MISSED'} by wall, {'met' if by_cpu >= target else 'MISSED'} by CPU"
            )
    widths = [max(len(line[i]) for line in lines) for i in range(len(names))]
    print()
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
    print()
    for v in verdicts:
        print(v)


def gemm_rate(rows: int, k: int, n: int, seconds: float = 1.0) -> float:
    """fp32 GFLOP/s of `[rows, k] @ [k, n]` on this thread: the most a decode step's linear
    layers at batch `rows` can get here."""
    x, w = torch.randn(rows, k), torch.randn(k, n)
    for _ in range(10):
        torch.mm(x, w)
    calls, start = 0, time.process_time()  # CPU time, as the paths' tok/CPU-s: contention cancels
    while (elapsed := time.process_time() - start) < seconds:
        torch.mm(x, w)
        calls += 1
    return 2 * rows * k * n * calls / elapsed / 1e9


def flop_report(rows: list[Row], n_params: int, hidden: int, ffn: int, all_tokens: float) -> None:
    """`all_tokens`: (prompt + new tokens) / new tokens. The rate counts output tokens, but the
    time also holds each prompt's prefill; the share counting those FLOPs too is printed after."""
    print()
    print(
        f"decode FLOP rate (2 x {n_params / 1e6:.1f}M params x tok/CPU-s) against fp32 GEMM [B, {hidden}] x [{hidden}, {ffn}]:"
    )
    for row in rows:
        gemm = gemm_rate(row.size, hidden, ffn)
        rates = {
            name: 2 * n_params * median(p, lambda s: s.cpu_rate) / 1e9
            for name, p in (("engine", row.engine), ("static", row.static))
        }
        print(
            f"  B={row.size}: GEMM {gemm:.1f} GFLOP/s; "
            + ", ".join(f"{k} {v:.1f} GFLOP/s ({v / gemm:.0%})" for k, v in rates.items())
            + f"; with prompt tokens: engine {rates['engine'] * all_tokens / gemm:.0%}, static {rates['static'] * all_tokens / gemm:.0%}"
        )


def roofline_report(model_dir: Path, batch: int, context: int, rounds: int = 4, steps: int = 8) -> None:
    """The engine's decode step at `batch` rows and `context` tokens beside its roofline bound."""
    from decode_step import DecodeBench, roofline  # benchmarks/, this script's directory

    model = load_model(str(model_dir), "float32", torch.device("cpu"))  # its own copy: the runner patches it
    bench = DecodeBench(model, batch, context, EngineConfig.decode_attention_backend, rounds * steps)
    line = roofline(bench, rounds, steps)
    ratio = line.step / line.bound
    print()
    print(f"decode step against its roofline (in-process, context {context} -> {bench.width}, CPU time):")
    print(f"  {line.summary(batch)}")
    print(f"  {bench.growth_summary()}")
    print(f"  target <= {TARGET_ROOFLINE}x: {'met' if ratio <= TARGET_ROOFLINE else 'MISSED'}")


if __name__ == "__main__":
    main()
