"""LoRA on the torch backend (`trainer.lora`, `peft`): the adapter, its reference and its export.

The policy is the HF model under a PEFT adapter; only the adapter's parameters train. The KL
reference is the same model with the adapter switched off (`disable_adapter`), so a LoRA run holds
one copy of the base weights. What leaves the trainer (weight push, checkpoint, export) is the
adapter alone, under the names `get_peft_model_state_dict` gives: those of a PEFT adapter
directory (`adapter_config.json` + `adapter_model.safetensors`), which is what the engines load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import save_file
from torch import Tensor

from slimish.trainer.config import LoraConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def add_adapter(model: torch.nn.Module, lora: LoraConfig) -> PeftModel:
    """`model` under a fresh adapter (B = 0: the policy starts as the base); its base frozen."""
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config).eval()  # new dropout layers start in train mode


class AdaptersOff(torch.nn.Module):
    """The base model under a PEFT model, called with its adapter off: a LoRA run's KL reference.
    The PEFT model is held outside the module tree, so this adds no parameters and no state."""

    def __init__(self, peft_model: PeftModel) -> None:
        super().__init__()
        self.__dict__["peft_model"] = peft_model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.peft_model.get_output_embeddings()

    @property
    def config(self) -> Any:
        return self.peft_model.config


@contextmanager
def dropout_on(model: torch.nn.Module) -> Iterator[None]:
    """The adapter's dropout active for a gradient pass; everything else stays in eval mode."""
    layers = [m for name, m in model.named_modules() if name.endswith("lora_dropout")]
    for m in layers:
        m.train()
    try:
        yield
    finally:
        for m in layers:
            m.eval()


def adapter_tensors(model: PeftModel) -> dict[str, Tensor]:
    """The adapter's tensors under their PEFT state-dict names (as in `adapter_model.safetensors`)."""
    return get_peft_model_state_dict(model)


def load_adapter_tensors(model: PeftModel, tensors: dict[str, Tensor]) -> None:
    """Set the adapter from `adapter_tensors`' output; every tensor must land."""
    expected = set(get_peft_model_state_dict(model))
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
        raise ValueError(
            f"trainer.lora: the checkpoint's adapter does not fit this run's (missing {missing}, unexpected {extra}); "
            "rank and target_modules must be those of the run that saved it"
        )
    set_peft_model_state_dict(model, tensors)


def adapter_config(model: PeftModel) -> dict[str, Any]:
    """`adapter_config.json`'s content (sets become sorted lists)."""
    config = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def write_adapter_dir(path: str | Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> Path:
    """A PEFT adapter directory (what `PeftModel.from_pretrained` and `/load_lora_adapter` read)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()},
        str(path / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return path
