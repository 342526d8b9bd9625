"""Sync vs async training on a long-tail workload: wall time for the same steps, in one run.

Agentic rollouts have heavy-tailed lengths: a sync step waits for its longest sample while the
engine runs nearly empty and the trainer idles. Here every sample's length is drawn from a
Pareto distribution (seeded by group and index, so both runs see the same lengths for the same
prompts; `ignore_eos` makes the engine produce exactly that many tokens), and the reward is a
token statistic with some spread, so every group trains. The same config then runs twice as
`python -m slimish.train`: `async_training=false`, and `async_training=true` with
`buffer.max_staleness`.

Printed: wall seconds for the RL steps of each (from the first step's start to the last's end,
after `--warmup` steps), sync / async (target >= 1.5x; floor 1.0x: async never slower), the
trainer's idle fraction in async (the share of its step spent waiting for a batch; target <=
20%), the engine idle fraction and the staleness of what async trained on, and how many groups async dropped as too stale (with
`buffer.mask_stale_tokens`, set here, only tokens past the bound are masked; `--set
buffer.mask_stale_tokens=false` drops such groups whole, which biases toward short samples).

Placement (`--placement`):
- `default`: nothing passed, `launch.cpu_placement`'s rule acts (slimish/launch/cpus.py): sync's
  trainer takes every core while the engine idles; async splits the usable CPUs, the trainer (and
  the router) on the first half, the engine on the rest, each with that many threads. This is
  what a user gets.
- `split`: by hand, the same for both modes: a fresh engine pinned to one core, the trainer (and
  the router) to another with `trainer.cpu_threads=1`, as async RL runs on a cluster, rollout and
  training on disjoint devices. Sync leaves each side idle while the other works; that is the
  waste async removes.
- `shared`: `launch.cpu_placement=shared`, both modes: nobody pinned. Sync's trainer takes both
  cores while the engine idles (`trainer.cpu_threads`), async's keeps its default threads beside
  the busy engine.

    .venv/bin/python benchmarks/async_vs_sync.py                      # tiny llama, 24 + 2 steps (~4-8 min)
    .venv/bin/python benchmarks/async_vs_sync.py --steps 4 --warmup 1 # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import ExitStack, contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

from slimish.launch.local import engine_process  # noqa: E402
from slimish.metrics import read_metrics  # noqa: E402
from slimish.tiny_model import make_tiny_model  # noqa: E402
from slimish.types import Sample  # noqa: E402

TARGET_SPEEDUP, TARGET_IDLE = 1.5, 0.20
FLOOR_SPEEDUP = 1.0  # async is never slower than sync on the same cores (issue 39)
HERE = Path(__file__).resolve()
MIN_LEN, ALPHA, MAX_LEN = 8, 1.2, 384  # Pareto lengths: median ~14 tokens, 1 in 20 above 100


async def long_tail(ctx, sample: Sample) -> Sample:
    """One turn of a Pareto-distributed length; reward: the share of even token ids."""
    rng = random.Random(sample.group_id * 1000 + sample.index)
    length = min(MAX_LEN, int(MIN_LEN * rng.paretovariate(ALPHA)))
    await ctx.generate_sample({"max_new_tokens": length, "ignore_eos": True})
    ids = sample.response_ids
    sample.reward = sum(t % 2 == 0 for t in ids) / max(len(ids), 1)
    return sample


@contextmanager
def on_cpus(cpus: set[int]) -> Iterator[None]:
    """Children started inside run on `cpus` only (Linux CPU affinity is inherited)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run(mode: str, args: argparse.Namespace, model: Path, out: Path) -> list[dict]:
    run_dir = out / mode
    overrides = [
        f"model={model}",
        f"run_dir={run_dir}",
        f"steps={args.steps + args.warmup}",
        f"async_training={'true' if mode == 'async' else 'false'}",
        f"buffer.max_staleness={args.staleness if mode == 'async' else 0}",
        "data.source=task:count",
        f"rollout.rollout_fn={HERE}:long_tail",
        "rollout.filter_fn=null",
        f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.rollout_batch_size={args.batch}",
        f"rollout.max_new_tokens={MAX_LEN}",
        f"trainer.updates_per_step={args.updates}",
        "trainer.lr=1e-4",
        # PPO as slime / verl run it by default: old logprobs recomputed, KL to a reference model
        # (three forward passes a step), so training is not negligible next to generation.
        "algorithm.recompute_old_logprobs=true",
        "algorithm.kl_coef=0.05",
        # The long tail outlives the bound: mask its too-old tokens rather than drop it whole
        # (dropping measured 13 of ~110 groups lost, all long ones). No effect on sync.
        "buffer.mask_stale_tokens=true",
        "eval.every=0",
        "checkpoint.every=0",
        *args.set,
    ]
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
    run_dir.mkdir(parents=True)
    cpus = os.sched_getaffinity(0)
    if args.placement == "shared":
        overrides.insert(0, "launch.cpu_placement=shared")  # first, so that a `--set` of the same key still wins
    with ExitStack() as stack, open(run_dir.with_suffix(".log"), "w") as log:
        if args.placement == "split":  # a fresh engine per mode, on its own core
            engine_cpu, trainer_cpu = sorted(cpus)[:2]
            with on_cpus({engine_cpu}):
                engine = stack.enter_context(engine_process(model, log_path=run_dir / "engine.log"))
            # first, so that a `--set` of the same key still wins
            overrides[:0] = [
                "launch.engine_kind=external",
                f"launch.engine_urls=[{engine.url}]",
                "trainer.cpu_threads=1",
            ]
            cpus = {trainer_cpu}
        with on_cpus(cpus):
            done = subprocess.run(
                [sys.executable, "-m", "slimish.train", *overrides],
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
            )
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed ({done.returncode}); see {run_dir.with_suffix('.log')}")
    return [r for r in read_metrics(run_dir) if r["step"] > args.warmup]


