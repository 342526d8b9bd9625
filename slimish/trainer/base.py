"""The RL and SFT steps every trainer backend shares: from samples to metrics.

A step's logic does not depend on how the model is run: advantages and the loss normaliser are
computed on the whole batch (every rank is handed the same full batch), then each data-parallel
rank trains on its share (batch.py). Each micro-batch's loss is its share of the global batch's
loss (losses.py), so any split, over ranks or micro-batches, gives the gradient of the full batch.
The backends supply the forward and backward of those micro-batches, the optimiser step, the
reduction over data-parallel ranks and the model state: `Backend` (backend.py) lists them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from slimish.buffer import group_version
from slimish.plugins import load_function
from slimish.processes import usable_cpus
from slimish.trainer.advantages import (
    explained_variance,
    gae_advantages,
    masked_whiten,
    segment_credit,
    trajectory_advantages,
)
from slimish.trainer.backend import Backend
from slimish.trainer.batch import (
    STAT_KEYS,
    Batch,
    check_exact,
    check_samples,
    mismatch,
    shard,
    split_minibatches,
    trajectory_index,
)
from slimish.trainer.losses import (
    kl_penalty,
    loss_normalizer,
    opd_advantages,
    rl_loss,
    sequence_kl,
    sft_loss,
    teacher_log_ratio,
    value_loss,
)
from slimish.trainer.policies import train_policies
from slimish.trainer.routing import check_replayable, route_metrics
from slimish.types import Sample

if TYPE_CHECKING:
    from slimish.config import RunConfig


class Trainer(Backend):
    """The RL and SFT steps of every backend, on the methods `Backend` declares. `train_step` and
    `sft_step` are called on every rank."""

    credit_fn: Callable[..., list[float]] | None  # algorithm.segment_credit as a function
    advantage_fn: Callable[[Tensor, Tensor], Tensor] | None  # algorithm.advantage as a function
    policy_loss_fn: Callable[..., Tensor] | None  # algorithm.loss as a function
    # Called before each optimiser step of the policy: an async colocated run's engines read the
    # weights it writes, and pause for it (slimish/trainer/colocated.py `hold`).
    before_weight_write: Callable[[], None] | None = None

    def _setup(self, cfg: RunConfig, tokenizer: Any, local_ranks: int) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0  # greedy: T = 1
        self.sft_optimizer = None
        engines_idle = not cfg.async_training  # while this trains
        # usable CPUs: launch.cpu_placement may have pinned this rank to some (slimish/launch/cpus.py)
        cores = max(1, len(usable_cpus()) // local_ranks) if engines_idle else torch.get_num_threads()
        self.cpu_threads = cfg.trainer.cpu_threads or cores
        if cfg.algorithm.true_on_policy:  # batch-invariant kernels: a row is never split between threads
            self.cpu_threads = 1
        credit, advantage, loss = cfg.algorithm.segment_credit, cfg.algorithm.advantage, cfg.algorithm.loss
        # the user's functions, loaded and checked now, not at the first step
        self.credit_fn = load_function(credit, "credit") if ":" in credit else None
        self.advantage_fn = load_function(advantage, "advantage") if ":" in advantage else None
        self.policy_loss_fn = load_function(loss, "policy_loss") if ":" in loss else None

    # -- RL ----------------------------------------------------------------------------------

    def train_step(self, groups: list[list[Sample]], step: int, demos: list[Sample] | None = None) -> dict[str, float]:
        with self._threads():
            if self.cfg.policies:  # several policies: each its own step on its share (policies.py)
                return train_policies(self, groups, step)
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
        if self.routes is not None:
            for key, value in self.routes.counts.items():
                batch.stats[key] += value
            self.routes.recorded.clear()  # R2's routes, by id(sample): a sample freed after the step frees its id
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
        if self.routes is not None:
            metrics.update(route_metrics(totals, self._all_reduce(self.routes.load.to(self.device)).cpu()))
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

    def _prepare(self, groups: list[list[Sample]], step: int) -> Batch:
        """Everything the updates need before the first one: this rank's shares, old and reference
        log-probs (and the mismatch they show), KL in the reward, advantages."""
        algo, tc = self.cfg.algorithm, self.cfg.trainer
        samples = [s for g in groups for s in g]
        check_samples(samples)
        if algo.routing_replay == "r3":
            check_replayable(samples)
        if self.routes is not None:
            self.routes.reset()
        rewards = torch.tensor([s.reward_value(self.cfg.rollout.reward_key) for s in samples], dtype=torch.float32)
        lengths = [len(s.tokens) for s in samples]
        minis = split_minibatches(len(samples), tc.updates_per_step)
        shares = [[mini[i] for i in shard([lengths[j] for j in mini], self.dp_size)[self.dp_rank]] for mini in minis]
        mine = [i for share in shares for i in share]
        stats = dict.fromkeys(STAT_KEYS, 0.0)
        # Made by the weights this step starts from (async mode also trains on older ones): their
        # mismatch is the engine's numerics alone, the rest's includes the policy's drift.
        fresh = [float(group_version([s]) >= step - 1) for s in samples]

        old, apart = self._old_logprobs(samples, mine, len(minis), fresh, stats)
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
                torch.tensor(segment_credit(algo.segment_credit, self.credit_fn, samples, trajectory)),
                algo.advantage_eps,
            )
        teacher = None
        if algo.opd.coef > 0:
            teacher = {i: self._teacher_logprobs(samples[i]) for i in mine}
            if not algo.opd.task_reward:  # pure distillation: the teacher's signal alone
                advantages = torch.zeros_like(advantages)
        parts = (samples, minis, shares, trajectory, fresh, old, ref, teacher, advantages, raw_rewards, stats, apart)
        return Batch(*parts, **critic)

    def _old_logprobs(
        self, samples: list[Sample], mine: list[int], updates: int, fresh: list[float], stats: dict[str, float]
    ) -> tuple[dict[int, Tensor | None], bool]:
        """pi_old of this rank's samples: the engine's log-probs, or the trainer's own for every
        sample with recompute_old_logprobs and for those drawn from a reshaped distribution
        (`Sample.reshaped`). The trainer's are the first update's forward where
        `_old_from_first_update` allows (None here), else a pass of their own, which measures the
        mismatch into `stats`; and whether that pass ran."""
        algo = self.cfg.algorithm
        old: dict[int, Tensor | None] = {i: self._rollout_logprobs(samples[i]) for i in mine}
        own = [i for i in mine if algo.recompute_old_logprobs or samples[i].reshaped]
        if self._old_from_first_update(updates):
            return {**old, **dict.fromkeys(own)}, False
        if not algo.recompute_old_logprobs and not self._all_reduce(
            torch.tensor([float(len(own))], device=self.device)
        ):
            return old, False
        # every rank runs the pass (expert parallelism's all-to-all needs them all in a forward)
        with self._route_pass(measure=True, record=algo.routing_replay == "r2"):
            recomputed = dict(zip(mine, self.logprobs([samples[i] for i in mine])))
        ours, theirs, mask = (
            self._pad([recomputed[i] for i in mine]),
            self._pad([old[i] for i in mine]),  # the engine's, as yet
            self._pad([self._mask(samples[i]) for i in mine]),
        )
        measured = mismatch(ours, theirs, mask, [fresh[i] for i in mine])
        if algo.true_on_policy:
            check_exact(ours, theirs, mask)
        for key, value in measured.items():
            stats[key] += float(value)
        return {**old, **{i: recomputed[i] for i in own}}, True

    def _old_from_first_update(self, updates: int) -> bool:
        """Whether pi_old, where the trainer's, can be the first update's own log-probs (detached):
        the same weights and tokens as a separate pass, so the same values, one forward fewer
        (TRL's GRPO with one iteration does the same). Only with one update per step, and where
        nothing reads pi_old before the loss: the KL in the reward, GAE's, R2's recorded routes."""
        algo = self.cfg.algorithm
        return (
            updates == 1
            and algo.advantage != "gae"
            and not (algo.kl_in_reward and algo.kl_coef > 0)
            and algo.routing_replay != "r2"
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
        batch's trained tokens; with the `Batch` fields the critic's update needs. Trajectories
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

    def _update(self, b: Batch) -> tuple[list[float], list[float]]:
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
            measure = u == 0 and not b.old_apart  # weights still the rollout's

            def loss_fn(idx: list[int], logprobs: Tensor, entropy: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
                batch = [samples[i] for i in idx]
                advantages = b.advantages[idx]
                if advantages.dim() == 2:  # per token: the batch's width to this micro-batch's
                    advantages = advantages[:, : logprobs.shape[1]]
                advantages = advantages.to(self.device)
                rollout = self._pad([self._rollout_logprobs(s) for s in batch])
                mask = self._pad([self._mask(s) for s in batch])
                # None: pi_old is this forward's (`_old_from_first_update`), ratio 1 in value
                old = self._pad(
                    [logprobs[row].detach().float() if b.old[i] is None else b.old[i] for row, i in enumerate(idx)]
                )
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
                    if algo.true_on_policy:
                        check_exact(logprobs, rollout, mask)
                if b.teacher is not None:
                    st["teacher_kl"] = (log_ratio * mask).sum()
                return loss, st

            entropy = True if algo.entropy_coef > 0 else None  # else measured without gradient
            with self._route_pass(measure=measure):
                stats = self._accumulate([samples[i] for i in share], share, loss_fn, entropy)
            for key, value in stats.items():
                b.stats[key] += value
            if demo_minis[u]:
                b.stats["loss/ptx"] += self._nll([b.demos[i] for i in demo_minis[u]], algo.ptx_coef).get("nll", 0.0)
            grad_norms.append(self._policy_step(self.optimizer))
            self._scheduler_step()
        if critic_norms:
            b.critic_metrics["critic/grad_norm"] = sum(critic_norms) / len(critic_norms)
        return grad_norms, lrs

    def _policy_step(self, optimizer: Any) -> float:
        """`_optimizer_step` on the policy's weights, announced first (`before_weight_write`)."""
        if self.before_weight_write is not None:
            self.before_weight_write()
        return self._optimizer_step(optimizer)

    @contextmanager
    def _route_pass(self, measure: bool, record: bool = False) -> Iterator[None]:
        """What the forwards inside do with a MoE model's routes (routing.py `RouteState`): count
        the routing statistics (the one pass at the rollout's weights, as the mismatch), record the
        own routes (R2's old-logprob pass)."""
        if self.routes is None:
            yield
            return
        self.routes.measure, self.routes.record = measure, record
        try:
            yield
        finally:
            self.routes.measure = self.routes.record = False

    def _critic_update(self, b: Batch, share: list[int], n_tokens: int) -> float:
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
        if t["mismatch_seqs"]:  # the mean over sequences of each one's largest |trainer - engine logprob|
            out["train/mismatch_seq_max"] = t["mismatch_seq_max"] / t["mismatch_seqs"]
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
        grad_norm = self._policy_step(self.sft_optimizer)
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
