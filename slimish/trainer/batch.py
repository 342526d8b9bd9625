"""Batch building: how a rollout batch is cut up for its optimiser steps, as pure bookkeeping.

Every rank is handed the same full batch. It is split into `trainer.updates_per_step` minibatches
(one optimiser step each); each data-parallel rank trains on its share of a minibatch, balanced by
tokens, in micro-batches of at most `trainer.micro_batch_tokens` padded tokens. `Batch` holds what
the updates need, made once before the first (base.py `Trainer._prepare`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from slimish.trainer.routing import REPLAYED_STATS
from slimish.types import Sample

# Additive statistics summed over micro-batches, updates and ranks (rl_loss's, plus the step's).
STAT_KEYS = (
    "loss/policy",
    "loss/kl",
    "loss/entropy",
    "tokens",
    "clip_low",
    "clip_high",
    "dual_clip",
    "ratio",
    "tis",
    "kl",
    "entropy",
    "mismatch",
    "mismatch_tokens",
    "mismatch_fresh",
    "mismatch_fresh_tokens",
    "mismatch_seq_max",
    "mismatch_seqs",
    *REPLAYED_STATS,
    "teacher_kl",
    "loss/value",
    "value_clip",
    "loss/ptx",
)


@dataclass
class Batch:
    """A rollout batch made ready for its optimiser steps (`Trainer._prepare`)."""

    samples: list[Sample]
    minis: list[list[int]]  # sample indices of each update
    shares: list[list[int]]  # this rank's part of each update
    trajectory: list[int]  # each sample's trajectory
    fresh: list[float]  # 1 where made by the weights this step starts from
    # This rank's samples: the log-probs the ratio is taken against; None: the first update's own
    # forward's (`Trainer._old_from_first_update`).
    old: dict[int, Tensor | None]
    ref: dict[int, Tensor] | None  # and the reference policy's, with KL on
    teacher: dict[int, Tensor] | None  # and the teacher's, with on-policy distillation on
    advantages: Tensor  # the task advantage: [B], or [B, R] per token (gae)
    raw_rewards: Tensor  # before KL in the reward, for the metrics
    stats: dict[str, float]  # summed loss statistics, this rank's
    old_apart: bool = False  # pi_old taken by a pass of its own, which measured the mismatch
    values: Tensor | None = None  # gae: the critic's values [B, R] before the updates
    returns: Tensor | None = None  # gae: what the critic is trained towards [B, R]
    critic_only: bool = False  # critic.warmup_steps: this step trains the critic alone
    critic_metrics: dict[str, float] = field(default_factory=dict)
    demos: list[Sample] = field(default_factory=list)  # algorithm.ptx_coef's demonstrations


def shard(lengths: list[int], world: int) -> list[list[int]]:
    """Sample indices per rank, balanced by tokens: longest first, each to the least-loaded rank."""
    loads, out = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += lengths[i]
    return out


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices in micro-batches of at most `budget` padded tokens (rows x longest); sorted by
    length so that rows of a micro-batch pad little. A longer sample goes alone."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def split_minibatches(n: int, parts: int) -> list[list[int]]:
    """0..n-1 in `parts` contiguous, near-equal chunks (none empty)."""
    parts = min(parts, n)
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(parts)]


def check_samples(samples: list[Sample]) -> None:
    for s in samples:
        s.check()
        if s.prompt_length < 1:
            raise ValueError(
                f"sample {s.group_id}/{s.index}: needs at least one prompt token, got tokens of length {len(s.tokens)}"
            )


def response_index(batch: list[Sample], first: int) -> Tensor:
    """`[B, R]` positions, in logits that start at position `first`, of the logits that predict
    each sample's response tokens (position p predicts token p + 1); 0 past a sample's end."""
    index = torch.zeros(len(batch), max(s.response_length for s in batch), dtype=torch.long)
    for row, s in enumerate(batch):
        index[row, : s.response_length] = torch.arange(s.response_length) + (s.prompt_length - 1 - first)
    return index


def trajectory_index(groups: list[list[Sample]]) -> tuple[list[int], list[int]]:
    """Per sample (groups flattened), its trajectory's index 0..T-1; per trajectory, its group's.
    A sample without a trajectory id is a trajectory of its own."""
    trajectory: list[int] = []
    group_of: list[int] = []
    for g, samples in enumerate(groups):
        seen: dict[Any, int] = {}
        for k, s in enumerate(samples):
            key = s.trajectory_id if s.trajectory_id is not None else ("sample", k)
            if key not in seen:
                seen[key] = len(group_of)
                group_of.append(g)
            trajectory.append(seen[key])
    return trajectory, group_of


def mismatch(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, fresh: list[float]) -> dict[str, Tensor]:
    """Sums of |trainer - engine logprob| over trained tokens, and token counts, over all rows
    and over the `fresh` ones (1.0: made by the weights the step starts from); and the sum over
    rows with trained tokens of each one's largest (one bad token in a sequence, as a flipped
    route makes, is diluted in the per-token mean), with the count of such rows."""
    gap = (logprobs - rollout_logprobs).abs() * mask
    per_row, tokens = gap.sum(-1), mask.sum(-1)
    is_fresh = torch.tensor(fresh, dtype=per_row.dtype, device=per_row.device)
    return {
        "mismatch_seq_max": torch.nn.functional.pad(gap, (0, 1)).amax(-1).sum(),  # a 0 column: rows of no tokens
        "mismatch_seqs": (tokens > 0).sum(),
        "mismatch": per_row.sum(),
        "mismatch_tokens": tokens.sum(),
        "mismatch_fresh": (per_row * is_fresh).sum(),
        "mismatch_fresh_tokens": (tokens * is_fresh).sum(),
    }


def check_exact(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> None:
    """`algorithm.true_on_policy`: the trainer's log-probs at the rollout's weights equal the
    engine's on every trained token, or the run stops here: an inexact step would train on the
    noise the mode exists to remove, and a silent fallback would hide a broken kernel."""
    differ = mask.bool() & (logprobs.detach() != rollout_logprobs)
    if bool(differ.any()):
        gap = (logprobs.detach() - rollout_logprobs).abs()[differ]
        raise RuntimeError(
            f"algorithm.true_on_policy: {int(differ.sum())} of {int(mask.bool().sum())} trained tokens have trainer "
            f"log-probs unequal to the rollout's (largest gap {float(gap.max()):.3g}); the engine and trainer kernels "
            "are no longer the same (docs/true-on-policy.md)"
        )
