"""What every trainer backend shares: the RL and SFT steps, from samples to metrics.

A step's logic does not depend on how the model is run: advantages and the loss normaliser are
computed on the whole batch (every rank is handed the same full batch), then each data-parallel
rank trains on its share, balanced by tokens, in micro-batches of at most
`trainer.micro_batch_tokens` padded tokens. Each micro-batch's loss is its share of the global
batch's loss (algorithms.py), so any split, over ranks or micro-batches, gives the gradient of
the full batch. The backends (torch_backend.py, megatron_backend.py) supply the forward and
backward of those micro-batches, the optimiser step, the reduction over data-parallel ranks and
the model state; `Trainer` lists these as the methods a backend implements.

Micro-batches are right-padded rows, not one packed row: real tokens come before the padding, so
a causal model computes them exactly as it would unpadded, with no attention mask, and attention
stays quadratic in each sample's length instead of in the micro-batch's.
"""

from __future__ import annotations

import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from slimish.buffer import group_version
from slimish.config import RunConfig
from slimish.rollout.loader import load_function
from slimish.trainer.algorithms import (
    credit_weights,
    explained_variance,
    gae_advantages,
    kl_penalty,
    loss_normalizer,
    masked_whiten,
    opd_advantages,
    rl_loss,
    sequence_kl,
    sft_loss,
    teacher_log_ratio,
    trajectory_advantages,
    value_loss,
)
from slimish.types import Sample

# Additive statistics summed over micro-batches, updates and ranks (rl_loss's, plus ours).
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
    "teacher_kl",
    "loss/value",
    "value_clip",
    "loss/ptx",
)

# (sample indices, response logprobs [B, R], entropies [B, R] or None) -> (loss share, stats)
LossFn = Callable[[list[int], Tensor, Tensor | None], tuple[Tensor, dict[str, Tensor]]]


# -- pure helpers ---------------------------------------------------------------------------------


def mismatch(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, fresh: list[float]) -> dict[str, Tensor]:
    """Sums of |trainer - engine logprob| over trained tokens, and token counts, over all rows
    and over the `fresh` ones (1.0: made by the weights the step starts from)."""
    per_row, tokens = ((logprobs - rollout_logprobs).abs() * mask).sum(-1), mask.sum(-1)
    is_fresh = torch.tensor(fresh, dtype=per_row.dtype, device=per_row.device)
    return {
        "mismatch": per_row.sum(),
        "mismatch_tokens": tokens.sum(),
        "mismatch_fresh": (per_row * is_fresh).sum(),
        "mismatch_fresh_tokens": (tokens * is_fresh).sum(),
    }


