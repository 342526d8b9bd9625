"""The decode forward (one token per row) of the llama family, on the model's own modules.

Why: HF's forward is general (keyword plumbing, mask and cache objects, hub-kernel wrappers,
module hooks on every call), which a small model's decode step pays on every layer. This loop runs
the same ops in the same order on the same weights, so the same bits (tests/test_engine_decode.py),
with one Python pass per layer: 2-4% of a step at 32 rows, 7% at 8 (benchmarks/README.md). Linear
layers are called through their `forward`, which skips module hooks: the runner takes HF's path
whenever hooks matter (LoRA, route capture) and for every other model family.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from slimish.engine.attention import attend, decode_bias
from slimish.engine.packed import PackedLinears

FAMILIES = ("llama", "qwen2", "qwen3")  # decoder layers alike: RMSNorm, rotary, GQA, SiLU-gated MLP


def supported(model: PreTrainedModel) -> bool:
    cfg = model.config
    return cfg.model_type in FAMILIES and cfg.hidden_act == "silu" and not getattr(cfg, "use_sliding_window", False)


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm forward of these families, op for op (the same bits), its temporaries updated
    in place."""
    h = x.to(torch.float32)
    return (h * h.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()).to(x.dtype).mul_(norm.weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's `apply_rotary_pos_emb` for one tensor, the same bits: `rotate_half(x) * sin` is
    `[-x2 * s1, x1 * s2]`, which is x's halves swapped times `signed_sin = [-s1, s2]` (a negation
    is exact), so one `roll` replaces the slices, the negation and the concatenation."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


def _project(packed: PackedLinears | None, modules: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
    """`modules`' outputs on `x` side by side: one GEMM for all on packed weights, else one each
    (fusing unpacked weights would take a concatenated copy of them, which a colocated engine
    must not)."""
    if packed is not None:
        return packed.fused(modules, x)
    return torch.cat([m.forward(x) for m in modules], dim=-1)


def decode_forward(
    model: PreTrainedModel,
    layers: list,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    packed: PackedLinears | None = None,
) -> torch.Tensor:
    """Next-token logits [rows, vocab] of `tokens` [rows, 1] at `positions` [rows, 1]; `layers` are
    the KV cache's (their `update` writes the new column and returns K and V as the slab views
    them), `mask` the boolean [rows, 1, 1, columns] attention mask over those columns; `packed`:
    the model's packed linears, whose `fused` then runs q, k, v and gate, up as one GEMM each."""
    inner, rows = model.model, tokens.shape[0]
    h = inner.embed_tokens.forward(tokens)
    cos, sin = (t.unsqueeze(1) for t in inner.rotary_emb(h, positions))
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    first = inner.layers[0].self_attn
    d = first.head_dim
    heads, kv_heads = first.q_proj.out_features // d, first.k_proj.out_features // d
    bias = decode_bias(mask, kv_heads, heads // kv_heads, h.dtype)
    for layer, cache in zip(inner.layers, layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms_norm(layer.input_layernorm, h)
        qkv = _project(packed, (attn.q_proj, attn.k_proj, attn.v_proj), x)
        # q and k side by side, [rows, 1, heads + kv_heads, D]: their heads rotate at once
        qk, v = (t.view(rows, 1, -1, d) for t in qkv.split(((heads + kv_heads) * d, kv_heads * d), dim=-1))
        if hasattr(attn, "q_norm"):  # qwen3
            qk = torch.cat((_rms_norm(attn.q_norm, qk[:, :, :heads]), _rms_norm(attn.k_norm, qk[:, :, heads:])), dim=2)
        qk = _rotate(qk, cos, signed_sin).transpose(1, 2)
        keys, values = cache.update(qk[:, heads:], v.transpose(1, 2))
        out = attend(qk[:, :heads], keys, values, bias, attn.scaling)
        h.add_(attn.o_proj.forward(out.view(rows, 1, -1)))  # in place: the residual's own tensor
        x = _rms_norm(layer.post_attention_layernorm, h)
        gate, up = _project(packed, (mlp.gate_proj, mlp.up_proj), x).chunk(2, dim=-1)
        h.add_(mlp.down_proj.forward(mlp.act_fn(gate).mul_(up)))
    return model.lm_head.forward(_rms_norm(inner.norm, h)[:, -1, :])
