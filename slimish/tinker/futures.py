"""Tinker's request futures: every call answers a `request_id` at once; `/retrieve_future` long-polls it.

Training work (every model's forward_backward chunks, optim steps, saves and loads) runs on ONE
worker thread: the models share one base model and PEFT's active adapter is global state, and the
CPUs gain nothing from two torch jobs at once. Each model's requests run in its `seq_id` order
(1, 2, ...), whatever order their HTTP requests arrive in: the SDK numbers them per training client
and sends a forward_backward's chunks concurrently, its first chunk last (tinker 0.38.0:
lib/public_interfaces/training_client.py:273-301, 446-458). A seq_id that never comes (a client
that reserved one and died) holds its model's later requests `gap_s` seconds, then they run.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# A finished result stays retrievable this long after it was first handed out (the SDK polls again only
# when a reply was lost), and this long if it never was.
KEEP_DELIVERED_S, KEEP_DONE_S = 120.0, 3600.0


@dataclass
class Result:
    """A finished request's result: a JSON object, or protobuf bytes (ForwardBackwardOutput, SampleResponse)."""

    body: dict[str, Any] | bytes

    @property
    def proto(self) -> bool:
        return isinstance(self.body, bytes)


class UserError(ValueError):
    """A request the server refuses for what it asks (category "user" on the wire, not retried)."""


def failure(exc: BaseException) -> dict[str, str]:
    """The SDK's failed-request body (tinker 0.38.0: lib/api_future_impl.py:471-478): bad input is the
    user's (ValueError, KeyError naming what is unknown); anything else is the server's, logged in full."""
    if isinstance(exc, (ValueError, KeyError)):
        return {"error": str(exc.args[0]) if exc.args else type(exc).__name__, "category": "user"}
    log.error("request failed: %s", "".join(traceback.format_exception(exc)))
    return {"error": f"{type(exc).__name__}: {exc}", "category": "server"}


@dataclass
class _Entry:
    future: asyncio.Future[Result]
    done_at: float | None = None
    delivered_at: float | None = None


class Futures:
    """request_id -> the eventual Result, for `/retrieve_future`."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self._entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)
        self._swept = 0.0

    def start(self, work: Awaitable[Result]) -> str:
        """Run `work` as a request; its id, answered at once."""
        return self.track(asyncio.ensure_future(work))

    def track(self, future: asyncio.Future[Result]) -> str:
        """A running request's id."""
        self._forget_old()
        request_id = f"req-{next(self._ids)}"
        entry = _Entry(future)
        self._entries[request_id] = entry
        future.add_done_callback(lambda _: setattr(entry, "done_at", time.monotonic()))
        return request_id

    async def retrieve(self, request_id: str) -> Result | dict[str, str] | None:
        """The result (a Result, or the failure body), or None when it is still running after `poll_s`.
        KeyError for an id this server never gave."""
        entry = self._entries[request_id]
        try:
            result = await asyncio.wait_for(asyncio.shield(entry.future), self.poll_s)
        except TimeoutError:
            return None
        except Exception as exc:  # noqa: BLE001 - the request's own failure, whatever it is, goes to the client
            result = failure(exc)
        entry.delivered_at = entry.delivered_at or time.monotonic()
        return result

    def _forget_old(self) -> None:
        now = time.monotonic()
        if now - self._swept < 1.0:  # a sweep a second at most: a busy RL step starts thousands of samples
            return
        self._swept = now
        old = [
            rid
            for rid, e in self._entries.items()
            if (e.delivered_at is not None and now - e.delivered_at > KEEP_DELIVERED_S)
            or (e.done_at is not None and now - e.done_at > KEEP_DONE_S)
        ]
        for rid in old:
            del self._entries[rid]


@dataclass
class _Queue:
    next_seq: int = 1
    waiting: dict[int, tuple[Callable[[], Any], asyncio.Future[Any]]] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task | None = None


class Ordered:
    """Each model's training requests in seq_id order, all models' on one worker thread."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")
        self._queues: dict[str, _Queue] = {}

    async def run(self, fn: Callable[[], Any]) -> Any:
        """`fn` on the worker thread, outside any model's order (create_model, a fresh load)."""
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn)

    def submit(self, model_id: str, seq_id: int, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """`fn`'s eventual result, run once every earlier seq_id of `model_id` has run."""
        q = self._queues.setdefault(model_id, _Queue())
        if seq_id < q.next_seq or seq_id in q.waiting:
            raise UserError(f"seq_id: {seq_id} of {model_id} was already sent (the next expected is {q.next_seq})")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        q.waiting[seq_id] = (fn, future)
        q.arrived.set()
        if q.pump is None or q.pump.done():
            q.pump = asyncio.ensure_future(self._pump(model_id, q))
        return future

    def forget(self, model_id: str) -> None:
        """Drop a released model's queue; requests still waiting for an earlier seq_id fail."""
        q = self._queues.pop(model_id, None)
        for _, future in q.waiting.values() if q else ():
            future.set_exception(UserError(f"model_id: {model_id} was released (its session finished)"))

    async def _pump(self, model_id: str, q: _Queue) -> None:
        loop = asyncio.get_running_loop()
        while q.waiting:
            if q.next_seq not in q.waiting:
                q.arrived.clear()
                try:
                    await asyncio.wait_for(q.arrived.wait(), self.gap_s)
                    continue
                except TimeoutError:
                    later = min(q.waiting)
                    log.warning(
                        "%s: seq_id %d never came in %.0f s; running %d", model_id, q.next_seq, self.gap_s, later
                    )
                    q.next_seq = later
            fn, future = q.waiting.pop(q.next_seq)
            q.next_seq += 1
            try:
                future.set_result(await loop.run_in_executor(self.worker, fn))
            except Exception as exc:  # noqa: BLE001 - handed to the request's future, reported by retrieve
                future.set_exception(exc)

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
