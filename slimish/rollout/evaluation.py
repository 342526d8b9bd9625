"""Evaluation on held-out datasets: `eval.source` (metrics `eval/...`) and `eval.datasets`
(metrics `eval/NAME/...`), each with its own rollout and reward functions, sampling parameters
and samples per prompt.

Each set reports the mean reward, accuracy (the share of samples with reward >= 1, a verifier's
"correct"), mean response length, failed samples, pass@k for k = 1, 2, 4, ... up to n (the
unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code":
the chance that at least one of k samples drawn from the n is correct) and mean@n (accuracy
averaged over each prompt's n samples, then over prompts). A sample whose rollout or reward
function failed counts as not correct.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slimish.plugins import Loader, load_function
from slimish.rollout.data import load_rows
from slimish.rollout.pipeline import Pipeline, new_sample
from slimish.types import Sample, SampleStatus, trajectories

if TYPE_CHECKING:
    from slimish.config import RunConfig


@dataclass
class EvalSet:
    name: str | None  # None: `eval.source`, whose metrics are eval/... (no name in them)
    rows: list[dict[str, Any]]
    rollout_fn: Callable[..., Any]
    reward_fn: Callable[..., Any] | None
    n_samples_per_prompt: int
    sampling_params: dict[str, Any]  # over the run's defaults

    def prefix(self) -> str:
        return "eval/" if self.name is None else f"eval/{self.name}/"


def eval_sets(
    cfg: RunConfig,
    rollout_fn: Callable[..., Any],
    reward_fn: Callable[..., Any] | None,
    load: Loader = load_function,
) -> list[EvalSet]:
    """The run's evaluation sets, rows read and functions loaded and checked now (at start-up);
    a set's functions default to the run's. `load` loads a set's own (`slimish train` passes
    slimish.compat's, which also adapts `slime:` specs)."""
    e = cfg.eval
    sets = []
    if e.source is not None:
        rows = load_rows(e.source, cfg.data, "test")[: e.n_prompts]
        sets.append(EvalSet(None, rows, rollout_fn, reward_fn, e.n_samples_per_prompt, {"temperature": e.temperature}))
    for i, d in enumerate(e.datasets):
        where = f"eval.datasets[{i}]"
        params = {"temperature": e.temperature if d.temperature is None else d.temperature}
        params.update({k: v for k, v in (("top_p", d.top_p), ("max_new_tokens", d.max_new_tokens)) if v is not None})
        sets.append(
            EvalSet(
                d.name,
                load_rows(d.source, cfg.data, "test", flag=f"{where}.source")[: d.n_prompts or e.n_prompts],
                load(d.rollout_fn, "rollout", f"{where}.rollout_fn") if d.rollout_fn else rollout_fn,
                load(d.reward_fn, "reward", f"{where}.reward_fn") if d.reward_fn else reward_fn,
                d.n_samples_per_prompt or e.n_samples_per_prompt,
                params,
            )
        )
    return sets


async def evaluate(pipeline: Pipeline, eval_set: EvalSet) -> dict[str, float]:
    """One held-out set: every prompt, n samples each, through `pipeline` with the set's functions
    and sampling params (and the run's sample hook and reward post-process); its metrics named
    `eval/...`. Nothing is trained or counted in the run's rollout counters."""

    async def group_of(i: int, row: dict[str, Any]) -> list[Sample]:
        row = {**row, "metadata": {**row["metadata"], "eval": True}}
        todo = [new_sample(row, i, j) for j in range(eval_set.n_samples_per_prompt)]
        runs = (pipeline.run_sample(s, None, eval_set.sampling_params, eval_set.rollout_fn) for s in todo)
        group = [s for out, _ in await asyncio.gather(*runs) for s in out]
        scored = [s for s in group if s.status != SampleStatus.FAILED]
        if scored:
            await pipeline.score(scored, eval_set.reward_fn)
        return group

    groups = await asyncio.gather(*(group_of(i, r) for i, r in enumerate(eval_set.rows)))
    metrics = summarize(list(groups), eval_set.n_samples_per_prompt, pipeline.cfg.reward_key)
    return {eval_set.prefix() + k: v for k, v in metrics.items()}


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The chance that at least one of `k` of the `n` samples, drawn without replacement, is
    correct when `correct` of them are: 1 - C(n - c, k) / C(n, k), as a stable product."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - correct + 1, n + 1))


def ks(n: int) -> list[int]:
    """1, 2, 4, ... up to `n`, and `n`."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


def summarize(groups: list[list[Sample]], n: int, reward_key: str | None) -> dict[str, float]:
    """A set's metrics from its groups (one per prompt; a trajectory is one of its n samples,
    scored by its last sample)."""
    samples = [s for g in groups for s in g]
    ok = [s for s in samples if s.status != SampleStatus.FAILED]
    rewards = [s.reward_value(reward_key) for s in ok]
    out = {
        "reward": mean(rewards),
        "accuracy": mean([float(r >= 1.0) for r in rewards]),
        "response_length": mean([float(s.response_length) for s in ok]),
        "samples": float(len(samples)),
        "failed": float(len(samples) - len(ok)),
    }
    correct = []
    for group in groups:
        lasts = [t[-1] for t in trajectories(group).values()]
        correct.append(sum(s.status != SampleStatus.FAILED and s.reward_value(reward_key) >= 1.0 for s in lasts))
    for k in ks(n):
        out[f"pass@{k}"] = mean([pass_at_k(n, c, k) for c in correct])
    out[f"mean@{n}"] = mean([c / n for c in correct])
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
