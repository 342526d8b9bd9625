"""Seconds per RL step of TRL's GRPOTrainer and slimish (sync, sync colocated, async), at equal
threads, on two workloads, in one run.

Every side gets the same model (one SFT warm start, so rewards are not all 0), task, prompts per
step, group size, generation length, sampling temperature, learning rate and loss, all taken from
one `RunConfig` (`--set key=value` changes it for all): slimish runs it as `python -m
slimish.train --config <that config>` (engine, router, trainer, weight push: the real loop), once
per side in `MODES` (sync; sync with `launch.colocate=true`, where the engine maps the trainer's
weights and a push copies nothing; async with `buffer.max_staleness=1`); TRL as a `GRPOTrainer`
in this process with the matching `GRPOConfig` (`trl_args` says how each field maps; HF `generate` samples, no vLLM
on CPU). One RL step is, for all: P prompts x G samples generated and scored, one optimiser step.

Threads (`--threads N`, default: every core this process may use) are the same for everyone:
`OMP_NUM_THREADS=N` and `torch.set_num_threads(N)` for TRL (generation and training in one
process); `OMP_NUM_THREADS=N` for slimish's engine (generation) and `trainer.cpu_threads=N` for
its trainer in sync mode, where the engine idles while the trainer trains. In async mode both work
at once: the launch's CPU placement splits the N cores between them.

Workloads (`--workloads`), both on the `max_digit` task from the same warm start:
- `fixed`: every response exactly `--fixed-tokens` (32) tokens: `min_new_tokens` equal to
  `max_new_tokens` on both sides (the engine's and HF `generate`'s: the end token is masked until
  then), so a step's generation work does not depend on what the model writes. The engine's
  log-probs are then of the masked distribution, so slimish marks the samples reshaped and takes
  pi_old from the trainer's forward, as TRL does (docs/training.md).
- `long_tail`: the end token allowed, `max_new_tokens` `--tail-tokens` (192). The warm start
  (`--sft-steps` 100 steps on `max_digit` demonstrations, `demonstrations` below) teaches two
  openings: `\\boxed{d}` and the end token (about 7 tokens), and, in `--long-share` (1/8) of the
  demonstrations, "Checking: " and the prompt's digits repeated for twice the cap before the
  answer. Sampled at temperature 1 the model takes the long opening less often than that (4% of
  responses of the tiny model ran to the cap after 100 SFT steps, 20% after 50; 25% of the small
  model's after 30) and the rest stop early: most steps
  hold a few responses that run to the cap among ~60 short ones. The share (`truncated` below) is
  the model's own, the same distribution for every side (RL then lowers it: long ones score 0).
  A sync step waits for its longest response (TRL's `generate` pads every row to it), which is
  what async training and continuous batching are for.

Printed per workload: mean seconds per step after `--warmup` steps (and each step's), the training
reward per step of each and its mean over the first and the last `TREND` steps (equal learning: the
curves should look alike; a speed-up is worth nothing otherwise; ten steps of the tiny model are too
few to tell a rise from noise on any side), mean response length and truncated share, slimish's
speed-ups over TRL, and the best side against the workload's target (`TARGETS`). TRL's step time is
taken from `on_step_begin` to `on_step_end` (generation, scoring, loss, backward, optimiser step;
not its logging), slimish's from its `time/step` minus any checkpoint write, which TRL does not do
here: both err in TRL's favour.

    .venv/bin/python benchmarks/vs_trl.py                              # tiny llama, both workloads (~5 min on 2 cores)
    .venv/bin/python benchmarks/vs_trl.py --steps 3 --warmup 1 --workloads fixed --sides trl sync
    .venv/bin/python benchmarks/vs_trl.py --model-size small --sft-steps 30 --steps 2 --warmup 1  # ~30M llama (~10 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from slimish.config import RunConfig, load_run_config
from slimish.rollout.rewards import math_reward
from slimish.types import Sample

HERE = Path(__file__).resolve()
TARGETS = {"fixed": 1.2, "long_tail": 2.0}  # slimish's best side at least this much faster than TRL
TREND = 5  # steps averaged at each end of a reward curve: one step's 64 rewards are noise
SIDES = ("sync", "colocated", "async", "trl")  # the order they run in; printed TRL first
LABELS = {"trl": "TRL", "sync": "slimish sync", "colocated": "slimish colocated", "async": "slimish async"}
# What each slimish side adds to the shared config. Async leaves its threads to the launch's CPU
# placement rule (`launch.cpu_placement`: trainer and engine split the cores), so that it, too,
# uses `--threads` in all; the others give the trainer every thread while the engine idles.
MODES = {
    "sync": ["async_training=false"],
    "colocated": ["async_training=false", "launch.colocate=true"],
    "async": ["async_training=true", "buffer.max_staleness=1"],
}

# Every value all sides share is set here, once; slimish reads the rest of its defaults from
# config.py. Filtering is off so that every side trains on every group of the step.
SHARED = [
    "rollout.filter_fn=null",
    "rollout.n_samples_per_prompt=8",
    "rollout.rollout_batch_size=8",  # prompts per step
    "rollout.temperature=1.0",
    # lr 3e-4: the reward rose on every side of the three 30-step runs tried (2026-12-07, two seeds,
    # both workloads: 24 of 24 side-runs, by 0.06-0.18 from the first 5 steps to the last 5). At
    # the quickstart's 1e-3 it stayed flat or fell on 3 of 16, and a sync run at 16 prompts
    # collapsed (entropy 0.45 -> 2.3 in six steps, then no \boxed{} at all, reward 0 for good);
    # benchmarks/README.md.
    "trainer.lr=3e-4",
    "eval.every=0",
    "checkpoint.every=0",
]


async def fixed_length(ctx, sample: Sample) -> Sample:
    """The `fixed` workload's rollout: exactly `max_new_tokens` tokens (the end token masked
    until then, as HF's `min_new_tokens` does), scored by the task's verifier."""
    await ctx.generate_sample({"min_new_tokens": ctx.sampling_params["max_new_tokens"]})
    sample.reward = await math_reward(ctx, sample)
    return sample


@dataclass
class Workload:
    name: str
    max_new_tokens: int
    fixed: bool  # min_new_tokens = max_new_tokens on every side

    def overrides(self) -> list[str]:
        fn = f"{HERE}:fixed_length" if self.fixed else "rollout_plugins.math:rollout"
        return [f"rollout.rollout_fn={fn}", f"rollout.max_new_tokens={self.max_new_tokens}"]

    def describe(self) -> str:
        if self.fixed:
            return f"every response exactly {self.max_new_tokens} tokens"
        return f"end token allowed, cap {self.max_new_tokens} tokens"


@dataclass
class Result:
    step_seconds: list[float] = field(default_factory=list)  # measured steps (after warm-up)
    rewards: list[float] = field(default_factory=list)  # training reward mean, every step
    lengths: list[float] = field(default_factory=list)  # mean response length, every step
    truncated: list[float] = field(default_factory=list)  # share of responses that hit the cap, every step

    @property
    def mean(self) -> float:
        return statistics.mean(self.step_seconds)


def run_config(args: argparse.Namespace, model: Path, run_dir: Path, steps: int, extra: list[str] = ()) -> RunConfig:
    overrides = [
        *SHARED,
        f"model={model}",
        f"run_dir={run_dir}",
        f"steps={steps}",
        f"seed={args.seed}",
        f"data.source=task:{args.task}",
        f"data.seed={args.seed}",
        *extra,
        *args.set,
    ]
    return load_run_config(None, overrides)


# --- slimish ------------------------------------------------------------------------------------


def run_slimish(cfg: RunConfig, warmup: int, timeout: float) -> Result:
    """`python -m slimish.train` on `cfg` in a child process; its metrics.jsonl is the result."""
    from omegaconf import OmegaConf

    from slimish.metrics import read_metrics

    run_dir = Path(cfg.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, not a resume of the last one
    run_dir.mkdir(parents=True)
    config_path = run_dir / "bench.yaml"
    config_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    cmd = [sys.executable, "-m", "slimish.train", "--config", str(config_path)]
    with open(run_dir / "train.log", "w") as log:  # the engine inherits OMP_NUM_THREADS from here
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=os.environ.copy())
    if proc.returncode != 0:
        tail = "".join((run_dir / "train.log").read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"{tail}\nslimish.train exited with {proc.returncode}; the log: {run_dir / 'train.log'}")
    rows = [row for row in read_metrics(run_dir) if row["step"] >= 1]
    return Result(
        step_seconds=[row["time/step"] - row.get("time/checkpoint", 0.0) for row in rows[warmup:]],
        rewards=[row["reward/mean"] for row in rows],
        lengths=[row["rollout/response_length_mean"] for row in rows],
        truncated=[row["rollout/truncated_fraction"] for row in rows],
    )


def demonstrations(path: Path, task_name: str, n: int, seed: int, long_share: float, long_tokens: int) -> Path:
    """SFT rows for the warm start: the task's own demonstrations (`\\boxed{d}`, a random listed
    digit, then the end token), except that a `long_share` of them first repeat the prompt's list
    for about `long_tokens` tokens ("Checking: 8 7 9 ..."; each item is 2 tokens). The model
    learns to open a response that way about that often, and then not to end it soon."""
    from slimish.rollout.tasks import get_task

    task, rng = get_task(task_name), random.Random(seed)
    with open(path, "w") as f:
        for row in task.make("train", n, seed):
            response = task.demonstration(row, rng)
            if rng.random() < long_share:
                items = row["prompt"].rsplit(":", 1)[1].split()
                response = "Checking: " + " ".join(items * (long_tokens // (2 * len(items)) + 1)) + " " + response
            f.write(json.dumps({"prompt": row["prompt"], "response": response}) + "\n")
    return path


def warm_start(cfg: RunConfig, sft_steps: int, sft_lr: float, source: Path, timeout: float) -> Path:
    """A supervised start every side shares: slimish's SFT phase with no RL step, then its HF export."""
    sft = dataclasses.replace(cfg.sft, steps=sft_steps, lr=sft_lr, source=str(source))
    run_slimish(dataclasses.replace(cfg, steps=0, sft=sft), 0, timeout)
    return Path(cfg.run_dir) / "hf"


