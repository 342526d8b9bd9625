"""Wall time per RL step of slimish (sync loop) against TRL's GRPOTrainer, on CPU, in one run.

Both sides get the same model, task, prompts per step, group size, generation length, sampling
temperature, learning rate and loss, all taken from one `RunConfig` (`--set key=value` changes
it for both): slimish runs it as `python -m slimish.train --config <that config>` (engine, router,
trainer, weight push: the real loop), TRL as a `GRPOTrainer` in this process with the matching
`GRPOConfig` (`trl_args` says how each field maps; HF `generate` samples, no vLLM on CPU). One RL
step is, for both: P prompts x G samples generated and scored, one optimiser step.

Printed: median seconds per step after `--warmup` steps, the training reward per step of each
(equal learning: the reward curves should look alike, a speed-up is worth nothing otherwise), and
slimish's speed-up, target >= 2x. TRL's step time is taken from `on_step_begin` to `on_step_end`
(generation, scoring, loss, backward, optimiser step; not its logging), slimish's from its
`time/step` minus any checkpoint write, which TRL does not do here: both err in TRL's favour.

    .venv/bin/python benchmarks/vs_trl.py                            # tiny llama, max_digit, 5 + 1 steps
    .venv/bin/python benchmarks/vs_trl.py --sft-steps 40             # both start from a slimish SFT warm start
    .venv/bin/python benchmarks/vs_trl.py --only trl --steps 2       # one side only
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 2 threads are slower here (notes/cpu-runtime.md)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from engine_throughput import bench_model  # noqa: E402  (benchmarks/, this script's directory)
from slimish.config import RunConfig, load_run_config  # noqa: E402

TARGET = 2.0  # slimish seconds per step at least 2x fewer than TRL's

# The slimish half. Every value both sides share is set here, once; slimish reads the rest of
# its defaults from config.py. Filtering is off so that both train on every group of the step.
SHARED = [
    "rollout.rollout_fn=rollout_plugins.math:rollout",  # generate, then the task's own verifier
    "rollout.filter_fn=null",
    "rollout.n_samples_per_prompt=8",
    "rollout.rollout_batch_size=8",  # prompts per step
    "rollout.max_new_tokens=32",
    "rollout.temperature=1.0",
    "trainer.lr=1e-5",
    "eval.every=0",
    "checkpoint.every=0",
]


@dataclass
class Result:
    step_seconds: list[float] = field(default_factory=list)  # measured steps (after warm-up)
    rewards: list[float] = field(default_factory=list)  # training reward mean, every step

    @property
    def median(self) -> float:
        return statistics.median(self.step_seconds)


def run_config(args: argparse.Namespace, model: Path, run_dir: Path, steps: int) -> RunConfig:
    overrides = [*SHARED, f"model={model}", f"run_dir={run_dir}", f"steps={steps}", f"seed={args.seed}",
                 f"data.source=task:{args.task}", f"data.seed={args.seed}", *args.set]  # fmt: skip
    return load_run_config(None, overrides)


# --- slimish ------------------------------------------------------------------------------------


def run_slimish(cfg: RunConfig, warmup: int, timeout: float) -> Result:
    """`python -m slimish.train` on `cfg` in a child process; its metrics.jsonl is the result."""
    run_dir = Path(cfg.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, not a resume of the last one
    run_dir.mkdir(parents=True)
    config_path = run_dir / "bench.yaml"
    config_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    cmd = [sys.executable, "-m", "slimish.train", "--config", str(config_path)]
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=os.environ.copy())
    if proc.returncode != 0:
        tail = "".join((run_dir / "train.log").read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"{tail}\nslimish.train exited with {proc.returncode}; the log: {run_dir / 'train.log'}")
    from slimish.metrics import read_metrics

    rows = [row for row in read_metrics(run_dir) if row["step"] >= 1]
    result = Result(rewards=[row["reward/mean"] for row in rows])
    result.step_seconds = [row["time/step"] - row.get("time/checkpoint", 0.0) for row in rows[warmup:]]
    return result


def warm_start(cfg: RunConfig, sft_steps: int, timeout: float) -> Path:
    """A supervised start both sides share: slimish's SFT phase with no RL step, then its HF export."""
    sft = dataclasses.replace(cfg.sft, steps=sft_steps, source=cfg.sft.source or cfg.data.source)
    run_slimish(dataclasses.replace(cfg, steps=0, sft=sft), 0, timeout)
    return Path(cfg.run_dir) / "hf"


