"""Steps per minute of a sync run whose fleet grows from 1 engine to 3 mid-run, against the same
run on 1 engine throughout, both in one invocation (docs/elastic.md).

Both runs start `python -m slimish.train` on one engine of its own. In the elastic run this script
also starts 2 engines beforehand, and the rollout function registers them with the run's router
(`POST /workers`) as step `--join` begins. They join the weight-update group at that step's push
and take load from the next step on. Measured over the steps after that push (`--join` + 1 on):
steps per minute of each run, and elastic / baseline. A rollout-heavy workload (fixed-length
samples via `ignore_eos`), so engines are what a step waits for.

On CPU every engine shares the machine's cores with the others and the trainer: on 2 cores, 3
engines cannot generate faster than 1, and the ratio is about 1 (printed as measured). The gain
needs an accelerator per engine.

    .venv/bin/python benchmarks/elastic_fleet.py                 # 2 + 8 steps, 8 x 4 samples of 128 tokens (~2-4 min)
    .venv/bin/python benchmarks/elastic_fleet.py --steps 3 --join 1 --batch 4   # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from slimish.launch.local import engine_process  # noqa: E402
from slimish.metrics import read_metrics  # noqa: E402
from slimish.tiny_model import make_tiny_model  # noqa: E402
from slimish.types import Sample  # noqa: E402

HERE = Path(__file__).resolve()


async def fixed_length(ctx, sample: Sample) -> Sample:
    """`rollout.args.tokens` tokens exactly; registers `ELASTIC_JOIN` engines with the router as
    the first sample of step `rollout.args.join` starts (once: the router refuses a second add)."""
    join, urls = ctx.args["join"], [u for u in os.environ.get("ELASTIC_JOIN", "").split(",") if u]
    if urls and sample.group_id == (join - 1) * ctx.config.rollout.rollout_batch_size and sample.index == 0:
        for url in urls:
            httpx.post(ctx.client.base_url + "/workers", json={"url": url}).raise_for_status()
    await ctx.generate_sample({"max_new_tokens": ctx.args["tokens"], "ignore_eos": True})
    sample.reward = float(sum(t % 2 == 0 for t in sample.response_ids) / max(len(sample.response_ids), 1))
    return sample


def run(name: str, joiners: int, args: argparse.Namespace, model: Path) -> list[dict]:
    """One run; its metrics rows from the step after the join's push on."""
    run_dir = args.out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    with ExitStack() as stack, open(run_dir.with_suffix(".log"), "w") as log:
        extra = [
            stack.enter_context(engine_process(model, log_path=run_dir / f"joiner{i}.log")) for i in range(joiners)
        ]
        env = {**os.environ, "ELASTIC_JOIN": ",".join(e.url for e in extra), "PYTHONPATH": str(HERE.parent.parent)}
        overrides = [
            f"model={model}",
            f"run_dir={run_dir}",
            f"steps={args.join + args.steps}",
            "data.source=task:count",
            f"rollout.rollout_fn={HERE}:fixed_length",
            "rollout.filter_fn=null",
            f"rollout.n_samples_per_prompt={args.n}",
            f"rollout.rollout_batch_size={args.batch}",
            f"rollout.max_new_tokens={args.tokens}",
            f"rollout.args.join={args.join}",
            f"rollout.args.tokens={args.tokens}",
            "trainer.lr=1e-4",
            "eval.every=0",
            "checkpoint.every=0",
            *args.set,
        ]
        done = subprocess.run(
            [sys.executable, "-m", "slimish.train", *overrides],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=args.timeout,
        )
    if done.returncode != 0:
        raise SystemExit(f"{name} run failed ({done.returncode}); see {run_dir.with_suffix('.log')}")
    rows = read_metrics(run_dir)
    engines = {r["step"]: r["launch/engines"] for r in rows}
    assert engines[args.join] == 1 + joiners, f"{name}: {engines[args.join]} engines after step {args.join}'s push"
    return [r for r in rows if r["step"] > args.join]


def steps_per_minute(rows: list[dict]) -> float:
    """From the first measured step's start to the last one's end (metrics are logged at step end)."""
    return 60 * len(rows) / (rows[-1]["time"] - rows[0]["time"] + rows[0]["time/step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps, after the join")
    parser.add_argument("--join", type=int, default=2, help="the step whose rollout registers the 2 engines")
    parser.add_argument("--batch", type=int, default=8, help="groups per step")
    parser.add_argument("--n", type=int, default=4, help="samples per group")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sample")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-elastic"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value overrides for both runs")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    model = args.out / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, arch="llama", size="tiny", seed=0)
    results = {"1 engine": run("one", 0, args, model), "1 + 2 joined": run("elastic", 2, args, model)}
    print(
        f"\n{args.steps} steps after the join at step {args.join}, "
        f"{args.batch} x {args.n} samples of {args.tokens} tokens\n"
    )
    print("| fleet | steps/min | rollout s/step | train s/step | push s/step |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("time/rollout", "time/train", "time/weight_push")}
        print(
            f"| {name} | {steps_per_minute(rows):.2f} | {mean['time/rollout']:.2f} | {mean['time/train']:.2f} | "
            f"{mean['time/weight_push']:.3f} |"
        )
    ratio = steps_per_minute(results["1 + 2 joined"]) / steps_per_minute(results["1 engine"])
    print(f"\n3 engines / 1 engine: {ratio:.2f}x steps per minute")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
