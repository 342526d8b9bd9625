"""Decode attention for the built-in engine (`--decode-attention-backend`).

Why: a decode step attends with one query token per row, and then attention is two small
matrix products per row and KV head, which need no fused kernel: `matmul` computes them as batched matmuls over the slab's live columns, all query heads
that share a KV head at once (no `repeat_kv` copy). Either way the step streams the whole live
K and V from memory, which bounds both (benchmarks/README.md): the gain is a few percent.

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
    [B, q, heads, D]. One query token with a boolean mask takes the matmul path, anything else
    (prefill, soft-capping, a model's own mask) is HF's SDPA."""
    if (
        query.shape[2] != 1
        or attention_mask is None
        or attention_mask.dtype != torch.bool
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    b, heads, _, d = query.shape
    kv, width = key.shape[1], key.shape[2]
    n, group = b * kv, heads // kv
    scale = d**-0.5 if scaling is None else scaling
    # Query heads h*g .. h*g+g-1 share KV head h (HF's repeat_kv order), and the slab's [B, kv, W, D]
    # views merge B and kv without a copy. The scores are K q^T, the strided K first and the query as a
    # transposed operand: MKL's batched GEMM reads the slab faster that way than as q K^T (the
    # other order of P V, or V stored by column, measured slower or erratic: benchmarks/README.md).
    q = (query * scale).reshape(n, group, d)
    scores = torch.bmm(key.reshape(n, width, d), q.transpose(1, 2)).transpose(1, 2).contiguous()
    scores = scores.view(b, kv, group, width)
    scores.masked_fill_(attention_mask.logical_not(), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(n, group, width)
    out = torch.bmm(probs, value.reshape(n, width, d))
    return out.view(b, 1, heads, d), None


def use_decode_attention(model: PreTrainedModel, backend: str) -> None:
    """Make `model`'s forwards use `backend` for one-token queries (SDPA for the rest)."""
    one_of("engine.decode_attention_backend", backend, DECODE_ATTENTION_BACKENDS)
    if backend == SDPA:
        model.set_attn_implementation(SDPA)
        return
    AttentionInterface.register(_MATMUL_IMPL, matmul_decode_attention)
    AttentionMaskInterface.register(_MATMUL_IMPL, sdpa_mask)  # prefill builds its mask as SDPA does
    model.set_attn_implementation(_MATMUL_IMPL)