def lr_factor(schedule: str, warmup: int, total: int, step: int) -> float:
    """LR multiplier for optimiser step `step` (0-based) of `total`: linear warmup over `warmup`
    steps, then constant, or cosine / linear decay reaching 0 after the last step."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"trainer.lr_schedule: expected constant, cosine or linear, got {schedule!r}")


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


# -- the shared steps -----------------------------------------------------------------------------


@dataclass
class _Batch:
    """A rollout batch made ready for its optimiser steps (`Trainer._prepare`)."""

    samples: list[Sample]
    minis: list[list[int]]  # sample indices of each update
    shares: list[list[int]]  # this rank's part of each update
    trajectory: list[int]  # each sample's trajectory
    fresh: list[float]  # 1 where made by the weights this step starts from
    old: dict[int, Tensor]  # this rank's samples: the log-probs the ratio is taken against
    ref: dict[int, Tensor] | None  # and the reference policy's, with KL on
    teacher: dict[int, Tensor] | None  # and the teacher's, with on-policy distillation on
    advantages: Tensor  # the task advantage: [B], or [B, R] per token (gae)
    raw_rewards: Tensor  # before KL in the reward, for the metrics
    stats: dict[str, float]  # summed loss statistics, this rank's
    values: Tensor | None = None  # gae: the critic's values [B, R] before the updates
    returns: Tensor | None = None  # gae: what the critic is trained towards [B, R]
    critic_only: bool = False  # critic.warmup_steps: this step trains the critic alone
    critic_metrics: dict[str, float] = field(default_factory=dict)
    demos: list[Sample] = field(default_factory=list)  # algorithm.ptx_coef's demonstrations


class Trainer(ABC):
    """The RL and SFT steps of every backend. A backend's `__init__` sets the attributes below
    (`_setup` does the common ones) and implements the abstract methods.

    Collective calls: `train_step`, `sft_step`, `logprobs`, `hf_tensors`, `state_dict` and
    `save_hf` are called on every rank; `hf_tensors` and `state_dict` are complete on rank 0."""

    cfg: RunConfig
    rank: int  # global rank
    dp_rank: int  # which share of a batch this rank trains on
    dp_size: int
    device: torch.device
    tokenizer: Any
    pad_id: int
    temperature: float
    cpu_threads: int
    credit_fn: Callable[..., list[float]] | None  # algorithm.segment_credit as a function
    advantage_fn: Callable[[Tensor, Tensor], Tensor] | None  # algorithm.advantage as a function
    policy_loss_fn: Callable[..., Tensor] | None  # algorithm.loss as a function
    ref: Any  # the frozen reference model, None until needed
    critic: Any = None  # the value model (algorithm.advantage=gae), None without
    optimizer: Any
    sft_optimizer: Any

    def _setup(self, cfg: RunConfig, tokenizer: Any, local_ranks: int) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0  # greedy: T = 1
        self.sft_optimizer = None
        engines_idle = cfg.mode == "sync" or cfg.buffer.max_staleness == 0  # while this trains
        cores = max(1, (os.cpu_count() or 1) // local_ranks) if engines_idle else torch.get_num_threads()
        self.cpu_threads = cfg.trainer.cpu_threads or cores
        credit = cfg.algorithm.segment_credit
        self.credit_fn = (
            load_function(credit, "credit") if ":" in credit else None
        )  # checked now, not at the first step
        advantage, loss = cfg.algorithm.advantage, cfg.algorithm.loss
        self.advantage_fn = load_function(advantage, "advantage") if ":" in advantage else None
        self.policy_loss_fn = load_function(loss, "policy_loss") if ":" in loss else None

    @contextmanager
    def _threads(self) -> Iterator[None]:
        """`trainer.cpu_threads` intra-op threads for one step on CPU, then back to what it was."""
        before = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(self.cpu_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    # -- RL ----------------------------------------------------------------------------------

    def train_step(self, groups: list[list[Sample]], step: int, demos: list[Sample] | None = None) -> dict[str, float]:
        with self._threads():
            return self._train_step(groups, step, demos)

    def _train_step(self, groups: list[list[Sample]], step: int, demos: list[Sample] | None) -> dict[str, float]:
        """One rollout batch: `trainer.updates_per_step` optimiser steps. `step` is the RL step
        (1-based); it must follow the optimiser's history, which catches a resume that did not
        restore the trainer's state. `demos` (every rank the same): `algorithm.ptx_coef`'s
        demonstrations, shared out over the updates."""
        started = time.perf_counter()
        done, per_step = self._updates_done(), self.cfg.trainer.updates_per_step
        if done != (step - 1) * per_step:
            raise ValueError(
                f"train_step(step={step}): the trainer has taken {done} optimiser steps, expected "
                f"{(step - 1) * per_step}; load its state_dict when resuming"
            )
        if not groups or not all(groups):
            raise ValueError(
                f"train_step: groups must be non-empty lists of samples, got sizes {[len(g) for g in groups]}"
            )
        if (demos is not None) != (self.cfg.algorithm.ptx_coef > 0):
            raise ValueError(
                f"train_step: demos are trained on when and only when algorithm.ptx_coef > 0 "
                f"(it is {self.cfg.algorithm.ptx_coef}, demos {'given' if demos is not None else 'not given'})"
            )
        batch = self._prepare(groups, step)
        batch.demos = demos or []
        grad_norms, lrs = self._update(batch)
        totals = dict(
            zip(
                STAT_KEYS,
                self._all_reduce(
                    torch.tensor([batch.stats[k] for k in STAT_KEYS], dtype=torch.float64, device=self.device)
                ).tolist(),
            )
        )
        metrics = self._metrics(
            totals, batch.samples, batch.raw_rewards, grad_norms, time.perf_counter() - started, batch.ref is not None
        )
        metrics["train/lr"] = lrs[-1]
        if batch.values is not None:
            updates = max(len(batch.minis), 1)
            metrics.update(
                batch.critic_metrics,
                **{
                    "critic/value_loss": totals["loss/value"] / updates,
                    "critic/clip_frac": totals["value_clip"] / max(totals["tokens"], 1.0),
                },
            )
        return metrics

    def _prepare(self, groups: list[list[Sample]], step: int) -> "_Batch":
        """Everything the updates need before the first one: this rank's shares, old and reference
        log-probs (and the mismatch they show), KL in the reward, advantages."""
        algo, tc = self.cfg.algorithm, self.cfg.trainer
        samples = [s for g in groups for s in g]
        check_samples(samples)
        rewards = torch.tensor([s.reward_value(self.cfg.rollout.reward_key) for s in samples], dtype=torch.float32)
        lengths = [len(s.tokens) for s in samples]
        minis = split_minibatches(len(samples), tc.updates_per_step)
        shares = [[mini[i] for i in shard([lengths[j] for j in mini], self.dp_size)[self.dp_rank]] for mini in minis]
        mine = [i for share in shares for i in share]
        stats = dict.fromkeys(STAT_KEYS, 0.0)
        # Made by the weights this step starts from (async mode also trains on older ones): their
        # mismatch is the engine's numerics alone, the rest's includes the policy's drift.
        fresh = [float(group_version([s]) >= step - 1) for s in samples]

        old = {i: self._rollout_logprobs(samples[i]) for i in mine}
        if algo.recompute_old_logprobs:
            recomputed = dict(zip(mine, self.logprobs([samples[i] for i in mine])))
            rows = [samples[i] for i in mine]
            measured = mismatch(
                self._pad([recomputed[i] for i in mine]),
                self._pad([self._rollout_logprobs(s) for s in rows]),
                self._pad([self._mask(s) for s in rows]),
                [fresh[i] for i in mine],
            )
            for key, value in measured.items():
                stats[key] += float(value)
            old = recomputed
        ref = None
        if algo.kl_coef > 0:
            if self.ref is None:  # the initial policy: the one this first RL step starts from
                self.ref = self._frozen_copy()
            ref = dict(zip(mine, self.logprobs([samples[i] for i in mine], self.ref)))
        raw_rewards = rewards
        critic: dict[str, Any] = {}
        if algo.advantage == "gae":
            advantages, critic = self._gae(samples, mine, old, ref, rewards, step)
            trajectory = list(range(len(samples)))
        else:
            if algo.kl_in_reward and ref is not None:
                kl = torch.zeros(len(samples))
                for i in mine:
                    # the full loss mask even when excluded from the loss: the reward it adds to its
                    # group's baseline is the one it would have if trained on
                    kl[i] = sequence_kl(old[i], ref[i], self._mask(samples[i], trained=False), algo.kl_estimator)
                rewards = rewards - algo.kl_coef * self._all_reduce(kl.to(self.device)).cpu()
            trajectory, group = trajectory_index(groups)
            advantages = trajectory_advantages(
                self.advantage_fn or algo.advantage,
                rewards,
                torch.tensor(trajectory),
                torch.tensor(group),
                torch.tensor(self._credit(samples, trajectory)),
                algo.advantage_eps,
            )
        teacher = None
        if algo.opd.coef > 0:
            teacher = {i: self._teacher_logprobs(samples[i]) for i in mine}
            if not algo.opd.task_reward:  # pure distillation: the teacher's signal alone
                advantages = torch.zeros_like(advantages)
        return _Batch(
            samples, minis, shares, trajectory, fresh, old, ref, teacher, advantages, raw_rewards, stats, **critic
        )

    def _gae(
        self,
        samples: list[Sample],
        mine: list[int],
        old: dict[int, Tensor],
        ref: dict[int, Tensor] | None,
        rewards: Tensor,
        step: int,
    ) -> tuple[Tensor, dict[str, Any]]:
        """PPO with a critic: the critic's values of every sample (each rank computes its own
        and an all-reduce gathers them), the outcome reward on each sample's last trained token
        (minus kl_coef x per-token KL with kl_in_reward), GAE, and advantages whitened over the
        batch's trained tokens; with the `_Batch` fields the critic's update needs. Trajectories
        and segment credit do not apply: each sample is its own episode."""
        algo = self.cfg.algorithm
        width = max(s.response_length for s in samples)
        values = torch.zeros(len(samples), width, device=self.device)
        token_rewards = torch.zeros(len(samples), width, device=self.device)
        for i, v in zip(mine, self._values([samples[i] for i in mine])):
            values[i, : len(v)] = v
            if algo.kl_in_reward and ref is not None:
                kl = kl_penalty(old[i], ref[i], algo.kl_estimator) * self._mask(samples[i], trained=False)
                token_rewards[i, : len(kl)] = -algo.kl_coef * kl
        values, token_rewards = self._all_reduce(values), self._all_reduce(token_rewards)
        mask = torch.zeros(len(samples), width, device=self.device)
        for i, s in enumerate(samples):
            mask[i, : s.response_length] = self._mask(s)
            trained = mask[i].nonzero()
            if len(trained):
                token_rewards[i, int(trained[-1])] += float(rewards[i])
        advantages, returns = gae_advantages(token_rewards, values, mask, algo.gamma, algo.lam)
        advantages = masked_whiten(advantages, mask, algo.advantage_eps)
        n = mask.sum().clamp(min=1)
        metrics = {
            "critic/values": float((values * mask).sum() / n),
            "critic/returns": float((returns * mask).sum() / n),
            "critic/explained_variance": explained_variance(values, returns, mask),
        }
        return advantages.cpu(), {
            "values": values.cpu(),
            "returns": returns.cpu(),
            "critic_only": step <= self.cfg.critic.warmup_steps,
            "critic_metrics": metrics,
        }

    def _update(self, b: "_Batch") -> tuple[list[float], list[float]]:
        """The optimiser steps, one per minibatch; the grad norms and learning rates they used.
        Loss statistics accumulate into `b.stats`. With a critic, it takes a step on each
        minibatch too (its grad norms go to `b.critic_metrics`); during `critic.warmup_steps` only
        it does, and the policy's schedule advances as if it had stepped, so that the optimiser
        step count stays (RL step - 1) x updates_per_step, which `_train_step` checks."""
        algo, samples, trajectory = self.cfg.algorithm, b.samples, b.trajectory
        grad_norms: list[float] = []
        lrs: list[float] = []
        critic_norms: list[float] = []
        demo_minis = split_minibatches(len(b.demos), len(b.minis)) if b.demos else [[] for _ in b.minis]
        for u, (mini, share) in enumerate(zip(b.minis, b.shares)):
            n_tokens = sum(sum(samples[i].train_mask) for i in mini)
            lrs.append(self._lr())
            if n_tokens and b.values is not None:
                critic_norms.append(self._critic_update(b, share, n_tokens))
            if not n_tokens or b.critic_only:  # nothing to learn from: no step (Adam would still apply momentum)
                self._scheduler_step()
                continue
            normalizer = loss_normalizer(
                algo.loss_reduction,
                n_tokens=n_tokens,
                n_samples=len(mini),
                max_response_len=self.cfg.rollout.max_new_tokens,
                n_trajectories=len({trajectory[i] for i in mini}),
            )
            pooled: dict[int, int] = {}  # a trajectory's trained tokens in this update, for the trajectory reduction
            for i in mini:
                pooled[trajectory[i]] = pooled.get(trajectory[i], 0) + sum(samples[i].train_mask)
            measure = u == 0 and not algo.recompute_old_logprobs  # weights still the rollout's

            def loss_fn(idx: list[int], logprobs: Tensor, entropy: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
                batch = [samples[i] for i in idx]
                advantages = b.advantages[idx]
                if advantages.dim() == 2:  # per token: the batch's width to this micro-batch's
                    advantages = advantages[:, : logprobs.shape[1]]
                advantages = advantages.to(self.device)
                rollout = self._pad([self._rollout_logprobs(s) for s in batch])
                mask = self._pad([self._mask(s) for s in batch])
                old = self._pad([b.old[i] for i in idx])
                if b.teacher is not None:  # on-policy distillation: per-token advantages
                    log_ratio = teacher_log_ratio(old, self._pad([b.teacher[i] for i in idx]), mask)
                    advantages = opd_advantages(advantages, log_ratio, algo.opd.coef)
                loss, st = rl_loss(
                    algo,
                    logprobs,
                    old,
                    advantages,
                    mask,
                    normalizer,
                    ref_logprobs=self._pad([b.ref[i] for i in idx]) if b.ref is not None else None,
                    rollout_logprobs=rollout,
                    entropy=entropy,
                    trajectory_tokens=torch.tensor([pooled[trajectory[i]] for i in idx], device=self.device),
                    policy_loss_fn=self.policy_loss_fn,
                )
                if measure:
                    st.update(mismatch(logprobs.detach(), rollout, mask, [b.fresh[i] for i in idx]))
                if b.teacher is not None:
                    st["teacher_kl"] = (log_ratio * mask).sum()
                return loss, st

            entropy = True if algo.entropy_coef > 0 else None  # else measured without gradient
            for key, value in self._accumulate([samples[i] for i in share], share, loss_fn, entropy).items():
                b.stats[key] += value
            if demo_minis[u]:
                b.stats["loss/ptx"] += self._nll([b.demos[i] for i in demo_minis[u]], algo.ptx_coef).get("nll", 0.0)
            grad_norms.append(self._optimizer_step(self.optimizer))
            self._scheduler_step()
        if critic_norms:
            b.critic_metrics["critic/grad_norm"] = sum(critic_norms) / len(critic_norms)
        return grad_norms, lrs

    def _critic_update(self, b: "_Batch", share: list[int], n_tokens: int) -> float:
        """One critic optimiser step on a minibatch (this rank's `share`, `n_tokens` trained tokens
        in all): the clipped value loss against `b.returns`; its grad norm."""
        assert b.values is not None and b.returns is not None

        def loss_fn(idx: list[int], values: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            mask = self._pad([self._mask(b.samples[i]) for i in idx])
            width = values.shape[1]
            return value_loss(
                values,
                b.values[idx, :width].to(self.device),
                b.returns[idx, :width].to(self.device),
                mask,
                self.cfg.critic.value_clip,
                float(n_tokens),
            )

        for key, value in self._accumulate_values([b.samples[i] for i in share], share, loss_fn).items():
            b.stats[key] += value
        return self._critic_step()

    def _credit(self, samples: list[Sample], trajectory: list[int]) -> list[float]:
        """Each sample's share of its trajectory's advantage (`algorithm.segment_credit`)."""
        if self.credit_fn is None:
            return credit_weights(self.cfg.algorithm.segment_credit, trajectory)
        weights = [0.0] * len(samples)
        members: dict[int, list[int]] = {}
        for i, t in enumerate(trajectory):
            members.setdefault(t, []).append(i)
        for idx in members.values():
            shares = self.credit_fn([samples[i] for i in idx])
            if len(shares) != len(idx):
                raise ValueError(
                    f"algorithm.segment_credit {self.cfg.algorithm.segment_credit}: returned {len(shares)} shares for a trajectory of {len(idx)} samples"
                )
            for i, share in zip(idx, shares):
                weights[i] = float(share)
        return weights

    def _metrics(
        self,
        t: dict[str, float],
        samples: list[Sample],
        rewards: Tensor,
        grad_norms: list[float],
        seconds: float,
        with_ref: bool,
    ) -> dict[str, float]:
        updates = max(len(grad_norms), 1)
        tokens = max(t["tokens"], 1.0)
        out = {
            "train/loss": (t["loss/policy"] + t["loss/kl"] + t["loss/entropy"] + t["loss/ptx"]) / updates,
            "train/policy_loss": t["loss/policy"] / updates,
            "train/entropy": t["entropy"] / tokens,
            "train/clip_frac": (t["clip_low"] + t["clip_high"]) / tokens,
            "train/clip_low": t["clip_low"] / tokens,
            "train/clip_high": t["clip_high"] / tokens,
            "train/ratio": t["ratio"] / tokens,
            "train/grad_norm": sum(grad_norms) / updates,  # over the updates that had tokens
            "train/tokens_per_s": sum(len(s.tokens) for s in samples) / seconds,
            "response/length": sum(s.response_length for s in samples) / len(samples),
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "time/train": seconds,
        }
        if t["mismatch_tokens"]:
            out["train/mismatch"] = t["mismatch"] / t["mismatch_tokens"]
        if t["mismatch_fresh_tokens"]:  # tokens of the weights this step started from
            out["train/mismatch_fresh"] = t["mismatch_fresh"] / t["mismatch_fresh_tokens"]
        stale_tokens = t["mismatch_tokens"] - t["mismatch_fresh_tokens"]
        if stale_tokens:  # async: tokens of older weights
            out["train/mismatch_stale"] = (t["mismatch"] - t["mismatch_fresh"]) / stale_tokens
        if with_ref:
            out["train/kl"] = t["kl"] / tokens
        if self.cfg.algorithm.ptx_coef > 0:  # ptx_coef x the demonstrations' NLL per token
            out["train/ptx_loss"] = t["loss/ptx"] / updates
        if self.cfg.algorithm.opd.coef > 0:  # mean over trained tokens of log pi_old - log pi_teacher
            out["train/teacher_kl"] = t["teacher_kl"] / tokens
        if self.cfg.algorithm.dual_clip_c is not None:
            out["train/dual_clip_frac"] = t["dual_clip"] / tokens
        if self.cfg.algorithm.tis_cap is not None:
            out["train/tis"] = t["tis"] / tokens
        return out

    # -- SFT ---------------------------------------------------------------------------------

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        with self._threads():
            return self._sft_step(samples)

    def _sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised step on the full batch (every rank passes the same): token-mean NLL of
        the loss-mask-1 tokens, with its own AdamW at `sft.lr` so RL starts with a fresh one."""
        check_samples(samples)
        if self.sft_optimizer is None:
            self.sft_optimizer = self._new_optimizer(self.cfg.sft.lr)
        if not any(any(s.train_mask) for s in samples):
            raise ValueError("sft_step: the batch has no loss-mask-1 token to train on")
        stats = self._nll(samples, 1.0)
        grad_norm = self._optimizer_step(self.sft_optimizer)
        loss, tokens = self._all_reduce(
            torch.tensor([stats.get("nll", 0.0), stats.get("tokens", 0.0)], dtype=torch.float64, device=self.device)
        ).tolist()
        return {"sft/loss": loss, "sft/grad_norm": grad_norm, "sft/tokens": tokens}

    def _nll(self, samples: list[Sample], coef: float) -> dict[str, float]:
        """Adds the gradient of coef x the token-mean NLL of `samples`' trained tokens (every rank
        passes the same samples and trains its share); this rank's parts of that term (`nll`) and
        of the token count."""
        normalizer = float(sum(sum(s.train_mask) for s in samples))
        share = shard([len(s.tokens) for s in samples], self.dp_size)[self.dp_rank]

        def loss_fn(idx: list[int], logprobs: Tensor, _: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
            mask = self._pad([self._mask(samples[i]) for i in idx])
            loss = coef * sft_loss(logprobs, mask, normalizer)
            return loss, {"nll": loss.detach(), "tokens": mask.sum()}

        return self._accumulate([samples[i] for i in share], share, loss_fn, entropy=False)

    # -- micro-batches and tensors of samples --------------------------------------------------

    def _micro_groups(self, batch: list[Sample]) -> list[list[int]]:
        """`batch` positions in micro-batches, samples without response tokens left out."""
        budget = self.cfg.trainer.micro_batch_tokens
        groups = [
            [k for k in mb if batch[k].response_length > 0]
            for mb in micro_batches([len(s.tokens) for s in batch], budget)
        ]
        return [g for g in groups if g]

    def _input_ids(self, batch: list[Sample]) -> Tensor:
        """`[B, longest]` token ids, right-padded with the pad id, on the device."""
        ids = torch.full((len(batch), max(len(s.tokens) for s in batch)), self.pad_id, dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, : len(s.tokens)] = torch.tensor(s.tokens)
        return ids.to(self.device)

    def _rollout_logprobs(self, s: Sample) -> Tensor:
        return torch.tensor(s.rollout_logprobs, dtype=torch.float32, device=self.device)

    def _teacher_logprobs(self, s: Sample) -> Tensor:
        if s.teacher_logprobs is None:
            raise ValueError(
                f"sample {s.group_id}/{s.index}: no teacher_logprobs; algorithm.opd.coef > 0 needs every trained sample "
                "scored by the teacher (launch.teacher), which the rollout manager does"
            )
        return torch.tensor(s.teacher_logprobs, dtype=torch.float32, device=self.device)

    def _mask(self, s: Sample, trained: bool = True) -> Tensor:
        """The tokens trained on (`Sample.train_mask`: none when `exclude_from_loss`), or with
        `trained=False` the tokens the policy made (`loss_mask`)."""
        return torch.tensor(s.train_mask if trained else s.loss_mask, dtype=torch.float32, device=self.device)

    def _pad(self, rows: list[Tensor]) -> Tensor:
        return pad_sequence(rows, batch_first=True)

    # -- what a backend implements ---------------------------------------------------------------

    @abstractmethod
    def logprobs(self, samples: list[Sample], model: Any = None) -> list[Tensor]:
        """Per-sample logprobs of the response tokens under `model` (default: the policy), at the
        rollout temperature, as the engine reports them."""

    @abstractmethod
    def _accumulate(
        self, batch: list[Sample], idx: list[int], loss_fn: LossFn, entropy: bool | None
    ) -> dict[str, float]:
        """Backward of this rank's share `batch` (`idx`: the samples' batch indices, which
        `loss_fn` takes) in `_micro_groups`; the summed stats. Afterwards every rank holds the
        gradient of the whole batch's loss: each data-parallel rank must take part, even with
        nothing to train on. `entropy`: with gradient (True), measured (None) or not (False)."""

    def _values(self, samples: list[Sample]) -> list[Tensor]:
        """Per-sample critic values `[R]` of the states before each response token (no gradient)."""
        raise NotImplementedError(f"algorithm.advantage=gae: {type(self).__name__} has no critic")

    def _accumulate_values(
        self,
        batch: list[Sample],
        idx: list[int],
        loss_fn: Callable[[list[int], Tensor], tuple[Tensor, dict[str, Tensor]]],
    ) -> dict[str, float]:
        """`_accumulate` for the critic: `loss_fn` takes the batch indices and values `[B, R]`."""
        raise NotImplementedError(f"algorithm.advantage=gae: {type(self).__name__} has no critic")

    def _critic_step(self) -> float:
        """The critic's optimiser step (clipped to `trainer.grad_clip`); its grad norm."""
        raise NotImplementedError(f"algorithm.advantage=gae: {type(self).__name__} has no critic")

    @abstractmethod
    def _optimizer_step(self, optimizer: Any) -> float:
        """Clip to `trainer.grad_clip` (0: no clipping), step, zero the grads; the global grad norm."""

    @abstractmethod
    def _new_optimizer(self, lr: float) -> Any:
        """An optimiser over the policy at a constant `lr` (the SFT warm start's)."""

    @abstractmethod
    def _all_reduce(self, t: Tensor) -> Tensor:
        """Sum over data-parallel ranks, in place; every rank gets the result."""

    @abstractmethod
    def _frozen_copy(self) -> Any:
        """A frozen model holding the policy's current weights (the KL reference)."""

    @abstractmethod
    def _updates_done(self) -> int:
        """RL optimiser steps taken (the schedule's position)."""

    @abstractmethod
    def _lr(self) -> float:
        """The learning rate of the next RL optimiser step."""

    @abstractmethod
    def _scheduler_step(self) -> None:
        """Advance the RL learning-rate schedule by one optimiser step."""

    @abstractmethod
    def hf_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) of every parameter, a tied one once: what the engines' weight
        loaders take. Complete on rank 0; other ranks may yield nothing (but must iterate)."""

    def adapter_tensors(self) -> dict[str, Tensor]:
        """trainer.lora: the adapter's tensors under their PEFT state-dict names (what is pushed)."""
        raise NotImplementedError(f"trainer.lora: {type(self).__name__} has no adapters")

    def adapter_config(self) -> dict[str, Any]:
        """trainer.lora: the adapter's `adapter_config.json` (what the engines load it with)."""
        raise NotImplementedError(f"trainer.lora: {type(self).__name__} has no adapters")

    def join_export(self) -> None:
        """A follower rank's part of an export (weight push or HF save): run the collectives
        `hf_tensors` takes part in, keeping none of the tensors (rank 0 has them all)."""
        for _ in self.hf_tensors():
            pass

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model, optimiser and schedule (and a copied reference): what a resume needs."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned on rank 0 (every rank is given it)."""

    @abstractmethod
    def save_hf(self, path: str) -> None:
        """An HF model directory (weights, config, tokenizer) that `from_pretrained` loads; rank 0 writes it."""


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