# --- TRL ----------------------------------------------------------------------------------------


def trl_args(cfg: RunConfig, out_dir: Path):
    """The `GRPOConfig` equal to `cfg`; raises for settings TRL has no counterpart of here."""
    from trl import GRPOConfig

    alg, tr, ro = cfg.algorithm, cfg.trainer, cfg.rollout
    scale = {"grpo": "group", "dr_grpo": "none"}.get(alg.advantage)
    loss_type = {"token": "dapo", "sample": "grpo", "dr_grpo": "dr_grpo"}[alg.loss_reduction]  # tests/test_algorithms.py
    if scale is None or alg.loss != "ppo" or alg.kl_coef or alg.entropy_coef or tr.updates_per_step != 1:
        raise SystemExit("vs_trl maps advantage grpo|dr_grpo, loss ppo, no KL / entropy terms, one update per step")
    return GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True,
        seed=cfg.seed, max_steps=cfg.steps, disable_dropout=True, gradient_checkpointing=False,
        per_device_train_batch_size=ro.rollout_batch_size * ro.n_samples_per_prompt, num_generations=ro.n_samples_per_prompt,
        max_completion_length=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p, top_k=max(ro.top_k, 0),
        num_iterations=1, scale_rewards=scale, loss_type=loss_type, beta=0.0,
        epsilon=alg.eps_clip, epsilon_high=alg.eps_clip_high, learning_rate=tr.lr, lr_scheduler_type="constant",
        weight_decay=tr.weight_decay, adam_beta1=tr.betas[0], adam_beta2=tr.betas[1], max_grad_norm=tr.grad_clip,
    )  # fmt: skip


def run_trl(cfg: RunConfig, warmup: int) -> Result:
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from slimish.rollout.data import load_rows
    from slimish.rollout.tasks import get_task

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

    trainer = GRPOTrainer(
        model=cfg.model, reward_funcs=reward, args=trl_args(cfg, Path(cfg.run_dir)), train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(cfg.model), callbacks=[Timer()],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts; the rewards are printed at the end
    trainer.train()
    return result


# --- main ---------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="measured RL steps, after --warmup")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--task", default="max_digit")
    p.add_argument("--arch", default="llama")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--model", type=Path, default=None, help="an HF model directory instead of a fresh tiny model")
    p.add_argument("--sft-steps", type=int, default=0, help="slimish SFT warm start both sides then start from")
    p.add_argument("--set", nargs="*", default=[], metavar="key=value", help="RunConfig overrides, both sides")
    p.add_argument("--only", choices=["both", "slimish", "trl"], default="both")
    p.add_argument("--out", type=Path, default=Path("runs/bench-vs-trl"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for each slimish child process")
    args = p.parse_args()

    load_start = os.getloadavg()
    model = args.model or bench_model(args.model_size, args.arch, Path("runs/bench-models"))
    steps = args.steps + args.warmup
    if args.sft_steps:
        model = warm_start(run_config(args, model, args.out / "warm", 0), args.sft_steps, args.timeout)
    cfgs = {side: run_config(args, model, args.out / side, steps) for side in ("slimish", "trl")}
    ro = cfgs["trl"].rollout
    print(f"model {model}, task {args.task}: {ro.rollout_batch_size} prompts x {ro.n_samples_per_prompt} samples, "
          f"<= {ro.max_new_tokens} new tokens, {args.warmup} warm-up + {args.steps} measured steps")  # fmt: skip
    results: dict[str, Result] = {}
    if args.only in ("both", "slimish"):
        results["slimish"] = run_slimish(cfgs["slimish"], args.warmup, args.timeout)
    if args.only in ("both", "trl"):
        results["trl"] = run_trl(cfgs["trl"], args.warmup)

    for side, r in results.items():
        per_step = " ".join(f"{s:.2f}" for s in r.step_seconds)
        rewards = " ".join(f"{x:.3f}" for x in r.rewards)
        print(f"{side:8s} median {r.median:7.2f} s/step  [{per_step}]  reward per step: {rewards}")
    if len(results) == 2:
        ratio = results["trl"].median / results["slimish"].median
        verdict = "meets" if ratio >= TARGET else "misses"
        print(f"slimish speed-up per RL step: {ratio:.2f}x ({verdict} the >= {TARGET:.0f}x target)")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)}; "
          f"at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
