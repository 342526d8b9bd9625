"""The training loop's side on every rank but 0 (slimish/train.py; rank 0's is its `Driver`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch.distributed as dist

from slimish.trainer.base import Trainer
from slimish.types import Sample


class Follower:
    """Every other rank's side of the same loop: it joins the collectives rank 0's `Driver`
    starts (the weight export, the checkpoint's state and barrier) and keeps nothing else."""

    def connect(self) -> None:
        pass

    def phase(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()

    def start_producing(self, version: int, stack: ExitStack, trainer: Trainer) -> None:
        pass

    def rollout(self, version: int) -> tuple[None, dict[str, float]]:
        return None, {}  # the batch comes by broadcast

    def push(self, trainer: Trainer, version: int) -> dict[str, float]:
        trainer.join_export()
        return {}

    def evaluate(self) -> dict[str, float]:
        return {}

    def record_trained(self, step: int, groups: list[list[Sample]]) -> None:
        pass

    def save(self, step: int, trainer: Trainer) -> dict[str, float]:
        trainer.state_dict()  # this rank's part of rank 0's (Megatron gathers the shards)
        dist.barrier()  # rank 0 is writing the checkpoint
        return {}

    def load_state(self, state: dict[str, Any], source: str) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def end_step(self, step: int, metrics: dict[str, float], started: float) -> None:
        pass

    def done(self) -> None:
        pass
