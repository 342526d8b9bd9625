"""Mixture-of-experts models as the rest of slimish sees them: routers by layer, and the expert
weights under their checkpoint names.

Why: transformers 5 holds each MoE layer's experts fused (`mlp.experts.gate_up_proj [E, 2I, H]`,
`mlp.experts.down_proj [E, H, I]`) while checkpoints, SGLang's loader and Megatron's export name one
tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`). The wire speaks the checkpoint
names; this module maps them onto the fused tensors (as views, so an in-place receive lands in the
model) and back. Only transformers' `qwen2_moe` layout family is understood (Qwen2/3-MoE, OLMoE,
DeepSeek-V3, GLM-4 MoE...); anything else is refused by name rather than guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
# One expert's projection under its checkpoint (and SGLang LoRA) name: `...experts.{e}.{gate,up,down}_proj`.
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def route_shape(config) -> tuple[int, int] | None:
    """`(num_hidden_layers, top_k)` of a MoE model's routes (the shape of SGLang's
    `routed_experts` rows); None for a dense model."""
    config = getattr(config, "text_config", None) or config
    top_k = getattr(config, "num_experts_per_tok", None)
    if not top_k or not (getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)):
        return None
    return config.num_hidden_layers, int(top_k)


def replay_shape(mode: str, config, model: str) -> tuple[int, int] | None:
    """`route_shape` of a model whose routes `algorithm.routing_replay=mode` replays: None for a
    dense model under `none`; a dense model under r2 or r3 is refused, naming the field."""
    shape = route_shape(config)
    if shape is None and mode != "none":
        raise ValueError(
            f"algorithm.routing_replay={mode}: {model} is not a mixture-of-experts model (its config has no "
            "num_experts_per_tok); set algorithm.routing_replay=none"
        )
    return shape


def router_class(model: nn.Module) -> type[nn.Module] | None:
    """The model's top-k router class, as transformers itself names it for `output_router_logits`."""
    recorder = getattr(type(model), "_can_record_outputs", None) or {}
    target = recorder.get("router_logits")
    return getattr(target, "target_class", None)


def router_paths(model: nn.Module) -> list[str]:
    """The module paths of the model's routers (`model.layers.0.mlp.gate`, ...): never a LoRA target."""
    cls = router_class(model)
    return [name for name, m in model.named_modules() if cls is not None and isinstance(m, cls)]


def routers(model: nn.Module) -> dict[int, nn.Module]:
    """Layer index -> that layer's router, for every MoE layer, in layer order. Each router's
    forward returns `(logits, weights [T, K], indices [T, K])` over the flattened `[batch*seq]`
    tokens (transformers 5's contract, which replay and route capture rely on)."""
    cls = router_class(model)
    if cls is None:
        return {}
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, cls):
            match = LAYER.search(name + ".")
            if match is None:
                raise ValueError(f"router {name!r}: no layer index in its module path")
            found[int(match.group(1))] = module
    return dict(sorted(found.items()))


def _split(name: str, fused: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-expert checkpoint tensors of one fused expert parameter, as views of it."""
    match = EXPERTS.match(name.removesuffix(".weight"))
    prefix, kind = match.group("prefix"), match.group("kind")
    if fused.dim() != 3:
        raise ValueError(f"{name}: expected a fused [experts, out, in] tensor, got shape {tuple(fused.shape)}")
    for e in range(fused.shape[0]):
        if kind == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", fused[e]
        else:  # rows [:I] are the gate projection, [I:] the up projection (the forward's chunk(2))
            half = fused.shape[1] // 2
            yield f"{prefix}.{e}.gate_proj.weight", fused[e, :half]
            yield f"{prefix}.{e}.up_proj.weight", fused[e, half:]


def is_fused_experts(name: str) -> bool:
    return EXPERTS.match(name.removesuffix(".weight")) is not None


def checkpoint_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_parameters()`-style pairs with every fused expert tensor replaced by its per-expert
    checkpoint tensors (views; `.contiguous()` them before sending). Other pairs pass through."""
    for name, tensor in named:
        if is_fused_experts(name):
            yield from _split(name, tensor)
        else:
            yield name, tensor


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> module, for every module holding fused experts (3-D `gate_up_proj` and `down_proj`)."""
    found = {}
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if all(k in params and params[k].dim() == 3 for k in ("gate_up_proj", "down_proj")):
            found[name] = module
    return found


def per_expert_names(name: str, fused: torch.Tensor) -> list[str]:
    """The checkpoint names one fused expert parameter stands for (for error messages)."""
    return [n for n, _ in _split(name, fused)]
