"""HF tensors <-> Megatron-Core GPTModel tensors, one (tp_rank, pp_rank, ep_rank) shard at a time.

Why pure functions over explicit ranks: the same math serves three callers. The first is
`load_model` (each rank loads its own shard of an HF checkpoint). The second is
`slimish convert` (one process writes every shard, without torch.distributed). The third is
`export_hf`, the weight-sync iterator, which gathers shards over the TP group and yields one full
HF tensor at a time.

Names follow `BridgeConfig.spec`. The `te` spec has no `input_layernorm` and, in dense layers,
no `pre_mlp_layernorm`: those RMSNorm weights are `layer_norm_weight` of the fused
`linear_qkv` / `linear_fc1` (TELayerNormColumnParallelLinear). MoE layers keep `pre_mlp_layernorm`.
TE's `_extra_state` entries hold no weights and are not listed.

Layouts (the same under both specs):
- `linear_qkv` rows are grouped per KV group: [q heads of group 0, k0, v0, q heads of group 1, ...].
  A TP rank therefore holds whole groups as one contiguous dim-0 slice. Biases use the same layout.
- `linear_fc1` is [gate; up] in full. Each TP rank holds [gate_shard; up_shard], so a plain dim-0
  split would be wrong.
- Embedding and output rows are padded with zeros to `BridgeConfig.padded_vocab_size(tp)` and
  stripped on export.
- Under expert parallelism (EP), rank r holds experts r*E/ep .. as `local_experts.0..E/ep-1`;
  everything else is the same on every EP rank. Export gathers the experts over the EP group.
- A shared expert (Qwen2-MoE) is a plain gated MLP, `mlp.shared_experts.*`, on every EP rank.
- Under PP, stage p holds layers p*n .. p*n+n-1 as local layers 0..n-1. A tied output layer lives
  on the last stage as a copy of the embedding. It is loaded from `model.embed_tokens.weight` but
  not exported (the first stage exports that tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_bridge.config import BridgeConfig

# replicated: same on every TP rank. row: RowParallelLinear, split dim 1.
# vocab: padded, then split dim 0. qkv / gate_up: fused ColumnParallelLinear, see the module docstring.
Kind = Literal["replicated", "row", "vocab", "qkv", "gate_up"]
HFSource = Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class Param:
    """One Megatron tensor of a stage and the HF tensors it is made of (in fusion order)."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind
    export: bool = True
    expert: int | None = None  # the global index of a routed expert's tensor (EP ranks hold different ones)


