"""Batch-invariant kernels: a token's logits computed bit for bit alike whatever else is in its forward.

Why: the engine's numbers for one sequence depend on its batch mates (the decode batch's rows, its
left padding, a prefill page's length), and the trainer scores whole right-padded sequences at
once: the same weights give log-probs that differ in the last bits (train/mismatch). With these
kernels on both sides (`--enable-deterministic-inference` in the engine, `algorithm.true_on_policy`
in the trainer) every reduction a token's logits go through has one order, so rollout and trainer
log-probs are equal, not close ("Defeating Nondeterminism in LLM Inference"; SGLang's
deterministic inference, sglang 0.5.23: python/sglang/srt/batch_invariant_ops/batch_invariant_ops.py).

What varies, and how each is pinned (measured on CPU, torch 2.13 with MKL, one intra-op thread):
- Matmul: MKL's sgemm gives a row the same bits for any row count >= 4, but 1 row runs a gemv
  and 2-3 rows another kernel, each with its own reduction order. `linear` pads to 4 rows.
- Attention: the key axis changes with the layout (a decode row's left padding, a prefill page,
  the trainer's whole sequence), and float sums depend on where each element sits. `attention`
  sums over keys in 64-bit fixed point, where addition is exact and so order-free: a query's
  output depends only on the keys it attends, wherever they lie. Scores reduce over head_dim alone.
- Norms, activations, rotary, log-softmax reduce along the hidden or vocabulary axis only, which
  is the same for every row already (one thread: a row is never split between threads).
"""

from __future__ import annotations

import types

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPL = "slimish_batch_invariant"  # the HF attention implementation name
MIN_ROWS = 4  # MKL sgemm's rows are independent of the row count from here on
FIXED_BITS = 40  # each fixed-point term is below 2**40: 2**22 keys sum without overflow


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` with at least `MIN_ROWS` rows (zero rows added, then dropped), so that a row's
    output bits do not depend on how many rows share the call."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= MIN_ROWS or rows == 0:
        return torch.nn.functional.linear(x, weight, bias)
    flat = torch.cat([x.reshape(rows, x.shape[-1]), x.new_zeros(MIN_ROWS - rows, x.shape[-1])])
    return torch.nn.functional.linear(flat, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


def log_softmax(x: Tensor) -> Tensor:
    """log-softmax over the last axis as the trainer computes it (`logits - logsumexp`), so the
    engine's and the trainer's log-probs of one token are the same arithmetic."""
    return x - torch.logsumexp(x, dim=-1, keepdim=True)


def logsumexp_and_exp(x: Tensor) -> tuple[Tensor, Tensor]:
    """`torch.logsumexp(x, -1, keepdim=True)` bit for bit, so `x - lse` is `log_softmax(x)`'s bits,
    with the `exp(x - max)` it sums on the way (torch computes it as `max + log(sum(exp(x - max)))`,
    an infinite max taken as 0): the engine's sampler draws from those unnormalised probabilities
    instead of a second `exp` over the vocabulary (tests/test_true_on_policy.py holds the bits)."""
    top = x.amax(dim=-1, keepdim=True)
    top.masked_fill_(top.abs() == float("inf"), 0.0)
    shifted = (x - top).exp_()
    return shifted.sum(dim=-1, keepdim=True).log_().add_(top), shifted


def _fixed_sum(terms: Tensor, dim: int) -> Tensor:
    """The sum of `terms` (float64, exact products of fp32 values) over `dim`, independent of order:
    each term is rounded to a multiple of 2**-40 of the largest |term| (a power of two, found by a
    max, which is order-free) and the integers are added exactly."""
    top = terms.abs().amax(dim=dim, keepdim=True)
    _, exponent = torch.frexp(top)  # top < 2**exponent
    scale = torch.ldexp(torch.ones_like(top), FIXED_BITS - exponent)
    total = torch.round(terms * scale).to(torch.int64).sum(dim=dim, keepdim=True)
    return (total.to(torch.float64) / scale).squeeze(dim)


def attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """HF attention signature: query [B, heads, q, D], key/value [B, kv_heads, W, D], mask
    [B, 1, q, W] (True: attend; None: causal, the last q of W positions); returns [B, q, heads, D].

    softmax(s) @ V as (sum_j e_j v_j) / (sum_j e_j) with e_j = exp(s_j - max s): both sums in
    fixed point (`_fixed_sum`), so masked keys (e_j = 0) and the key axis's length and offset
    change nothing."""
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None or dropout:
        raise ValueError("batch-invariant attention: soft-capping, sliding windows and dropout are not supported")
    b, heads, q, d = query.shape
    kv, width = key.shape[1], key.shape[2]
    group = heads // kv  # query heads h*g .. h*g+g-1 share KV head h (HF's repeat_kv order)
    scale = d**-0.5 if scaling is None else scaling
    qg = query.reshape(b, kv, group, q, 1, d)
    scores = (qg * key[:, :, None, None]).sum(-1) * scale  # [B, kv, g, q, W]: a fixed-length reduction over D
    if attention_mask is None:
        keys = torch.arange(width, device=query.device)
        allowed = keys[None, :] <= keys[width - q :, None]  # [q, W]
    else:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        allowed = allowed[:, :, None]  # [B, 1, 1, q, W]
    scores = scores.masked_fill(~allowed, float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))  # masked keys: exactly 0
    with torch.no_grad():  # rounding to integers has no gradient: see below
        wide = e.double()
        num = _fixed_sum(wide[..., None] * value[:, :, None, None].double(), dim=-2)  # [B, kv, g, q, D]
        out = (num / _fixed_sum(wide, dim=-1)[..., None]).to(query.dtype)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        # The trainer's backward: the float softmax attention's gradient, its value added as an
        # exact 0 (x - x), so the forward's bits stay the fixed-point ones.
        ref = (e / e.sum(-1, keepdim=True)) @ value[:, :, None]
        out = out + (ref - ref.detach())
    return out.reshape(b, heads, q, d).transpose(1, 2).contiguous(), None


def _linear_forward(self: torch.nn.Linear, x: Tensor) -> Tensor:
    return linear(x, self.weight, self.bias)


def make_batch_invariant(model: PreTrainedModel) -> PreTrainedModel:
    """Switch `model`'s forwards to these kernels, in place: every `nn.Linear` (the LM head
    included) through `linear`, attention through `attention`. Needs one intra-op thread
    (`torch.set_num_threads(1)`, which the callers set): with several, a row may be split."""
    AttentionInterface.register(IMPL, attention)
    AttentionMaskInterface.register(IMPL, sdpa_mask)
    model.set_attn_implementation(IMPL)
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_linear_forward, module)
    return model