def wall(rows: list[dict]) -> float:
    """From the first measured step's start to the last one's end (metrics are logged at step end)."""
    return rows[-1]["time"] - rows[0]["time"] + rows[0]["time/step"]


def mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / len(rows)


def idle(rows: list[dict], key: str) -> float:
    """A per-step idle fraction over the whole measurement: weighted by each step's length."""
    return sum(r[key] * r["time/step"] for r in rows) / sum(r["time/step"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="measured RL steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the measurement starts")
    parser.add_argument("--staleness", type=int, default=2, help="async buffer.max_staleness")
    parser.add_argument("--batch", type=int, default=8, help="groups per step")
    parser.add_argument("--n", type=int, default=4, help="samples per group")
    parser.add_argument("--updates", type=int, default=4, help="trainer.updates_per_step")
    parser.add_argument(
        "--placement",
        choices=("default", "split", "shared"),
        default="default",
        help="default: launch.cpu_placement's rule; split: engine and trainer on a core each, by hand, both modes; "
        "shared: nobody pinned, both modes",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench-async"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value overrides for both runs")
    args = parser.parse_args()
    if args.placement == "split" and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit(
            "--placement split needs 2 CPUs (one for the engine, one for the trainer); use --placement shared"
        )
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model = args.out / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, arch="llama", size="tiny", seed=0)
    results = {mode: run(mode, args, model, args.out) for mode in ("sync", "async")}
    print(
        f"\n{args.steps} steps after {args.warmup} warm-up, {args.batch} x {args.n} samples, "
        f"Pareto lengths (min {MIN_LEN}, alpha {ALPHA}, cap {MAX_LEN}), async max_staleness {args.staleness}, "
        f"placement {args.placement}\n"
    )
    print("| mode | wall s | s/step | rollout wait s/step | train s/step | trainer idle | engine idle | response len |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, rows in results.items():
        print(
            f"| {mode} | {wall(rows):.1f} | {wall(rows) / len(rows):.2f} | {mean(rows, 'time/rollout'):.2f} | "
            f"{mean(rows, 'time/train'):.2f} | {idle(rows, 'time/trainer_idle_fraction'):.1%} | "
            f"{idle(rows, 'rollout/engine_idle_fraction'):.1%} | {mean(rows, 'response/length'):.1f} |"
        )
    stale = {
        k.rsplit("/", 1)[1]: sum(r.get(k, 0.0) for r in results["async"])
        for k in sorted({k for r in results["async"] for k in r if k.startswith("rollout/staleness/")})
    }
    speedup = wall(results["sync"]) / wall(results["async"])
    trainer_idle = idle(results["async"], "time/trainer_idle_fraction")
    print(
        f"\nasync trained groups by staleness: {stale}; dropped as too stale: "
        f"{int(results['async'][-1]['rollout/dropped_stale_groups'])} groups"
    )
    print(
        f"sync / async wall: {speedup:.2f}x (target >= {TARGET_SPEEDUP}x; "
        f"floor {FLOOR_SPEEDUP}x {'met' if speedup >= FLOOR_SPEEDUP else 'MISSED'}); "
        f"async trainer idle {trainer_idle:.1%} (target <= {TARGET_IDLE:.0%})"
    )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
