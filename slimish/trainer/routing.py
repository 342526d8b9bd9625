"""Routing replay's bookkeeping, as pure functions: the routes a batch's rows replay, and how often
the trainer's own choices agree with them.

Why: on mixture-of-experts models the largest train-inference mismatch is routing (a near-tie
between two experts goes one way in the engine and the other in the trainer). R3 replays the
engine's choices (`Sample.routed_experts`) in the trainer's forwards; R2 replays the trainer's own
from the old-logprob pass. Both backends build their forced routes here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from slimish.moe import replay_shape
from slimish.types import ROUTES_FLAG, Sample

REPLAYED_STATS = ("route_agree", "route_replayed", "route_tokens")  # additive, summed as batch.py's STAT_KEYS


def batch_routes(samples: list[Sample], width: int, layers: int, top_k: int) -> tuple[Tensor, Tensor]:
    """`(routes [B, width, layers, top_k] int64, valid [B, width] bool)` for right-padded rows of
    `samples`: position p of row b takes `samples[b].routed_experts[p]` where the sample has that
    row. Every other position (the last token, padding, a sample without routes) gets the distinct
    dummy experts 0..top_k-1: a valid top-k, never a repeated expert, and never one a trained token
    depends on (a position's route only reaches the logits of later positions of its own row)."""
    for sample in samples:
        rows = sample.routed_experts
        if rows is not None and len(rows) and rows.shape[1:] != (layers, top_k):
            raise ValueError(
                f"sample {sample.group_id}/{sample.index}: routed_experts rows of shape {tuple(rows.shape[1:])}, "
                f"the model routes [{layers} layers, top-{top_k}]"
            )
    return stack_routes([s.routed_experts for s in samples], width, layers, top_k)


def stack_routes(rows: list[np.ndarray | Tensor | None], width: int, layers: int, top_k: int) -> tuple[Tensor, Tensor]:
    """`batch_routes` of per-row route arrays `[n, layers, top_k]` (None: no routes)."""
    routes = torch.arange(top_k, dtype=torch.long).expand(len(rows), width, layers, top_k).clone()
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r is None or len(r) == 0:
            continue
        n = min(len(r), width)
        routes[b, :n] = torch.as_tensor(r[:n]).long()
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


def route_state(mode: str, config: Any, model: str) -> RouteState | None:
    """The routing state of a trainer of `model` (its HF `config`): None for a dense model, where
    `algorithm.routing_replay` must be none (refused here, when the trainer starts)."""
    shape = replay_shape(mode, config, model)
    if shape is None:
        return None
    text = getattr(config, "text_config", None) or config
    experts = getattr(text, "num_experts", None) or text.n_routed_experts
    return RouteState(mode, *shape, int(experts))


class RouteState:
    """A mixture-of-experts trainer's routing over one RL step. `Trainer` says what each pass is
    for (`measure`: count the statistics, in the one pass at the rollout's weights; `record`: R2's
    old-logprob pass, keep the trainer's own routes); the backend's forwards read and fill the rest."""

    def __init__(self, mode: str, layers: int, top_k: int, experts: int) -> None:
        self.mode, self.layers, self.top_k, self.experts = mode, layers, top_k, experts
        self.measure = self.record = False
        self.recorded: dict[int, Tensor] = {}  # R2: id(sample) -> its own routes [len(tokens), layers, top_k]
        self.reset()

    def reset(self) -> None:
        """A new step: no statistics, no recorded routes."""
        self.recorded.clear()
        self.counts = dict.fromkeys(REPLAYED_STATS, 0.0)
        self.load = torch.zeros(self.layers, self.experts, dtype=torch.float64)  # tokens per expert

    def forced(self, samples: list[Sample], width: int) -> tuple[Tensor, Tensor] | None:
        """`(routes, valid)` a forward of `samples` replays (`stack_routes`'s), None for none: R3
        the rollout's, R2 the old pass's (in every forward of the step but that pass itself)."""
        if self.mode == "r3":
            return batch_routes(samples, width, self.layers, self.top_k)
        if self.mode == "r2" and not self.record:
            return stack_routes([self.recorded.get(id(s)) for s in samples], width, self.layers, self.top_k)
        return None


def check_replayable(samples: list[Sample]) -> None:
    """R3: a trained token's logprob depends on the routes of every position before it, so each
    sample must carry the engine's routes that far."""
    for s in samples:
        trained = [i for i, m in enumerate(s.train_mask) if m]
        if not trained:
            continue
        need = s.prompt_length + trained[-1]  # positions 0 .. prompt_length - 1 + last trained index
        have = 0 if s.routed_experts is None else len(s.routed_experts)
        if have < need:
            raise ValueError(
                f"sample {s.group_id}/{s.index}: routed_experts covers {have} positions, its trained tokens need "
                f"{need}; algorithm.routing_replay=r3 needs the engine's routes on every sample (SGLang's "
                f"{ROUTES_FLAG})"
            )


def replayed_weights(logits: Tensor, indices: Tensor, renormalise: bool) -> Tensor:
    """A router's weights over `indices [T, K]` as transformers computes them over its own top-k:
    softmax in fp32 over every expert, gathered, renormalised to sum 1 iff `norm_topk_prob`, in
    the logits' dtype. The gradient reaches the router through them."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype)


@contextmanager
def patched_routers(layer_routers: dict[int, nn.Module], choose: Callable[[int, Tensor], Tensor]) -> Iterator[None]:
    """Each router's forward (transformers 5's `hidden -> (logits, weights [T, K], indices [T, K])`
    over the flattened `[batch * seq]` tokens) with its indices replaced by `choose(layer, own
    indices)` and its weights recomputed over them (`replayed_weights`); where `choose` returns
    the router's own indices, its outputs pass untouched."""
    for layer, router in layer_routers.items():
        if not hasattr(router, "norm_topk_prob"):
            raise ValueError(
                f"routing replay: the router of layer {layer} ({type(router).__name__}) is not transformers' top-k "
                "router (no norm_topk_prob)"
            )
    saved = {layer: router.__dict__.get("forward") for layer, router in layer_routers.items()}
    for layer, router in layer_routers.items():
        router.forward = _choosing(router, layer, choose)
    try:
        yield
    finally:
        for layer, router in layer_routers.items():
            if saved[layer] is None:
                del router.forward
            else:
                router.forward = saved[layer]