# --- TRL ----------------------------------------------------------------------------------------


def trl_args(cfg: RunConfig, out_dir: Path, fixed: bool):
    """The `GRPOConfig` equal to `cfg`; raises for settings TRL has no counterpart of here."""
    from trl import GRPOConfig

    alg, tr, ro = cfg.algorithm, cfg.trainer, cfg.rollout
    scale = {"grpo": "group", "dr_grpo": "none"}.get(alg.advantage)
    loss_type = {"token": "dapo", "sample": "grpo", "dr_grpo": "dr_grpo"}[
        alg.loss_reduction
    ]  # tests/test_algorithms.py
    if scale is None or alg.loss != "ppo" or alg.kl_coef or alg.entropy_coef or tr.updates_per_step != 1:
        raise SystemExit("vs_trl maps advantage grpo|dr_grpo, loss ppo, no KL / entropy terms, one update per step")
    return GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=cfg.seed,
        max_steps=cfg.steps,
        disable_dropout=True,
        gradient_checkpointing=False,
        per_device_train_batch_size=ro.rollout_batch_size * ro.n_samples_per_prompt,
        num_generations=ro.n_samples_per_prompt,
        max_completion_length=ro.max_new_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=max(ro.top_k, 0),
        generation_kwargs={"min_new_tokens": ro.max_new_tokens} if fixed else None,
        num_iterations=1,
        scale_rewards=scale,
        loss_type=loss_type,
        beta=0.0,
        epsilon=alg.eps_clip,
        epsilon_high=alg.eps_clip_high,
        learning_rate=tr.lr,
        lr_scheduler_type="constant",
        weight_decay=tr.weight_decay,
        adam_beta1=tr.betas[0],
        adam_beta2=tr.betas[1],
        max_grad_norm=tr.grad_clip,
    )


