"""What true on-policy mode costs: engine throughput and trainer step time, with it and without.

Engine: one built-in engine per mode (`--enable-deterministic-inference` off / on), `--prompts`
prompts of 16-64 tokens each generating `--tokens` tokens (sampled, seeded) in one batch; tokens per
second over `--repeats` batches after a warm-up, median. Trainer: those samples (the deterministic
engine's, so their log-probs are the trainer's exactly) through one RL step of a fresh fp32
TorchTrainer per repeat, median seconds per step, in two modes: off (stock kernels, rollout
log-probs as the old policy's) and on (`algorithm.true_on_policy`: batch-invariant kernels, the
per-step equality check). Also the mismatch each mode's step measured. (Recomputing pi_old costs no
forward with one update per step: it is the update's own.)

    .venv/bin/python benchmarks/true_on_policy.py                   # tiny llama (~1 min)
    .venv/bin/python benchmarks/true_on_policy.py --size small      # ~30M params
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from slimish.config import load_run_config  # noqa: E402
from slimish.launch.local import engine_process  # noqa: E402
from slimish.processes import start_all  # noqa: E402
from slimish.tiny_model import make_tiny_model  # noqa: E402
from slimish.types import Sample  # noqa: E402

GROUP = 4  # samples per group; rewards alternate 0, 1 within a group
TRAINER_MODES = {
    "off": [],
    "on": ["algorithm.true_on_policy=true"],
}


def generate(url: str, prompts: list[list[int]], tokens: int) -> tuple[list[dict], float]:
    """One batch: the replies and the seconds it took."""
    sampling = [
        {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": tokens, "sampling_seed": i}
        for i in range(len(prompts))
    ]
    body = {"input_ids": prompts, "sampling_params": sampling, "return_logprob": True}
    httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/generate", json=body, timeout=1800)
    r.raise_for_status()
    return r.json(), time.perf_counter() - t0


def engine_runs(model: Path, args: argparse.Namespace, work: Path) -> tuple[dict[str, float], list[dict]]:
    """Median tok/s per engine mode; the deterministic engine's replies (for the trainer)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, int(n)).tolist() for n in rng.integers(16, 65, args.prompts)]
    speeds, replies = {}, []
    for mode in ("off", "on"):
        engine = engine_process(
            model, log_path=work / f"engine-{mode}.log", enable_deterministic_inference=mode == "on"
        )
        try:
            start_all([engine], timeout=300)
            generate(engine.url, prompts[:4], 4)  # warm-up
            runs = [generate(engine.url, prompts, args.tokens) for _ in range(args.repeats)]
        finally:
            engine.stop()
        speeds[mode] = statistics.median(len(prompts) * args.tokens / seconds for _, seconds in runs)
        replies = runs[0][0]
    groups = []
    for k, (ids, reply) in enumerate(zip(prompts, replies)):
        s = Sample(prompt="", group_id=k // GROUP, index=k % GROUP)
        s.set_prompt(ids)
        s.append_model(reply["output_ids"], [lp for lp, *_ in reply["meta_info"]["output_token_logprobs"]])
        s.reward = float(k % 2)
        groups.append(s.to_dict())
    return speeds, [groups[g : g + GROUP] for g in range(0, len(groups), GROUP)]


def trainer_runs(model: Path, sets: list[list[dict]], repeats: int) -> dict[str, tuple[float, float]]:
    """Per trainer mode: (median s/step, train/mismatch) over fresh TorchTrainers, one step each."""
    from slimish.trainer.torch_backend import TorchTrainer

    out = {}
    for mode, extra in TRAINER_MODES.items():
        overrides = [f"model={model}", "data.source=unused", "trainer.dtype=float32", *extra]
        times, mismatch = [], 0.0
        for _ in range(repeats):
            trainer = TorchTrainer(load_run_config(None, overrides))
            groups = [[Sample.from_dict(d) for d in g] for g in sets]
            t0 = time.perf_counter()
            metrics = trainer.train_step(groups, 1)
            times.append(time.perf_counter() - t0)
            mismatch = metrics["train/mismatch"]
        out[mode] = (statistics.median(times), mismatch)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=("tiny", "mini", "small"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model", arch="llama", size=args.size, seed=0)
        speeds, sets = engine_runs(model, args, work)
        steps = trainer_runs(model, sets, args.repeats)
    print(f"llama {args.size}, {args.prompts} prompts x {args.tokens} new tokens, OMP_NUM_THREADS=1")
    print("| engine | tok/s |\n|---|---|")
    for mode, speed in speeds.items():
        print(f"| deterministic inference {mode} | {speed:.0f} |")
    print(f"on / off: {speeds['on'] / speeds['off']:.2f}x\n")
    print("| trainer | s/step | train/mismatch |\n|---|---|---|")
    for mode, (seconds, mismatch) in steps.items():
        print(f"| {mode} | {seconds:.3f} | {mismatch:.3g} |")
    print(f"on / off: {steps['on'][0] / steps['off'][0]:.2f}x")


if __name__ == "__main__":
    main()
