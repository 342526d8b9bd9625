"""Prefix cache of the built-in engine: KV pages of prefilled prompts, reused by later requests
that start with the same tokens (SGLang's radix cache, at page granularity).

A page is `page_size` tokens. The tree is keyed by a request's KV namespace (the weights, and
after multi-LoRA the adapter, its KV was computed under: KV of one namespace never serves another)
and then by whole pages of token ids; each node holds what the runner stores for one page (its
KV for every layer and, when the engine captures them, the page's routed experts: runner.CachedPage).

Only pages that a prefill computed are stored, and prefills always run page by page on the same
grid (runner.py): so the KV a hit supplies is bit for bit the KV the request would compute
itself (its routes too), and outputs and log-probs are identical with the cache on or off. KV written by decode
steps comes from other matrix shapes (it differs in the last bits), so generated tokens enter the
cache only when a later prompt containing them is prefilled.

Bounded by `max_tokens`: the least recently used leaf pages go first. The scheduler thread owns
it (no locks).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

Page = tuple[int, ...]


@dataclass(eq=False)
class _Node:
    value: Any  # the page's KV (and routes), as the runner stored it; None at a root
    parent: "_Node | None"
    key: Page
    last_used: int = 0
    children: dict[Page, "_Node"] = field(default_factory=dict)


class PrefixCache:
    def __init__(self, page_size: int, max_tokens: int) -> None:
        self.page_size = page_size
        self.max_pages = max_tokens // page_size
        self._roots: dict[Hashable, _Node] = {}
        self._pages = 0
        self._clock = itertools.count(1)

    @property
    def tokens(self) -> int:
        return self._pages * self.page_size

    def flush(self) -> None:
        """Drop everything (`/flush_cache`, and every weight load: old KV must not serve new weights)."""
        self._roots.clear()
        self._pages = 0

    def _pages_of(self, ids: list[int], count: int) -> list[Page]:
        p = self.page_size
        return [tuple(ids[i * p : (i + 1) * p]) for i in range(count)]

    def match(self, namespace: Hashable, ids: list[int], limit: int) -> list[Any]:
        """Stored pages of the longest cached prefix of `ids` within its first `limit` tokens."""
        node, found, now = self._roots.get(namespace), [], next(self._clock)
        if node is None:
            return found
        for page in self._pages_of(ids, limit // self.page_size):
            node = node.children.get(page)
            if node is None:
                break
            node.last_used = now
            found.append(node.value)
        return found

    def insert(self, namespace: Hashable, ids: list[int], pages: int, page_of: Callable[[int], Any]) -> None:
        """Store the first `pages` whole pages of `ids`; `page_of(i)` gives what to store for page i
        (called only for pages not yet stored). Then evict down to the budget."""
        node = self._roots.setdefault(namespace, _Node(None, None, ()))
        now = next(self._clock)
        for i, page in enumerate(self._pages_of(ids, pages)):
            child = node.children.get(page)
            if child is None:
                child = node.children[page] = _Node(page_of(i), node, page)
                self._pages += 1
            child.last_used = now
            node = child
        self._evict()

    def _evict(self) -> None:
        """Least recently used leaves first; a parent left childless becomes a leaf in turn."""
        if self._pages <= self.max_pages:
            return
        heap = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        while self._pages > self.max_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key]
            self._pages -= 1
            if parent.parent is not None and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        for ns in [ns for ns, root in self._roots.items() if not root.children]:
            del self._roots[ns]

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node
