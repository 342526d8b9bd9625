"""The plain-PyTorch trainer: an HF causal LM under DDP (gloo on CPU, NCCL on GPU).

Every rank is handed the same full batch. Advantages and the loss normaliser are computed on the
whole batch, then each rank trains on its share, balanced by tokens, in micro-batches of at most
`trainer.micro_batch_tokens` padded tokens. Each micro-batch's loss is its share of the global
batch's loss (algorithms.py), scaled by the world size because DDP averages gradients: so any
split, over ranks or micro-batches, gives the gradient of the full batch.

Micro-batches are right-padded rows, not one packed row: real tokens come before the padding, so
a causal model computes them exactly as it would unpadded, with no attention mask, and attention
stays quadratic in each sample's length instead of in the micro-batch's (on a CPU the packed
row's dense block mask made attention the dominant cost).

No dropout anywhere (the model stays in eval mode): the logprobs the loss uses must be those of
the policy the engines sample from.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimish.config import RunConfig
from slimish.trainer.algorithms import (
    compute_advantages,
    entropy_from_logits,
    logprobs_from_logits,
    loss_normalizer,
    rl_loss,
    sequence_kl,
    sft_loss,
)
from slimish.types import Sample

# Additive statistics summed over micro-batches, updates and ranks (rl_loss's, plus ours).
STAT_KEYS = ("loss/policy", "loss/kl", "loss/entropy", "tokens", "clip_low", "clip_high", "dual_clip",
             "ratio", "tis", "kl", "entropy", "mismatch", "mismatch_tokens")  # fmt: skip


# -- pure helpers ---------------------------------------------------------------------------------


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
            raise ValueError(f"sample {s.group_id}/{s.index}: needs at least one prompt token, got tokens of length {len(s.tokens)}")


# -- the trainer ----------------------------------------------------------------------------------


class TorchTrainer:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        tc = cfg.trainer
        distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        if torch.cuda.is_available():  # one GPU per torchrun rank on its node
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.dtype = getattr(torch, tc.dtype) if tc.dtype else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model = self._load(cfg.model)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # forward_sync_buffers=False: DDP's forward then runs no collective, so ranks may run
        # different numbers of forwards (micro-batches, no-grad passes).
        self.ddp = DDP(self.model, forward_sync_buffers=False) if self.world > 1 else None
        self.optimizer = self._adamw(tc.lr)
        total = cfg.steps * tc.updates_per_step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(tc.lr_schedule, tc.warmup_steps, total, step)
        )
        self.sft_optimizer: torch.optim.Optimizer | None = None
        self.ref: torch.nn.Module | None = self._load(tc.ref_model, frozen=True) if tc.ref_model else None
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0  # greedy: T = 1
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.cpu_threads = tc.cpu_threads or max(1, (os.cpu_count() or 1) // local_ranks)

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

    def _load(self, path: str, frozen: bool = False) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device)
        model.eval()
        if frozen:
            model.requires_grad_(False)
        return model

    def _frozen_copy(self, state: dict[str, Tensor] | None = None) -> torch.nn.Module:
        """A frozen model holding `state` (default: the policy's current weights)."""
        ref = self._load(self.cfg.model, frozen=True)
        ref.load_state_dict(self.model.state_dict() if state is None else state)
        return ref

    def _adamw(self, lr: float) -> torch.optim.Optimizer:
        tc = self.cfg.trainer
        return torch.optim.AdamW(self.model.parameters(), lr=lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)

    # -- RL ----------------------------------------------------------------------------------

    def train_step(self, groups: list[list[Sample]], step: int) -> dict[str, float]:
        with self._threads():
            return self._train_step(groups, step)

    def _train_step(self, groups: list[list[Sample]], step: int) -> dict[str, float]:
        """One rollout batch: `trainer.updates_per_step` optimiser steps. `step` is the RL step
        (1-based); it must follow the optimiser's history, which catches a resume that did not
        restore the trainer's state."""
        started = time.perf_counter()
        algo, tc = self.cfg.algorithm, self.cfg.trainer
        done = self.scheduler.last_epoch
        if done != (step - 1) * tc.updates_per_step:
            raise ValueError(f"train_step(step={step}): the trainer has taken {done} optimiser steps, expected "
                             f"{(step - 1) * tc.updates_per_step}; load its state_dict when resuming")  # fmt: skip
        if not groups or not all(groups):
            raise ValueError(f"train_step: groups must be non-empty lists of samples, got sizes {[len(g) for g in groups]}")
        samples = [s for g in groups for s in g]
        check_samples(samples)
        rewards = torch.tensor([s.reward_value(self.cfg.rollout.reward_key) for s in samples], dtype=torch.float32)
        lengths = [len(s.tokens) for s in samples]
        minis = split_minibatches(len(samples), tc.updates_per_step)
        shares = [[mini[i] for i in shard([lengths[j] for j in mini], self.world)[self.rank]] for mini in minis]
        mine = [i for share in shares for i in share]
        stats = dict.fromkeys(STAT_KEYS, 0.0)

        old = {i: self._rollout_logprobs(samples[i]) for i in mine}
        if algo.recompute_old_logprobs:
            recomputed = dict(zip(mine, self.logprobs([samples[i] for i in mine])))
            self._add_mismatch(stats, [samples[i] for i in mine], [recomputed[i] for i in mine])
            old = recomputed
        ref = None
        if algo.kl_coef > 0:
            if self.ref is None:  # the initial policy: the one this first RL step starts from
                self.ref = self._frozen_copy()
            ref = dict(zip(mine, self.logprobs([samples[i] for i in mine], self.ref)))
        raw_rewards = rewards
        if algo.kl_in_reward and ref is not None:
            kl = torch.zeros(len(samples))
            for i in mine:
                kl[i] = sequence_kl(old[i], ref[i], self._mask(samples[i]), algo.kl_estimator)
            rewards = rewards - algo.kl_coef * self._all_reduce(kl.to(self.device)).cpu()
        advantages = self._advantages(groups, rewards)

        grad_norms: list[float] = []
        lrs: list[float] = []
        for u, (mini, share) in enumerate(zip(minis, shares)):
            n_tokens = sum(sum(samples[i].loss_mask) for i in mini)
            lrs.append(self.optimizer.param_groups[0]["lr"])
            if not n_tokens:  # nothing to learn from: no step (Adam would still apply momentum)
                self.scheduler.step()
                continue
            normalizer = loss_normalizer(
                algo.loss_reduction, n_tokens=n_tokens, n_samples=len(mini), max_response_len=self.cfg.rollout.max_new_tokens
            )
            measure = u == 0 and not algo.recompute_old_logprobs  # weights still the rollout's

            def loss_fn(idx: list[int], logprobs: Tensor, entropy: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
                batch = [samples[i] for i in idx]
                rollout = self._pad([self._rollout_logprobs(s) for s in batch])
                mask = self._pad([self._mask(s) for s in batch])
                loss, st = rl_loss(
                    algo, logprobs, self._pad([old[i] for i in idx]), advantages[idx].to(self.device), mask,
                    normalizer, ref_logprobs=self._pad([ref[i] for i in idx]) if ref is not None else None,
                    rollout_logprobs=rollout, entropy=entropy,
                )  # fmt: skip
                if measure:
                    st["mismatch"] = ((logprobs.detach() - rollout).abs() * mask).sum()
                    st["mismatch_tokens"] = mask.sum()
                return loss, st

            entropy = True if algo.entropy_coef > 0 else None  # else measured without gradient
            for key, value in self._accumulate([samples[i] for i in share], share, loss_fn, entropy).items():
                stats[key] += value
            grad_norms.append(self._optimizer_step(self.optimizer))
            self.scheduler.step()

        totals = dict(zip(STAT_KEYS, self._all_reduce(torch.tensor([stats[k] for k in STAT_KEYS], dtype=torch.float64,
                                                                    device=self.device)).tolist()))  # fmt: skip
        metrics = self._metrics(totals, samples, raw_rewards, grad_norms, time.perf_counter() - started, ref is not None)
        metrics["train/lr"] = lrs[-1]
        return metrics

    def _advantages(self, groups: list[list[Sample]], rewards: Tensor) -> Tensor:
        """One per sample. Equal-size groups go through in one call; ragged groups (a sample
        lost to a failure) per group, which only group-local estimators allow."""
        algo = self.cfg.algorithm
        sizes = [len(g) for g in groups]
        if len(set(sizes)) == 1:
            return compute_advantages(algo.advantage, rewards.view(len(groups), sizes[0]), eps=algo.advantage_eps).reshape(-1)
        if algo.advantage == "reinforce_pp":  # whitened over the whole batch: groups do not matter
            return compute_advantages(algo.advantage, rewards.view(1, -1), eps=algo.advantage_eps).reshape(-1)
        if algo.advantage == "reinforce_pp_baseline":
            raise ValueError(f"advantage reinforce_pp_baseline needs groups of equal size, got sizes {sizes}")
        parts = rewards.split(sizes)
        return torch.cat([compute_advantages(algo.advantage, p.view(1, -1), eps=algo.advantage_eps).reshape(-1) for p in parts])

    def _metrics(self, t: dict[str, float], samples: list[Sample], rewards: Tensor, grad_norms: list[float],
                 seconds: float, with_ref: bool) -> dict[str, float]:  # fmt: skip
        updates = max(len(grad_norms), 1)
        tokens = max(t["tokens"], 1.0)
        out = {
            "train/loss": (t["loss/policy"] + t["loss/kl"] + t["loss/entropy"]) / updates,
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
        if with_ref:
            out["train/kl"] = t["kl"] / tokens
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
            self.sft_optimizer = self._adamw(self.cfg.sft.lr)
        n_tokens = sum(sum(s.loss_mask) for s in samples)
        if not n_tokens:
            raise ValueError("sft_step: the batch has no loss-mask-1 token to train on")
        normalizer = float(n_tokens)
        share = shard([len(s.tokens) for s in samples], self.world)[self.rank]

        def loss_fn(idx: list[int], logprobs: Tensor, _: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            mask = self._pad([self._mask(samples[i]) for i in idx])
            loss = sft_loss(logprobs, mask, normalizer)
            return loss, {"loss/policy": loss.detach(), "tokens": mask.sum()}

        stats = self._accumulate([samples[i] for i in share], share, loss_fn, entropy=False)
        grad_norm = self._optimizer_step(self.sft_optimizer)
        loss, tokens = self._all_reduce(torch.tensor([stats.get("loss/policy", 0.0), stats.get("tokens", 0.0)],
                                                     dtype=torch.float64, device=self.device)).tolist()  # fmt: skip
        return {"sft/loss": loss, "sft/grad_norm": grad_norm, "sft/tokens": tokens}

    # -- forward, accumulation, optimiser ------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, samples: list[Sample], model: torch.nn.Module | None = None) -> list[Tensor]:
        """Per-sample logprobs of the response tokens under `model` (default: the policy), at the
        rollout temperature, as the engine reports them."""
        model = self.model if model is None else model
        out: list[Tensor | None] = [None] * len(samples)
        for idx in micro_batches([len(s.tokens) for s in samples], self.cfg.trainer.micro_batch_tokens):
            batch = [samples[i] for i in idx]
            logprobs, _ = self._forward(model, batch, entropy=False)
            for i, s, row in zip(idx, batch, logprobs):
                out[i] = row[: s.response_length].clone()
        return out  # type: ignore[return-value]

    def _forward(self, model: torch.nn.Module, batch: list[Sample], entropy: bool | None) -> tuple[Tensor, Tensor | None]:
        """Response-token logprobs `[B, R]` (right-padded) and, unless `entropy` is False, their
        entropies (with gradient only when `entropy` is True)."""
        length = max(len(s.tokens) for s in batch)
        ids = torch.full((len(batch), length), self.pad_id, dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, : len(s.tokens)] = torch.tensor(s.tokens)
        ids = ids.to(self.device)
        # Logits only from the first response position on: position p predicts token p + 1.
        keep = length - min(s.prompt_length for s in batch) + 1
        first = length - keep
        logits = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
        labels = torch.nn.functional.pad(ids[:, first + 1 :], (0, 1), value=self.pad_id)
        longest = max(s.response_length for s in batch)
        index = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, s in enumerate(batch):
            index[row, : s.response_length] = torch.arange(s.response_length) + (s.prompt_length - 1 - first)
        index = index.to(self.device)
        logprobs = logprobs_from_logits(logits, labels, self.temperature).gather(1, index)
        ent = None
        if entropy is not False:
            with nullcontext() if entropy else torch.no_grad():
                ent = entropy_from_logits(logits, self.temperature).gather(1, index)
        return logprobs, ent

    def _accumulate(
        self,
        batch: list[Sample],
        idx: list[int],
        loss_fn: Callable[[list[int], Tensor, Tensor | None], tuple[Tensor, dict[str, Tensor]]],
        entropy: bool | None,
    ) -> dict[str, float]:
        """Backward of this rank's share in micro-batches; DDP all-reduces on the last one only.
        A rank with nothing to train still runs one zero-loss backward: DDP needs every rank."""
        budget = self.cfg.trainer.micro_batch_tokens
        groups = [[k for k in mb if batch[k].response_length > 0]
                  for mb in micro_batches([len(s.tokens) for s in batch], budget)]  # fmt: skip
        groups = [g for g in groups if g]
        model = self.ddp or self.model
        stats: dict[str, float] = {}
        if not groups:
            if self.ddp is not None:
                dummy = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
                (model(input_ids=dummy, use_cache=False).logits.sum() * 0.0).backward()
            return stats
        for n, group in enumerate(groups):
            sync = self.ddp is None or n == len(groups) - 1
            with nullcontext() if sync else self.ddp.no_sync():
                logprobs, ent = self._forward(model, [batch[k] for k in group], entropy)
                loss, st = loss_fn([idx[k] for k in group], logprobs, ent)
                (loss * self.world).backward()
            for key, value in st.items():
                stats[key] = stats.get(key, 0.0) + float(value)
        return stats

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> float:
        clip = self.cfg.trainer.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # -- tensors of samples --------------------------------------------------------------------

    def _rollout_logprobs(self, s: Sample) -> Tensor:
        return torch.tensor(s.rollout_logprobs, dtype=torch.float32, device=self.device)

    def _mask(self, s: Sample) -> Tensor:
        return torch.tensor(s.loss_mask, dtype=torch.float32, device=self.device)

    def _pad(self, rows: list[Tensor]) -> Tensor:
        return pad_sequence(rows, batch_first=True)

    def _add_mismatch(self, stats: dict[str, float], samples: list[Sample], logprobs: list[Tensor]) -> None:
        for s, lp in zip(samples, logprobs):
            mask = self._mask(s)
            stats["mismatch"] += float(((lp - self._rollout_logprobs(s)).abs() * mask).sum())
            stats["mismatch_tokens"] += float(mask.sum())

    def _all_reduce(self, t: Tensor) -> Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    # -- weights out and in ----------------------------------------------------------------------

    def hf_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) of every parameter, a tied one once (under its first name): what
        the engines' weight loaders take."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict()}  # fmt: skip
        if self.ref is not None and not self.cfg.trainer.ref_model:  # a copy of the policy: not on disk
            state["ref"] = self.ref.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "ref" in state:
            self.ref = self._frozen_copy(state["ref"])

    def save_hf(self, path: str) -> None:
        """An HF model directory (weights, config, tokenizer) that `from_pretrained` loads."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
