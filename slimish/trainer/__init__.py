"""Trainer backends: `make_trainer(cfg)` builds the one `trainer.backend` names."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slimish.colocate import WeightStore
    from slimish.config import RunConfig
    from slimish.trainer.base import Trainer


def make_trainer(cfg: RunConfig, store: WeightStore | None = None) -> Trainer:
    """The torch or the Megatron-Core trainer; Megatron is imported only when chosen (~12 s).
    `store`: a colocated run's (`launch.colocate`, torch only), which its parameters become views of."""
    if cfg.trainer.backend == "megatron":
        if store is not None:
            raise ValueError("launch.colocate needs trainer.backend=torch")
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise RuntimeError(
                "trainer.backend=megatron needs megatron-core, which is not installed "
                "(pip install -e '.[dev]', or megatron-core==0.16.1 on Python 3.11)"
            )
        from slimish.trainer.megatron_backend import MegatronTrainer

        return MegatronTrainer(cfg)
    from slimish.trainer.torch_backend import TorchTrainer

    return TorchTrainer(cfg, store)
