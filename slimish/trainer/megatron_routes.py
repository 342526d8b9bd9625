"""Routing replay in the Megatron backend: Megatron-Core's own `RouterReplay`, driven per forward
with the routes `RouteState` (routing.py) says to replay, record or measure.

Why through `RouterReplay` (`moe_enable_routing_replay`): it is the hook Megatron's router calls
for its top-k (`get_replay_topk`), so the weights of the replayed experts are recomputed from the
router's scores and keep their gradient, as in the torch backend. Each model's OWN instances are
driven: `RouterReplay.global_router_replay_instances` is process-wide and grows with every model
built (the reference model, frozen copies), so its `set_replay_data` would refuse or misplace.

The semantics are routing.py's `replaying`: forced routes where a position has some (`valid`),
the router's own elsewhere (padding, the last token, a sample without routes: never an input
of a trained token); statistics in the measuring pass; R2's own routes kept in the recording pass.
Megatron's router sees the tokens of a `[B, S]` micro-batch flattened sequence-major (`[S*B]`,
router.py's `logits.view(-1, E)` of `[S, B, E]`), so routes are transposed to that order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

from slimish.trainer.routing import RouteState, batch_routes, count_routes
from slimish.types import Sample


def _seq_major(t: Tensor) -> Tensor:
    """`[B, S, ...]` -> `[S*B, ...]`, the order of Megatron's router."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def _padded(t: Tensor, rows: int, fill: Tensor | bool) -> Tensor:
    """`t [B, S, ...]` with rows appended up to `rows` (lockstep pad rows and filler micro-batches)."""
    extra = rows - t.shape[0]
    if extra <= 0:
        return t
    pad = (fill if torch.is_tensor(fill) else torch.tensor(fill)).expand(extra, *t.shape[1:]).to(t.dtype)
    return torch.cat([t, pad])


class MegatronRoutes:
    """A Megatron trainer's routing replay: `install` on each model built, `forward` around each
    micro-batch's forward. `first_layer`: the global index of this pipeline stage's first layer."""

    def __init__(self, state: RouteState, first_layer: int) -> None:
        self.state, self.first_layer = state, first_layer
        self._pass: dict[str, Any] | None = None  # the forward in progress

    def install(self, model: torch.nn.Module) -> None:
        """Wrap the top-k of each router replay instance of `model` (built with
        `moe_enable_routing_replay`) so that it follows `forward`'s plan."""
        for local, inst in enumerate(self._instances(model)):
            inst.get_replay_topk = self._topk(inst, self.first_layer + local)

    @staticmethod
    def _instances(model: torch.nn.Module) -> list[RouterReplay]:
        found = [m.router_replay for m in model.modules() if isinstance(m, TopKRouter)]
        if not found or any(r is None for r in found):
            raise RuntimeError("routing replay: the model was not built with moe_enable_routing_replay")
        return found

    @contextmanager
    def forward(self, model: torch.nn.Module, samples: list[Sample], rows: int, width: int) -> Iterator[None]:
        """The forward of `samples`, right-padded to `[rows, width]`, under `RouteState`'s plan."""
        st, k = self.state, self.state.top_k
        dummy = torch.arange(k)
        forced = st.forced(samples, width)
        if forced is not None:
            routes, valid = forced
            forced = (_seq_major(_padded(routes, rows, dummy)), _seq_major(_padded(valid, rows, False)))
        rollout = None
        if st.measure:
            routes, valid = batch_routes(samples, width, st.layers, k)
            # batch_routes' layout ([1, S*B, ...]: one row of every token) in the router's order
            rollout = (_seq_major(_padded(routes, rows, dummy))[None], _seq_major(_padded(valid, rows, False))[None])
        lengths = torch.tensor([len(s.tokens) for s in samples] + [0] * (rows - len(samples)))
        real = _seq_major(torch.arange(width) < lengths[:, None])
        instances = self._instances(model)
        for local, inst in enumerate(instances):
            inst.clear_indices()  # else set_target_indices' backward list grows without end
            if forced is not None:
                inst.set_target_indices(forced[0][:, self.first_layer + local])
                inst.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                inst.set_router_replay_action(RouterReplayAction.RECORD)
        self._pass = {"valid": None if forced is None else forced[1], "rollout": rollout, "real": real}
        try:
            yield
            if st.record:
                self._keep(instances, samples, rows, width)
        finally:
            self._pass = None
            for inst in instances:
                inst.clear_indices()
                inst.clear_router_replay_action()

    def _keep(self, instances: list[RouterReplay], samples: list[Sample], rows: int, width: int) -> None:
        """R2: each sample's own routes of this stage's layers, `[len(tokens), layers, top_k]`."""
        st = self.state
        own = torch.arange(st.top_k).expand(rows, width, st.layers, st.top_k).clone()
        for local, inst in enumerate(instances):
            own[:, :, self.first_layer + local] = (
                inst.get_recorded_indices().view(width, rows, -1).transpose(0, 1).cpu()
            )
        for b, s in enumerate(samples):
            st.recorded[id(s)] = own[b, : len(s.tokens)].clone()

    def _topk(self, inst: RouterReplay, layer: int) -> Callable[..., tuple[Tensor, Tensor]]:
        def topk(scores: Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None):
            plan = self._pass
            if plan is None:
                return RouterReplay.get_replay_topk(inst, scores, topk, num_groups, group_topk, default_compute_topk)
            with torch.no_grad():
                own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
            if inst.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                valid = plan["valid"].to(scores.device)[:, None]
                inst.target_topk_idx = torch.where(valid, inst.target_topk_idx.to(scores.device), own)
            probs, applied = RouterReplay.get_replay_topk(
                inst, scores, topk, num_groups, group_topk, default_compute_topk
            )
            if plan["rollout"] is not None:
                count_routes(self.state, layer, own, applied, plan["rollout"], plan["real"].to(scores.device))
            return probs, applied

        return topk
