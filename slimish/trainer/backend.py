"""What a trainer backend implements, and the sample tensors every backend builds alike.

The steps (base.py `Trainer`) do not depend on how the model is run: a backend (torch_backend.py,
megatron_backend.py) supplies the forward and backward of micro-batches, the optimiser step, the
reduction over data-parallel ranks, the model state and the weight export, as the abstract
methods below.

Micro-batches are right-padded rows, not one packed row: real tokens come before the padding, so
a causal model computes them exactly as it would unpadded, with no attention mask, and attention
stays quadratic in each sample's length instead of in the micro-batch's.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from slimish.trainer.batch import micro_batches
from slimish.types import Sample

if TYPE_CHECKING:
    from slimish.colocate import WeightStore
    from slimish.config import RunConfig

# (sample indices, response logprobs [B, R], entropies [B, R] or None) -> (loss share, stats)
LossFn = Callable[[list[int], Tensor, Tensor | None], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class WeightExport:
    """What one weight push carries (`Backend.export`): every parameter under its HF name, or with
    `trainer.lora` the adapter alone under its PEFT state-dict names, with its `adapter_config.json`
    (`adapter_config` set). `tensors` may be lazy: a Megatron export gathers as it is iterated."""

    tensors: Iterable[tuple[str, Tensor]]
    adapter_config: dict[str, Any] | None = None
    shared: WeightStore | None = None  # launch.colocate: the store the adapter's tensors are views of


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


class Backend(ABC):
    """A backend's `__init__` sets the attributes below (`Trainer._setup` does the common ones) and
    implements the abstract methods.

    Collective calls: `logprobs`, `hf_tensors` (and so `export`), `state_dict` and `save_hf` are
    called on every rank; `hf_tensors` and `state_dict` are complete on rank 0."""

    cfg: RunConfig
    rank: int  # global rank
    dp_rank: int  # which share of a batch this rank trains on
    dp_size: int
    device: torch.device
    tokenizer: Any
    pad_id: int
    temperature: float
    cpu_threads: int
    ref: Any  # the frozen reference model, None until needed
    critic: Any = None  # the value model (algorithm.advantage=gae), None without
    routes: Any = None  # a mixture-of-experts model's routing (routing.py RouteState), None for a dense one
    adapter_store: WeightStore | None = None  # launch.colocate with trainer.lora: the adapter, shared (colocate.py)
    optimizer: Any
    sft_optimizer: Any

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

    # -- the weights out ---------------------------------------------------------------------

    def export(self) -> WeightExport | dict[str, WeightExport]:
        """What a weight push carries, decided here alone: the whole policy, or with `trainer.lora`
        its adapter (every rank holds it whole; the engines keep their base weights); with
        `policies`, each policy's adapter by its name (weight_sync.py `PolicySyncs` pushes each)."""
        if self.cfg.policies:
            return {
                p.name: WeightExport(self.adapter_tensors(p.name).items(), self.adapter_config(p.name))
                for p in self.cfg.policies
            }
        if self.cfg.trainer.lora.enabled:
            return WeightExport(self.adapter_tensors().items(), self.adapter_config(), self.adapter_store)
        return WeightExport(self.hf_tensors())

    def join_export(self) -> None:
        """A follower rank's part of an export (weight push or HF save): run the collectives
        `export` takes part in, keeping none of the tensors (rank 0 has them all)."""
        for _ in self.export().tensors:
            pass

    def adapter_tensors(self, policy: str | None = None) -> dict[str, Tensor]:
        """trainer.lora: the adapter's tensors under their PEFT state-dict names (what is pushed);
        `policy`: that policy's adapter (`policies`)."""
        raise NotImplementedError(f"trainer.lora: {type(self).__name__} has no adapters")

    def adapter_config(self, policy: str | None = None) -> dict[str, Any]:
        """trainer.lora: the adapter's `adapter_config.json` (what the engines load it with)."""
        raise NotImplementedError(f"trainer.lora: {type(self).__name__} has no adapters")

    def use_policy(self, name: str) -> AbstractContextManager[None]:
        """`policies`: the policy `name` active inside (its adapter, optimiser, schedule, algorithm)."""
        raise NotImplementedError(f"policies: {type(self).__name__} trains one policy")

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

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model, optimiser and schedule (and a copied reference): what a resume needs."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned on rank 0 (every rank is given it)."""

    @abstractmethod
    def save_hf(self, path: str) -> None:
        """An HF model directory (weights, config, tokenizer) that `from_pretrained` loads; rank 0 writes it."""
