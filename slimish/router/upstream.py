"""The router's client to its workers on the hot path: keep-alive HTTP/1.1 over asyncio protocols.

Why not aiohttp here: it was half of a router process's CPU per forwarded request (cProfile,
concurrency 64); this does the one thing the proxy needs (send bytes, get status, headers and
body, or the body as it streams) for a fraction. Control requests, health checks and fan-outs
keep aiohttp: they are rare, and want its generality.

A connection serves one request at a time and goes back to its worker's pool when its reply was
read whole and the worker keeps it alive; idle ones older than `keepalive_timeout` are dropped
(the engines close theirs at 5 s). A request on a reused connection that the worker had already
closed is sent once more on a fresh one: it never reached the worker.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import AsyncIterator
from urllib.parse import urlsplit

import httptools


class ConnectFailed(Exception):
    """No connection to the worker (refused, unreachable, or not within the connect timeout)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class Disconnected(Exception):
    """The worker closed or broke the connection before its reply was complete."""


class WorkerReply(asyncio.Protocol):
    """A worker's reply to one request, read on a connection to it (pooled: the next request on the
    same connection gets a fresh object, so the parser and state start clean)."""

    def __init__(self, pool: "_Pool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.headers = 0, {}  # type: ignore[var-annotated]
        self.complete, self.keep_alive, self.got_bytes = False, False, False
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future | None = None
        self._streaming = False
        self._error: Exception | None = None
        self._deadline = 0.0  # of the whole reply (loop time); set when the request is sent

    # ---- protocol callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.forget(self)
        if not self.complete:
            self._fail(
                Disconnected("the worker closed the connection" if exc is None else f"{type(exc).__name__}: {exc}")
            )

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Disconnected(f"malformed reply: {exc}"))
            self.transport.close()  # type: ignore[union-attr]

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self._streaming:
            self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        if self._streaming:
            self._wake()

    def on_message_complete(self) -> None:
        self.complete, self.keep_alive = True, self.parser.should_keep_alive()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        self._error = exc
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    # ---- the caller's side ----------------------------------------------------------------

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip()

    async def _wait(self, timeout: float) -> None:
        if self._error is not None:
            raise self._error
        loop = self.pool.loop
        self._waiter = waiter = loop.create_future()
        expire = loop.call_later(timeout, lambda: waiter.done() or waiter.set_exception(asyncio.TimeoutError()))
        try:
            await waiter
        finally:
            expire.cancel()
            self._waiter = None

    async def read(self) -> bytes:
        """The whole body, within the timeout `Upstream.send` was given."""
        self._streaming = False
        while not self.complete:
            await self._wait(max(0.0, self._deadline - self.pool.loop.time()))
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    async def chunks(self, timeout: float) -> AsyncIterator[bytes]:
        """The body as it arrives; `timeout` bounds the wait for each piece."""
        self._streaming = True
        while True:
            while self._chunks:
                yield self._chunks.popleft()
            if self.complete:
                return
            await self._wait(timeout)

    async def exchange(self, message: bytes, timeout: float) -> "WorkerReply":
        """Write the request `message`; return once the reply's status and headers are in (the
        connection is closed if they are not: nothing else can be sent on it)."""
        self._streaming = True  # wake at the headers
        self._deadline = self.pool.loop.time() + timeout
        if self.transport.is_closing():  # type: ignore[union-attr]
            # The worker reset it between connect and now (a worker being killed accepts, then
            # resets): nothing was sent, so the request can go elsewhere. uvloop's write would
            # raise RuntimeError, asyncio's would drop the bytes and wait for the timeout.
            raise self._error or Disconnected("the worker closed the connection before the request was sent")
        self.transport.write(message)  # type: ignore[union-attr]
        try:
            while not self.status:
                await self._wait(max(0.0, self._deadline - self.pool.loop.time()))
        except BaseException:
            self.transport.close()  # type: ignore[union-attr]
            raise
        return self

    def release(self) -> None:
        """Done with this reply: the connection goes back to the pool if it can carry another."""
        if self.complete and self.keep_alive and self._error is None and not self.transport.is_closing():  # type: ignore[union-attr]
            self.pool.put(self)
        else:
            self.transport.close()  # type: ignore[union-attr]


class _Pool:
    """Idle connections to one worker, most recently used first."""

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop, keepalive_timeout: float) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.ssl = parts.hostname, parts.port, parts.scheme == "https"
        self.host_header = parts.netloc.encode("latin-1")
        self.loop, self.keepalive_timeout = loop, keepalive_timeout
        self.idle: list[tuple[float, WorkerReply]] = []

    def take(self) -> WorkerReply | None:
        while self.idle:
            since, conn = self.idle.pop()
            if time.monotonic() - since < self.keepalive_timeout and not conn.transport.is_closing():  # type: ignore[union-attr]
                return conn
            conn.transport.close()  # type: ignore[union-attr]
        return None

    def put(self, used: WorkerReply) -> None:
        fresh = WorkerReply(self)  # a reply object per request: the parser and state start clean
        fresh.transport, fresh.parser = used.transport, httptools.HttpResponseParser(fresh)
        used.transport.set_protocol(fresh)  # type: ignore[union-attr]
        self.idle.append((time.monotonic(), fresh))

    def forget(self, conn: WorkerReply) -> None:
        self.idle = [(t, c) for t, c in self.idle if c is not conn]

    async def connect(self, timeout: float) -> WorkerReply:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: WorkerReply(self), self.host, self.port, ssl=self.ssl or None),
                timeout,
            )
        except asyncio.TimeoutError:
            raise ConnectFailed(f"cannot connect within {timeout:g} s", timed_out=True) from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect ({exc.strerror or exc})") from None
        return conn  # type: ignore[return-value]


class Upstream:
    """Connection pools to every worker this router process has sent to."""

    def __init__(self, connect_timeout: float, keepalive_timeout: float) -> None:
        self.connect_timeout, self.keepalive_timeout = connect_timeout, keepalive_timeout
        self._pools: dict[str, _Pool] = {}

    async def send(
        self, url: str, method: str, path: str, body: bytes | None, headers: dict[str, str], timeout: float
    ) -> WorkerReply:
        """Send a request to the worker at `url`; the reply once its status and headers are in
        (read its body with `read` or `chunks`, then `release` it). Raises ConnectFailed,
        Disconnected, or asyncio.TimeoutError when the headers, or `read`'s whole body, are not in
        within `timeout` of sending."""
        pool = self._pools.get(url)
        if pool is None:
            pool = self._pools[url] = _Pool(url, asyncio.get_running_loop(), self.keepalive_timeout)
        payload = body or b""
        head = [
            b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n"
            % (method.encode(), path.encode(), pool.host_header, len(payload))
        ]
        head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()]
        message = b"".join(head) + b"\r\n" + payload
        conn = pool.take()
        if conn is not None:
            try:
                return await conn.exchange(message, timeout)
            except Disconnected:
                if conn.got_bytes:
                    raise  # the worker answered, then broke: not a stale connection
        return await (await pool.connect(self.connect_timeout)).exchange(message, timeout)

    def close(self) -> None:
        for pool in self._pools.values():
            while (conn := pool.take()) is not None:
                conn.transport.close()  # type: ignore[union-attr]