def run_trl(cfg: RunConfig, warmup: int, fixed: bool, threads: int) -> Result:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from slimish.rollout.data import load_rows
    from slimish.rollout.tasks import get_task

    torch.set_num_threads(threads)  # generation and training: this process
    task = get_task(cfg.data.source.removeprefix("task:"))
    rows = load_rows(cfg.data.source, cfg.data)  # the prompts slimish trains on, as chat messages
    data = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows])

    def reward(completions, label, **_):
        return [task.score(c[-1]["content"] if isinstance(c, list) else c, y) for c, y in zip(completions, label)]

    result, started = Result(), {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            started["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step > warmup:
                result.step_seconds.append(time.perf_counter() - started["t"])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                result.rewards.append(logs["reward"])
                result.lengths.append(logs.get("completions/mean_length", float("nan")))
                result.truncated.append(logs.get("completions/clipped_ratio", float("nan")))

    trainer = GRPOTrainer(
        model=cfg.model,
        reward_funcs=reward,
        args=trl_args(cfg, Path(cfg.run_dir), fixed),
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(cfg.model),
        callbacks=[Timer()],
    )
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts; the rewards are printed at the end
    trainer.train()
    return result


# --- main ---------------------------------------------------------------------------------------


def fmt(values: list[float], spec: str) -> str:
    return " ".join(format(v, spec) for v in values)


def report(results: dict[str, Result], target: float) -> None:
    results = {side: results[side] for side in ("trl", *SIDES[:-1]) if side in results}
    for side, r in results.items():
        print(f"  {LABELS[side]:14s} {r.mean:6.2f} s/step  [{fmt(r.step_seconds, '.2f')}]")
    for side, r in results.items():
        print(f"  {LABELS[side]:14s} reward per step: {fmt(r.rewards, '.3f')}")
    for side, r in results.items():
        first, last = statistics.mean(r.rewards[:TREND]), statistics.mean(r.rewards[-TREND:])
        print(f"  {LABELS[side]:14s} reward, mean of the first and last {TREND} steps: {first:.3f} -> {last:.3f}")
    for side, r in results.items():
        print(
            f"  {LABELS[side]:14s} response length {statistics.mean(r.lengths):5.1f}, "
            f"truncated {statistics.mean(r.truncated):.1%}  (per step: {fmt(r.lengths, '.0f')})"
        )
    ours = [side for side in results if side != "trl"]
    if "trl" in results and ours:
        for side in ours:
            print(f"  {LABELS[side]} speed-up over TRL: {results['trl'].mean / results[side].mean:.2f}x")
        best = min(ours, key=lambda side: results[side].mean)
        ratio = results["trl"].mean / results[best].mean
        print(
            f"  best: {LABELS[best]}, {ratio:.2f}x ({'meets' if ratio >= target else 'misses'} the >= {target}x target)"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=28, help="measured RL steps, after --warmup")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="CPU threads for each side's generation and training (default: every usable core)",
    )
    p.add_argument("--workloads", nargs="+", choices=("fixed", "long_tail"), default=["fixed", "long_tail"])
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--fixed-tokens", type=int, default=32, help="the fixed workload's response length")
    p.add_argument("--tail-tokens", type=int, default=192, help="the long-tail workload's max_new_tokens")
    p.add_argument("--task", default="max_digit")
    p.add_argument("--arch", default="llama")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--model", type=Path, default=None, help="an HF model directory instead of a fresh tiny model")
    p.add_argument(
        "--sft-steps", type=int, default=100, help="slimish SFT warm start every side then starts from; 0: none"
    )
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--long-share", type=float, default=0.125, help="share of long SFT demonstrations (the long tail)")
    p.add_argument("--set", nargs="*", default=[], metavar="key=value", help="RunConfig overrides, every side")
    p.add_argument("--out", type=Path, default=Path("runs/bench-vs-trl"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for each slimish child process")
    args = p.parse_args()

    # Before torch starts its thread pool here (TRL) or in a child (slimish's trainer and engine).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(HERE.parent))
    from engine_throughput import bench_model  # benchmarks/, this script's directory

    load_start, started = os.getloadavg(), time.perf_counter()
    model = args.model or bench_model(args.model_size, args.arch, Path("runs/bench-models"))
    if args.sft_steps:
        args.out.mkdir(parents=True, exist_ok=True)
        demos = demonstrations(
            args.out / "sft.jsonl", args.task, 2000, args.seed, args.long_share, 2 * args.tail_tokens
        )
        model = warm_start(
            run_config(args, model, args.out / "warm", 0), args.sft_steps, args.sft_lr, demos, args.timeout
        )
    steps = args.steps + args.warmup
    workloads = {
        "fixed": Workload("fixed", args.fixed_tokens, True),
        "long_tail": Workload("long_tail", args.tail_tokens, False),
    }
    print(
        f"model {model} (SFT warm start: {args.sft_steps} steps), task {args.task}; threads {args.threads} for every "
        f"side (TRL: torch and OMP threads; slimish: trainer.cpu_threads and the engine's OMP_NUM_THREADS); "
        f"{args.warmup} warm-up + {args.steps} measured steps"
    )
    for name in args.workloads:
        workload = workloads[name]
        results: dict[str, Result] = {}
        for side in sorted(args.sides, key=SIDES.index):
            threads = [] if side == "async" else [f"trainer.cpu_threads={args.threads}"]
            extra = [*workload.overrides(), *MODES.get(side, []), *threads]
            cfg = run_config(args, model, args.out / name / side, steps, extra)
            if side == "trl":
                results[side] = run_trl(cfg, args.warmup, workload.fixed, args.threads)
            else:
                results[side] = run_slimish(cfg, args.warmup, args.timeout)
        ro = cfg.rollout
        print(
            f"\nworkload {name}: {ro.rollout_batch_size} prompts x {ro.n_samples_per_prompt} samples, {workload.describe()}"
        )
        report(results, TARGETS[name])
    print(
        f"\nwhole run {time.perf_counter() - started:.0f} s; load average at start: {fmt(load_start, '.2f')}; "
        f"at end: {fmt(os.getloadavg(), '.2f')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
