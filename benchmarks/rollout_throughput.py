"""Rollout manager throughput: samples/s through the manager against the same requests sent
straight to the engines, in the same run.

The manager path is the real one: `RolloutManager.run_step` with a one-turn rollout function
(`ctx.generate_sample`), groups of `--n`, at most `--concurrency` samples in flight, every request
through the router. The direct path replays the prompt ids of the groups the manager just made,
`--n` requests each, as concurrent `/generate` calls at the same concurrency, spread round-robin
over the engines. Every request makes exactly `--new-tokens` tokens (`ignore_eos`), so both paths
do the same engine work; the ratio is what the manager, the router and the bookkeeping cost. A
third path sends the same requests through the router without the manager, which splits that
cost between the router hop and the manager. Rounds alternate after a warm-up; medians are printed. Target: manager/direct >= 0.9x.

    .venv/bin/python benchmarks/rollout_throughput.py [--engines 2 --prompts 16 --n 4 --concurrency 32]

All processes share this machine's cores: the router and this process compete with the engines
for CPU on the manager path, which the direct path does not pay for, so on a 2-core box the
ratio is a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_throughput import bench_model  # noqa: E402  (same directory)

from slimish.buffer import Buffer  # noqa: E402
from slimish.client import Client  # noqa: E402
from slimish.config import RunConfig, load_run_config  # noqa: E402
from slimish.launch.local import Servers, local_servers  # noqa: E402
from slimish.rollout.api import RolloutContext, RolloutRuntime  # noqa: E402
from slimish.rollout.data import PromptData  # noqa: E402
from slimish.rollout.functions import RolloutFunctions  # noqa: E402
from slimish.rollout.manager import RolloutManager  # noqa: E402
from slimish.types import Sample  # noqa: E402

FIXED_LENGTH = {"ignore_eos": True}


async def rollout(ctx: RolloutContext, sample: Sample) -> Sample:
    await ctx.generate_sample(FIXED_LENGTH)
    sample.reward = 0.0
    return sample


async def direct_round(clients: list[Client], prompts: list[list[int]], params: dict, concurrency: int) -> int:
    """Every prompt once per request, at most `concurrency` at a time, round-robin over engines."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, ids: list[int]) -> int:
        async with gate:
            out = await clients[i % len(clients)].generate(input_ids=ids, sampling_params=params, return_logprob=True)
            return len(out.output_ids)

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def run(cfg: RunConfig, servers: Servers, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """samples/s per round of: the manager, the same requests straight to the engines, and the
    same requests through the router without the manager (what the router hop alone costs)."""
    runtime = await RolloutRuntime.create(cfg, servers.router_url)
    manager = RolloutManager(runtime, PromptData(cfg.data), Buffer(), RolloutFunctions(rollout))
    engines, router = [Client(url) for url in servers.engine_urls], [Client(servers.router_url)]
    params = {**runtime.sampling_params, **FIXED_LENGTH}
    rates: dict[str, list[float]] = {"manager": [], "direct": [], "router": []}
    cpu_ms: dict[str, list[float]] = {path: [] for path in rates}  # this process, per sample
    try:
        for r in range(repeats + 1):  # round 0 warms every path up
            wall, cpu = time.perf_counter(), time.process_time()
            await manager.run_step(0)
            seconds, cpu_s = {"manager": time.perf_counter() - wall}, {"manager": time.process_time() - cpu}
            groups = manager.buffer.get_batch(len(manager.buffer))
            prompts = [s.tokens[: s.prompt_length] for g in groups for s in g]
            assert all(s.response_length == cfg.rollout.max_new_tokens for g in groups for s in g)
            rounds = {
                "direct": lambda: direct_round(engines, prompts, params, cfg.rollout.max_concurrency),
                "router": lambda: direct_round(router, prompts, params, cfg.rollout.max_concurrency),
            }
            for path, send in rounds.items():
                wall, cpu = time.perf_counter(), time.process_time()
                tokens = await send()
                seconds[path], cpu_s[path] = time.perf_counter() - wall, time.process_time() - cpu
                assert tokens == len(prompts) * cfg.rollout.max_new_tokens
            if r:
                for path in rates:
                    rates[path].append(len(prompts) / seconds[path])
                    cpu_ms[path].append(1000 * cpu_s[path] / len(prompts))
                print(
                    f"round {r}: " + ", ".join(f"{p} {v[-1]:.1f}" for p, v in rates.items()) + " samples/s, "
                    f"manager/direct {rates['manager'][-1] / rates['direct'][-1]:.2f}x"
                )
    finally:
        for c in engines + router:
            await c.close()
        await runtime.close()
    return rates, cpu_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16, help="groups per round")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--model-cache", type=Path, default=Path("runs/bench-models"))
    args = ap.parse_args()

    model = bench_model(args.model_size, "llama", args.model_cache)
    cfg = load_run_config(
        None,
        [
            f"model={model}",
            "data.source=task:add",
            f"data.task_size={args.prompts * (args.repeats + 1)}",
            f"launch.engines={args.engines}",
            "rollout.filter_fn=null",
            f"rollout.n_samples_per_prompt={args.n}",
            f"rollout.rollout_batch_size={args.prompts}",
            f"rollout.max_concurrency={args.concurrency}",
            f"rollout.max_new_tokens={args.new_tokens}",
        ],
    )
    print(
        f"{args.model_size} llama, {args.engines} engines, {args.prompts} prompts x {args.n} samples, concurrency {args.concurrency}, "
        f"{args.new_tokens} new tokens each; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    with tempfile.TemporaryDirectory() as logs, local_servers(cfg.launch, model, logs) as servers:
        rates, cpu_ms = asyncio.run(run(cfg, servers, args.repeats))
    m, d, r = (statistics.median(rates[p]) for p in ("manager", "direct", "router"))
    print(f"median samples/s: manager {m:.1f}, direct {d:.1f}, router without manager {r:.1f}")
    print(f"manager/direct {m / d:.2f}x (target >= 0.90x); router/direct {r / d:.2f}x; manager/router {m / r:.2f}x")
    print(
        "this process's CPU per sample: " + ", ".join(f"{p} {statistics.median(v):.2f} ms" for p, v in cpu_ms.items())
    )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
