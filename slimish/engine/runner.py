"""Model forward for the built-in engine: prefill one request, decode the whole running batch.

The running batch keeps one HF `DynamicCache`, left-padded: row i's real tokens are the last
`lens[i]` columns, earlier columns are zeros hidden by the attention mask. A request that joins
is prefilled alone (no padding, so its prompt logits are exact) and then padded into the batch;
a request that leaves is dropped by row, and columns that became padding for every row are cut.
This is continuous batching on the stock HF model classes, with nothing model-specific here.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from slimish.engine.lora import LoraManager


def engine_device(name: str) -> torch.device:
    """The device `engine.device` names, checked against this machine (`cuda` is `cuda:0`)."""
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"engine.device (--device) is {name!r}, but CUDA is not available here; use cpu")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"engine.device (--device) is {name!r}, but this machine has {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def use_device(device: torch.device) -> None:
    """Make a CUDA `device` the calling thread's current one (CUDA keeps it per thread): NCCL
    groups and tensors made without an explicit device land there, not on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def load_model(path: str, dtype: str, device: torch.device) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    return model


def _set_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


class KVBatch:
    """The left-padded KV cache and attention mask of the running batch."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=model.device)
        self.lens: list[int] = []

    def __len__(self) -> int:
        return len(self.lens)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def add(self, caches: list[DynamicCache], lens: list[int]) -> None:
        """Append prefilled single-row caches as new rows, padding everything to one width."""
        width = max([self.width, *lens])
        masks = [F.pad(self.mask, (width - self.width, 0))] if len(self) else []
        masks += [F.pad(torch.ones(1, n, dtype=torch.long, device=self.mask.device), (width - n, 0)) for n in lens]
        for i, layer in enumerate(self.cache.layers):
            parts_k, parts_v = [], []
            if len(self):
                parts_k.append(F.pad(layer.keys, (0, 0, width - self.width, 0)))
                parts_v.append(F.pad(layer.values, (0, 0, width - self.width, 0)))
            for c, n in zip(caches, lens):
                parts_k.append(F.pad(c.layers[i].keys, (0, 0, width - n, 0)))
                parts_v.append(F.pad(c.layers[i].values, (0, 0, width - n, 0)))
            _set_layer(layer, torch.cat(parts_k), torch.cat(parts_v))
        self.mask = torch.cat(masks)
        self.lens += lens

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order) and cut columns that are padding for all of them."""
        self.lens = [self.lens[r] for r in rows]
        if not rows:
            self.cache = DynamicCache(config=self.model.config)
            self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.mask.device)
            return
        start = self.width - max(self.lens)
        index = torch.tensor(rows, device=self.mask.device)
        self.mask = self.mask[index, start:]
        for layer in self.cache.layers:
            _set_layer(layer, layer.keys[index, :, start:], layer.values[index, :, start:])


@dataclass
class PrefillOutput:
    cache: DynamicCache
    logits: torch.Tensor  # [positions, vocab] fp32: all prompt positions, or just the last one


class Runner:
    """Stateless forwards over a model; the scheduler owns the batch. With `lora`, each row is
    run with its own adapter (None: the base model); the scheduler has given each one a slot."""

    def __init__(self, model: PreTrainedModel, lora: LoraManager | None = None) -> None:
        self.model = model
        self.device = model.device
        self.lora = lora

    def _adapters(self, adapters: list[str | None] | None) -> ContextManager[None]:
        return self.lora.rows(adapters) if self.lora is not None and adapters is not None else nullcontext()

    @torch.inference_mode()
    def prefill(self, input_ids: list[int], all_logits: bool, adapter: str | None = None) -> PrefillOutput:
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([input_ids], device=self.device)
        with self._adapters([adapter]):
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=0 if all_logits else 1)
        return PrefillOutput(cache=cache, logits=out.logits[0].float())

    @torch.inference_mode()
    def decode(self, batch: KVBatch, tokens: list[int], adapters: list[str | None] | None = None) -> torch.Tensor:
        """Feed one token per row (row i with `adapters[i]`, all base when None); returns next-token logits [rows, vocab] in fp32."""
        device = self.device
        batch.mask = torch.cat([batch.mask, torch.ones(len(batch), 1, dtype=torch.long, device=device)], dim=1)
        with self._adapters(adapters):
            out = self.model(
                input_ids=torch.tensor(tokens, device=device).unsqueeze(1),
                attention_mask=batch.mask,
                position_ids=torch.tensor(batch.lens, device=device).unsqueeze(1),
                cache=batch.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        batch.lens = [n + 1 for n in batch.lens]
        return out.logits[:, -1, :].float()