def _layer_params(cfg: BridgeConfig, local: int, layer: int, ep_rank: int = 0, ep_size: int = 1) -> list[Param]:
    m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
    attn = h + "self_attn."
    te = cfg.spec == "te"
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te and not cfg.num_experts else "pre_mlp_layernorm.weight"
    params = [
        Param(m + input_norm, (h + "input_layernorm.weight",), "replicated"),
        Param(m + "self_attention.linear_qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv"),
    ]
    if cfg.qkv_bias:
        params.append(Param(m + "self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv"))
    if cfg.qk_norm:
        params += [
            Param(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"),
            Param(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"),
        ]
    params += [
        Param(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
        Param(m + mlp_norm, (h + "post_attention_layernorm.weight",), "replicated"),
    ]
    if cfg.num_experts:
        params.append(Param(m + "mlp.router.weight", (h + "mlp.gate.weight",), "replicated"))
        n = cfg.num_experts // ep_size
        experts = [
            (f"{m}mlp.experts.local_experts.{i}.", f"{h}mlp.experts.{ep_rank * n + i}.", ep_rank * n + i)
            for i in range(n)
        ]
        if cfg.shared_expert_ffn:
            experts.append((m + "mlp.shared_experts.", h + "mlp.shared_expert.", None))
            params.append(
                Param(m + "mlp.shared_experts.gate_weight", (h + "mlp.shared_expert_gate.weight",), "replicated")
            )
    else:
        experts = [(m + "mlp.", h + "mlp.", None)]
    for mp, hp, e in experts:
        params += [
            Param(mp + "linear_fc1.weight", (hp + "gate_proj.weight", hp + "up_proj.weight"), "gate_up", expert=e),
            Param(mp + "linear_fc2.weight", (hp + "down_proj.weight",), "row", expert=e),
        ]
    return params


def stage_params(
    cfg: BridgeConfig, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1
) -> list[Param]:
    """Every tensor in the GPTModel state_dict of pipeline stage `pp_rank` and expert-parallel rank
    `ep_rank`, in model order (the lists of two EP ranks differ only in their experts' numbers)."""
    cfg.check_parallel(1, pp_size, ep_size)
    if not 0 <= pp_rank < pp_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}) and ep_rank in [0, {ep_size}), got {pp_rank}, {ep_rank}")
    per_stage = cfg.num_layers // pp_size
    params = []
    if pp_rank == 0:
        params.append(Param("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    for local in range(per_stage):
        params += _layer_params(cfg, local, pp_rank * per_stage + local, ep_rank, ep_size)
    if pp_rank == pp_size - 1:
        params.append(Param("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        if not cfg.tie_word_embeddings:
            params.append(Param("output_layer.weight", ("lm_head.weight",), "vocab"))
        elif pp_size > 1:  # the last stage keeps its own copy of the tied embedding
            params.append(Param("output_layer.weight", ("model.embed_tokens.weight",), "vocab", export=False))
    return params


def _split(t: torch.Tensor, tp_rank: int, tp_size: int, dim: int = 0) -> torch.Tensor:
    if t.shape[dim] % tp_size:
        raise ValueError(f"dim {dim} of a tensor of shape {tuple(t.shape)} is not divisible by tp_size={tp_size}")
    return t.chunk(tp_size, dim)[tp_rank]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: BridgeConfig) -> torch.Tensor:
    groups, rest = cfg.num_query_groups, q.shape[1:]
    per_group = cfg.num_attention_heads // groups * cfg.head_dim
    return torch.cat(
        [
            q.reshape(groups, per_group, *rest),
            k.reshape(groups, cfg.head_dim, *rest),
            v.reshape(groups, cfg.head_dim, *rest),
        ],
        dim=1,
    ).reshape(-1, *rest)


def _unfuse_qkv(qkv: torch.Tensor, cfg: BridgeConfig) -> list[torch.Tensor]:
    groups, rest = cfg.num_query_groups, qkv.shape[1:]
    per_group = cfg.num_attention_heads // groups * cfg.head_dim
    q, k, v = qkv.reshape(groups, -1, *rest).split([per_group, cfg.head_dim, cfg.head_dim], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def shard(param: Param, hf: list[torch.Tensor], cfg: BridgeConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The `tp_rank` slice of `param` built from its full HF tensors (a fresh contiguous tensor)."""
    if param.kind == "replicated":
        out = hf[0]
    elif param.kind == "row":
        out = _split(hf[0], tp_rank, tp_size, 1)
    elif param.kind == "vocab":
        padded = hf[0].new_zeros(cfg.padded_vocab_size(tp_size), *hf[0].shape[1:])
        padded[: hf[0].shape[0]] = hf[0]
        out = _split(padded, tp_rank, tp_size, 0)
    elif param.kind == "qkv":
        out = _split(_fuse_qkv(*hf, cfg), tp_rank, tp_size, 0)
    elif param.kind == "gate_up":
        out = torch.cat([_split(t, tp_rank, tp_size, 0) for t in hf])
    else:
        raise ValueError(f"unknown kind {param.kind!r} of {param.megatron}")
    return out.clone(memory_format=torch.contiguous_format)


def merge(param: Param, shards: list[torch.Tensor], cfg: BridgeConfig) -> list[torch.Tensor]:
    """The full HF tensors of `param` (in `param.hf` order) from its shards of every TP rank."""
    if param.kind == "replicated":
        return [shards[0]]
    if param.kind == "row":
        return [torch.cat(shards, 1)]
    if param.kind == "vocab":
        return [torch.cat(shards, 0)[: cfg.vocab_size]]
    if param.kind == "qkv":
        return _unfuse_qkv(torch.cat(shards, 0), cfg)
    if param.kind == "gate_up":
        halves = [s.chunk(2, 0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown kind {param.kind!r} of {param.megatron}")


def hf_to_megatron(
    hf_state: HFSource,
    cfg: BridgeConfig,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The GPTModel state_dict of shard (tp_rank, pp_rank, ep_rank) from full HF tensors.

    `hf_state` is a dict or a getter `name -> tensor`. Only the tensors of this stage are requested,
    so a lazy getter (safetensors) reads only what the shard needs.
    """
    cfg.check_parallel(tp_size, pp_size)
    get = hf_state.__getitem__ if isinstance(hf_state, Mapping) else hf_state
    return {
        p.megatron: shard(p, [get(n) for n in p.hf], cfg, tp_rank, tp_size)
        for p in stage_params(cfg, pp_rank, pp_size, ep_rank, ep_size)
    }


def megatron_to_hf(
    shards: Callable[[str], list[torch.Tensor]], cfg: BridgeConfig, pp_rank: int = 0, pp_size: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors of stage `pp_rank`; `shards(megatron_key)` gives that key's tensors of every TP rank."""
    for param in stage_params(cfg, pp_rank, pp_size):
        if param.export:
            yield from zip(param.hf, merge(param, shards(param.megatron), cfg))


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # mcore DDP / Float16Module
        model = model.module
    return model


def export_hf(
    model: torch.nn.Module,
    cfg: BridgeConfig,
    *,
    grads: bool = False,
    tp_group: torch.distributed.ProcessGroup | None = None,
    pp_rank: int | None = None,
    pp_size: int | None = None,
    ep_group: torch.distributed.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for this pipeline stage, gathering over the TP group one tensor at
    a time, and each layer's routed experts over the EP group (all E of them, in expert order).

    Collective: every rank of the TP and EP groups must iterate to the end together. Layer numbers
    in the names are global. With `grads=True` the gradients are yielded instead (`main_grad` under
    mcore DDP, else `.grad`; zeros where none). Groups and ranks default to Megatron's parallel
    state. Tensors come in the model's dtype. A replicated tensor (a norm, the router) may alias the
    live parameter, so copy anything you keep past the next optimizer step.
    """
    from megatron.core import parallel_state

    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if pp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if ep_group is None and cfg.num_experts:
        ep_group = parallel_state.get_expert_model_parallel_group()
    tp_size = torch.distributed.get_world_size(tp_group)
    ep_size = 1 if ep_group is None else torch.distributed.get_world_size(ep_group)
    ep_rank = 0 if ep_group is None else torch.distributed.get_rank(ep_group)
    params = dict(_unwrap(model).named_parameters())
    per_rank = [stage_params(cfg, pp_rank, pp_size, r, ep_size) for r in range(ep_size)]

    def local(name: str) -> torch.Tensor:
        p = params[name]
        if not grads:
            return p.detach()
        g = p.main_grad if hasattr(p, "main_grad") else p.grad
        return torch.zeros_like(p) if g is None else g.detach()

    def gathered(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
        if size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(out, t.contiguous(), group=group)
        return out

    experts: list[tuple[int, int, str, torch.Tensor]] = []  # a layer's routed experts: (expert, order, name, tensor)
    for j, param in enumerate(per_rank[ep_rank]):
        if not param.export:
            continue
        t = local(param.megatron).contiguous()
        shards = [t] if param.kind == "replicated" else gathered(t, tp_group, tp_size)
        full = merge(param, shards, cfg)
        if param.expert is None:
            yield from ((name, t) for _, _, name, t in sorted(experts, key=lambda x: x[:2]))
            experts.clear()
            yield from zip(param.hf, full)
            continue
        for k, tensor in enumerate(full):
            for r, other in enumerate(gathered(tensor, ep_group, ep_size)):
                theirs = per_rank[r][j]
                experts.append((theirs.expert, j * 2 + k, theirs.hf[k], other))
    yield from ((name, t) for _, _, name, t in sorted(experts, key=lambda x: x[:2]))
