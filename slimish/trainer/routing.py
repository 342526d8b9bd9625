"""Routing replay's bookkeeping, as pure functions: the routes a batch's rows replay, and how often
the trainer's own choices agree with them.

Why: on mixture-of-experts models the largest train-inference mismatch is routing (a near-tie
between two experts goes one way in the engine and the other in the trainer). R3 replays the
engine's choices (`Sample.routed_experts`) in the trainer's forwards; R2 replays the trainer's own
from the old-logprob pass. Both backends build their forced routes here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimish.types import Sample


def batch_routes(samples: list[Sample], width: int, layers: int, top_k: int) -> tuple[Tensor, Tensor]:
    """`(routes [B, width, layers, top_k] int64, valid [B, width] bool)` for right-padded rows of
    `samples`: position p of row b takes `samples[b].routed_experts[p]` where the sample has that
    row. Every other position (the last token, padding, a sample without routes) gets the distinct
    dummy experts 0..top_k-1: a valid top-k, never a repeated expert, and never one a trained token
    depends on (a position's route only reaches the logits of later positions of its own row)."""
    dummy = torch.arange(top_k, dtype=torch.long)
    routes = dummy.expand(len(samples), width, layers, top_k).clone()
    valid = torch.zeros(len(samples), width, dtype=torch.bool)
    for b, sample in enumerate(samples):
        rows = sample.routed_experts
        if rows is None or len(rows) == 0:
            continue
        if rows.shape[1:] != (layers, top_k):
            raise ValueError(
                f"sample {sample.group_id}/{sample.index}: routed_experts rows of shape {tuple(rows.shape[1:])}, "
                f"the model routes [{layers} layers, top-{top_k}]"
            )
        n = min(len(rows), width)
        routes[b, :n] = torch.from_numpy(rows[:n]).long()
        valid[b, :n] = True
    return routes, valid


def agreement(own: Tensor, forced: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """`(agreeing, counted)`: of the `valid` tokens (`own`, `forced`: `[T, K]` expert ids of one
    layer, `valid`: `[T]`), how many chose the same set of experts (order within the top-k is not a
    decision: the weights are per expert)."""
    same = (own.sort(-1).values == forced.sort(-1).values).all(-1)
    return (same & valid).sum(), valid.sum()


def expert_load(indices: Tensor, valid: Tensor, num_experts: int) -> Tensor:
    """Tokens routed to each expert (`[num_experts]`) by one layer's `indices [T, K]` over the
    `valid [T]` tokens: the load balance the metrics report."""
    chosen = indices[valid].reshape(-1)
    return torch.bincount(chosen, minlength=num_experts)