def _choosing(router: nn.Module, layer: int, choose: Callable[[int, Tensor], Tensor]) -> Callable[[Tensor], Any]:
    original = router.forward

    def forward(hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits, weights, own = original(hidden)
        applied = choose(layer, own)
        if applied is own:
            return logits, weights, own
        return logits, replayed_weights(logits, applied, router.norm_topk_prob), applied

    return forward


@contextmanager
def replaying(
    state: RouteState, layer_routers: dict[int, nn.Module], samples: list[Sample], width: int
) -> Iterator[None]:
    """The forward of right-padded rows `samples` (`width` positions) with the routes `state`
    replays where it has some (`RouteState.forced`) and the router's own elsewhere (padding, the
    last token: never a trained token's input). Counts the statistics (`state.measure`) and
    records the own routes (`state.record`) of the pass."""
    rows, layers, k = len(samples), state.layers, state.top_k
    forced = state.forced(samples, width)
    rollout = batch_routes(samples, width, layers, k) if state.measure else None
    real = (torch.arange(width) < torch.tensor([len(s.tokens) for s in samples])[:, None]).reshape(-1)
    own_routes = torch.arange(k).expand(rows, width, layers, k).clone() if state.record else None

    def choose(layer: int, own: Tensor) -> Tensor:
        if own.shape[0] != rows * width:
            raise RuntimeError(f"routing replay: layer {layer} routed {own.shape[0]} tokens, expected {rows}x{width}")
        applied = own
        if forced is not None:
            routes, valid = forced
            routes = routes[:, :, layer].reshape(-1, k).to(own.device)
            applied = torch.where(valid.reshape(-1, 1).to(own.device), routes, own)
        if own_routes is not None:
            own_routes[:, :, layer] = own.view(rows, width, k).cpu()
        if rollout is not None:
            count_routes(state, layer, own, applied, rollout, real.to(own.device))
        return applied

    with patched_routers(layer_routers, choose):
        yield
    if own_routes is not None:
        for b, s in enumerate(samples):
            state.recorded[id(s)] = own_routes[b, : len(s.tokens)].clone()


def count_routes(
    state: RouteState, layer: int, own: Tensor, applied: Tensor, rollout: tuple[Tensor, Tensor], real: Tensor
) -> None:
    """One layer's statistics: own and applied top-k sets against the rollout's, over the tokens
    with rollout routes; tokens per expert over the real (not padding) tokens."""
    routes, valid = rollout
    target = routes[:, :, layer].reshape(-1, state.top_k).to(own.device)
    valid = valid.reshape(-1).to(own.device)
    agree, counted = agreement(own, target, valid)
    replayed, _ = agreement(applied, target, valid)
    state.counts["route_agree"] += float(agree)
    state.counts["route_replayed"] += float(replayed)
    state.counts["route_tokens"] += float(counted)
    state.load[layer] += expert_load(applied, real, state.experts).cpu().double()


def route_metrics(totals: dict[str, float], load: Tensor) -> dict[str, float]:
    """`train/route_agreement` (the trainer's own top-k sets vs the rollout's, each layer's choice
    made on the hidden states it is given: under replay, those of the replayed earlier layers),
    `train/route_replayed` (the routes the forwards applied vs the rollout's: 1 under R3), over
    (token, layer) pairs with rollout routes; per MoE layer max / mean tokens per expert (1 when
    balanced), and the worst layer's."""
    out: dict[str, float] = {}
    if totals["route_tokens"]:
        out["train/route_agreement"] = totals["route_agree"] / totals["route_tokens"]
        out["train/route_replayed"] = totals["route_replayed"] / totals["route_tokens"]
    balance = {layer: float(c.max() / c.mean()) for layer, c in enumerate(load) if c.sum() > 0}
    out.update({f"moe/expert_load_max/layer{layer}": v for layer, v in balance.items()})
    if balance:
        out["train/expert_load_max"] = max(balance.values())
    return out
