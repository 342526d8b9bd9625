"""Log-probabilities and entropies of the response tokens from the LM head: pure tensor functions.

The engine reports log-probs of the temperature-scaled distribution, so the trainer scores with the
same temperature. `chunked_logprobs` never holds more than one chunk's `[chunk, V]` logits: the
vocabulary dimension is what runs out of memory first on long responses.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.utils.checkpoint
from torch import Tensor

from slimish.batch_invariant import linear


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log p(label) `[..., T]` from logits `[..., T, V]`, in fp32.

    `label logit - logsumexp` rather than `log_softmax` then gather: log_softmax keeps a second
    `[T, V]` tensor alive for backward, logsumexp does not. `temperature` must be the sampling
    temperature, because the engine reports logprobs of the temperature-scaled distribution."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy `[..., T]` of the (temperature-scaled) next-token distribution: logsumexp - E[logit]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _head_chunk(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float, entropy: bool | None
) -> tuple[Tensor, Tensor | None]:
    """One chunk of `chunked_logprobs`: LM head, then the very functions of the full path."""
    logits = linear(hidden, weight, bias)  # a chunk's last rows as the engine's (batch_invariant.py)
    logprobs = logprobs_from_logits(logits, labels, temperature)
    ent = None
    if entropy is not False:  # after the logprobs: a checkpoint's recompute stops before a no-grad entropy
        with nullcontext() if entropy else torch.no_grad():
            ent = entropy_from_logits(logits, temperature)
    return logprobs, ent


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    entropy: bool | None = False,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`logprobs_from_logits` (and, unless `entropy` is False, `entropy_from_logits`) of the
    logits `hidden @ weight.T + bias`, `chunk_tokens` rows at a time: hidden states `[N, H]`
    (only the positions that are scored), LM head `weight` `[V, H]`, `labels` `[N]` -> `[N]`.

    Never more than one chunk's `[chunk_tokens, V]` logits exist: with gradient each chunk runs
    under activation checkpointing, so backward recomputes its logits instead of keeping every
    chunk's alive (one more LM-head matmul per chunk). Same numbers as the full path, up to
    matmul rounding. `entropy`: with gradient (True), measured without (None), or not (False)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: must be >= 1, got {chunk_tokens}")
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    logprobs, ents = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        args = (
            hidden[start : start + chunk_tokens],
            weight,
            bias,
            labels[start : start + chunk_tokens],
            temperature,
            entropy,
        )
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _head_chunk(*args)
        logprobs.append(lp)
        ents.append(ent)
    if not logprobs:  # nothing to score
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (None if entropy is False else empty)
    return torch.cat(logprobs), (None if entropy is False else torch.cat(ents))
