"""Routing policies: given the routable workers and what the router knows of a request, pick one.

A policy sees only `Worker.id` and `Worker.inflight`, and keeps its own small state (a counter,
an LRU of prefix blocks or session pins), so each can be tested without servers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol, Sequence

from slimish.router.config import RouterConfig
from slimish.router.workers import Worker


@dataclass(frozen=True)
class RouteInfo:
    """What a policy may use: the prompt (text, or token ids) and the session routing key; and the
    LoRA adapters the request needs (the proxy offers only workers that hold them)."""

    prompt: str | list[int] | None = None
    routing_key: str | None = None
    adapters: frozenset[str] = frozenset()
    route: str = "/generate"  # with `model` (the body's): which workers may serve it (proxy.serving)
    model: str | None = None


class Policy(Protocol):
    needs_prompt: bool

    def pick(self, workers: Sequence[Worker], info: RouteInfo) -> Worker: ...


class LeastInflight:
    """Fewest open requests; ties rotate, so an idle pool is still used evenly."""

    needs_prompt = False

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, workers: Sequence[Worker], info: RouteInfo) -> Worker:
        n = len(workers)
        self._turn = (self._turn + 1) % n
        best = workers[self._turn]
        for i in range(1, n):
            w = workers[(self._turn + i) % n]
            if w.inflight < best.inflight:
                best = w
        return best


class RoundRobin:
    needs_prompt = False

    def __init__(self) -> None:
        self._next = 0

    def pick(self, workers: Sequence[Worker], info: RouteInfo) -> Worker:
        w = workers[self._next % len(workers)]
        self._next += 1
        return w


def rendezvous(workers: Sequence[Worker], key: bytes) -> Worker:
    """The worker `key` belongs to: highest hash of (key, worker URL). A pure function of the key
    and the worker set, so every router process picks the same one (`--processes N`), and a
    worker leaving or joining moves only the keys it wins or held. blake2b, not `hash()`:
    `hash()` of text differs between processes."""
    digest = blake2b(key, digest_size=16).digest()
    return max(workers, key=lambda w: blake2b(digest + w.url.encode(), digest_size=8).digest())


def prompt_bytes(prompt: str | list[int]) -> bytes:
    return (prompt if isinstance(prompt, str) else str(prompt)).encode()


class _LRU(OrderedDict):
    def __init__(self, max_items: int) -> None:
        super().__init__()
        self.max_items = max_items

    def put(self, key: object, value: str) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.max_items:
            self.popitem(last=False)


class CacheAware:
    """Prefix affinity: a prompt goes where its longest prefix went before.

    The prompt is cut into blocks (`cache_block_size` token ids, or 4x as many characters of
    text) and each prefix is keyed by a chained hash of its blocks, the way prefix caches key KV
    blocks. A table maps prefix keys to the worker that last served them. When at least
    `cache_threshold` of the prompt's blocks match, the request follows them; otherwise, or when
    the load is unbalanced past the thresholds (as sglang-router decides it), the least loaded
    worker takes it. Either way the prompt's prefixes then point at the chosen worker.

    With several router processes each keeps its own table, and a prompt no table has seen goes
    by rendezvous hashing of the whole prompt instead of to the least loaded: identical prompts
    (a GRPO group) meet on one worker whichever process takes them.
    """

    needs_prompt = True

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self._owner = _LRU(cfg.cache_max_blocks)
        self._fallback = LeastInflight()
        self._shared = cfg.processes > 1

    def prefix_keys(self, prompt: str | list[int]) -> list[int]:
        size = self.cfg.cache_block_size * (4 if isinstance(prompt, str) else 1)
        keys, h = [], 0
        for start in range(0, len(prompt), size):
            block = prompt[start : start + size]
            h = hash((h, block if isinstance(block, str) else tuple(block)))
            keys.append(h)
        return keys

    def unbalanced(self, workers: Sequence[Worker]) -> bool:
        loads = [w.inflight for w in workers]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.cfg.balance_abs_threshold and hi > self.cfg.balance_rel_threshold * lo

    def pick(self, workers: Sequence[Worker], info: RouteInfo) -> Worker:
        if not info.prompt:
            return self._fallback.pick(workers, info)
        keys = self.prefix_keys(info.prompt)
        choice = None
        balanced = not self.unbalanced(workers)
        if balanced:
            by_id = {w.id: w for w in workers}
            for matched in range(len(keys), 0, -1):
                owner = by_id.get(self._owner.get(keys[matched - 1]))
                if owner is not None:
                    if matched / len(keys) >= self.cfg.cache_threshold:
                        choice = owner
                    break
        if choice is None:
            shared = self._shared and balanced
            choice = rendezvous(workers, prompt_bytes(info.prompt)) if shared else self._fallback.pick(workers, info)
        for key in keys:
            self._owner.put(key, choice.id)
        return choice


class Session:
    """Sticky on the routing key, so a multi-turn agent keeps its KV cache on one engine.

    Without a key, least_inflight decides. A key whose worker is gone (unhealthy, removed, or
    just failed this request) is pinned anew.

    With several router processes (`--processes N`) a pin kept in one process would not be seen by
    the others, so the key's worker is the rendezvous hash of the key over the routable workers:
    the same in every process, and it moves only when that worker leaves.
    """

    needs_prompt = False

    def __init__(self, cfg: RouterConfig) -> None:
        self._pins = _LRU(cfg.max_sessions)
        self._fallback = LeastInflight()
        self._shared = cfg.processes > 1

    def pick(self, workers: Sequence[Worker], info: RouteInfo) -> Worker:
        if info.routing_key is None:
            return self._fallback.pick(workers, info)
        if self._shared:
            return rendezvous(workers, info.routing_key.encode())
        pinned = self._pins.get(info.routing_key)
        choice = next((w for w in workers if w.id == pinned), None) or self._fallback.pick(workers, info)
        self._pins.put(info.routing_key, choice.id)
        return choice


def make_policy(cfg: RouterConfig) -> Policy:
    if cfg.policy == "least_inflight":
        return LeastInflight()
    if cfg.policy == "round_robin":
        return RoundRobin()
    if cfg.policy == "cache_aware":
        return CacheAware(cfg)
    return Session(cfg)
