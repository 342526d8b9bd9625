"""Decode attention for the built-in engine (`--decode-attention-backend`).

Why: a decode step attends with one query token per row, and then attention is two small
matrix products per row and KV head, which need no fused kernel: `matmul` computes them as
batched matmuls over the slab's columns, all query heads that share a KV head at once (no
`repeat_kv` copy), the mask added to the scores by the first. Either way the step streams the
whole K and V from memory, which bounds both (benchmarks/README.md); `matmul` reads the running
batch's V in the transposed layout that slab keeps (runner.KVSlab), which SDPA cannot.

Both backends are registered as HF attention implementations, so the stock model classes call
them; forwards with more than one query token (prefill) always go to HF's SDPA function, so
prefill, and with it the prefix cache's exactness, is the same under either backend. A decode
forward passes a 4D boolean mask (True: attend), which HF hands to the attention unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from slimish.engine.config import DECODE_ATTENTION_BACKENDS
from slimish.schema import one_of

SDPA, MATMUL = DECODE_ATTENTION_BACKENDS
_MATMUL_IMPL = "slimish_matmul_decode"  # the HF attention implementation name of `matmul`


def decode_bias(attention_mask: torch.Tensor, kv_heads: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The boolean decode mask [B, 1, 1, W] (True: attend) as `attend`'s additive scores bias
    [B x kv_heads, group, W]: 0 where a column is attended, -inf where not. A decode step builds it
    once for all its layers (decode_forward.py) instead of masking every layer's scores."""
    b, width = attention_mask.shape[0], attention_mask.shape[-1]
    bias = torch.zeros(b, 1, 1, width, dtype=dtype, device=attention_mask.device)
    bias.masked_fill_(attention_mask.logical_not(), float("-inf"))
    return bias.expand(b, kv_heads, group, width).reshape(b * kv_heads, group, width)


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per row: query [B, heads, 1, D], key/value [B, kv_heads, W, D] (the slab's
    views; V's may be a transposed buffer's), `bias` from `decode_bias`; returns [B, 1, heads, D]."""
    b, heads, _, d = query.shape
    kv, width = key.shape[1], key.shape[2]
    n, group = b * kv, heads // kv
    # Query heads h*g .. h*g+g-1 share KV head h (HF's repeat_kv order), and the slab's [B, kv, W, D]
    # views merge B and kv without a copy. The scores are q K^T with the mask added by the same
    # GEMM (baddbmm, the bias built once per step): 0-5% faster per step than K q^T and a
    # masked_fill per layer in interleaved runs (benchmarks/README.md).
    q = (query * scale).reshape(n, group, d)
    scores = torch.baddbmm(bias, q, key.reshape(n, width, d).transpose(1, 2))
    probs = torch.softmax(scores, dim=-1)
    # V stored transposed (a decoding KVSlab): MKL's V^T P^T streams it 1.6-2x faster than P V
    if value.stride(-2) == 1:
        out = torch.bmm(value.transpose(2, 3).reshape(n, d, width), probs.transpose(1, 2))
        return out.transpose(1, 2).reshape(b, 1, heads, d)
    return torch.bmm(probs, value.reshape(n, width, d)).view(b, 1, heads, d)


def matmul_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention signature: query [B, heads, q, D], key/value [B, kv_heads, W, D]; returns
    [B, q, heads, D]. One query token with a boolean mask takes `attend`, anything else
    (prefill, soft-capping, a model's own mask) is HF's SDPA."""
    if (
        query.shape[2] != 1
        or attention_mask is None
        or attention_mask.dtype != torch.bool
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kv, scale = key.shape[1], query.shape[-1] ** -0.5 if scaling is None else scaling
    bias = decode_bias(attention_mask, kv, query.shape[1] // kv, query.dtype)
    return attend(query, key, value, bias, scale), None


def use_decode_attention(model: PreTrainedModel, backend: str) -> None:
    """Make `model`'s forwards use `backend` for one-token queries (SDPA for the rest)."""
    one_of("engine.decode_attention_backend", backend, DECODE_ATTENTION_BACKENDS)
    if backend == SDPA:
        model.set_attn_implementation(SDPA)
        return
    AttentionInterface.register(_MATMUL_IMPL, matmul_decode_attention)
    AttentionMaskInterface.register(_MATMUL_IMPL, sdpa_mask)  # prefill builds its mask as SDPA does
    model.set_attn_implementation(_MATMUL_IMPL)
