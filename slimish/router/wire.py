"""The router's HTTP/1.1 server: raw asyncio protocols and httptools, no ASGI on the hot path.

Why not uvicorn: a proxy's work per request is small, so the server's own is most of it. Behind
uvicorn, Starlette and the aiohttp client a router process spent 140-160 us of CPU per request
against sglang-router's 42-78 (benchmarks/router_overhead.py); on this server and upstream.py's
client it spends ~50. Here a request is parsed by httptools, handed to an async handler with the
connection as its responder, and the reply is written as bytes. Routes that are not hot (registry,
admin, health) still run on FastAPI through `asgi`, a buffered ASGI bridge.

One request at a time per connection, in order; a client may queue (pipeline) up to PIPELINE
more before reading pauses. Reading goes on while a request is handled so that a client that
goes away is seen at once: its handler is cancelled, the upstream request dropped, and the
engine aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, AsyncContextManager, Awaitable, Callable, Iterable
from urllib.parse import unquote

import httptools

log = logging.getLogger("slimish.router")

KEEPALIVE_S = 5.0  # idle client connections are closed after this, as uvicorn does: clients drop theirs sooner
GRACE_S = 10.0  # on stop, requests in flight get this long to finish before they are cancelled
PIPELINE = 8  # requests a client may queue on one connection before reading pauses
MAX_HEAD = 64 << 10  # bytes of request line and headers
PHRASES = {s.value: s.phrase.encode() for s in HTTPStatus}


@dataclass(slots=True)
class ClientRequest:
    """A client's request as the server parsed it: the body whole, read to the size limit."""

    method: str
    path: str  # percent-decoded, without the query
    raw_path: bytes
    query: bytes
    headers: dict[str, str]  # names lower-cased; a repeated header's values joined by ", "
    body: bytes
    client: tuple[str, int] | None


Handler = Callable[[ClientRequest, "Connection"], Awaitable[None]]


class Connection(asyncio.Protocol):
    """One client connection; also the responder a handler writes its reply to, once: `reply`
    for a whole body, or `start`, `send`..., `end` for a chunked stream."""

    def __init__(self, server: "_Server") -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.disconnected = server.loop.create_future()  # done when the client has gone
        self._pending: deque[tuple[ClientRequest, bool]] = deque()
        self._task: asyncio.Task | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future | None = None
        self._url, self._headers, self._body, self._size, self._refused = b"", {}, [], 0, False
        self._receiving = self._paused = False
        self._keep_alive, self._head_only = True, False
        self._state = "idle"  # of the reply being written: idle, streaming, done

    # ---- reading ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self._idle = self.server.loop.call_later(KEEPALIVE_S, self._close_if_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if not self.disconnected.done():
            self.disconnected.set_result(None)
        if self._idle is not None:
            self._idle.cancel()
        if self._task is not None:
            self._task.cancel()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades (HTTP/2, websockets) are not served; speak HTTP/1.1")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size, self._receiving = b"", {}, [], 0, True
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._size += len(url)
        if self._size > MAX_HEAD:
            self._refuse(431, f"request line and headers exceed {MAX_HEAD} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._size += len(name) + len(value)
        if self._size > MAX_HEAD:
            return self._refuse(431, f"request line and headers exceed {MAX_HEAD} bytes")
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def on_headers_complete(self) -> None:
        self._size = 0  # from here on, the body's
        declared = self._headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.server.max_body:
            return self._refuse(
                413,
                f"request body is {declared} bytes; the router accepts at most {self.server.max_body} (--max-body-bytes)",
            )
        if self._headers.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body:
            return self._refuse(
                413, f"request body exceeds {self.server.max_body} bytes, the router's limit (--max-body-bytes)"
            )
        if not self._refused:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self._receiving = False
        if self._refused:
            return
        raw, _, query = self._url.partition(b"?")
        peer = self.transport.get_extra_info("peername")  # type: ignore[union-attr]
        request = ClientRequest(
            self.parser.get_method().decode("latin-1"),
            unquote(raw.decode("latin-1")),
            raw,
            query,
            self._headers,
            b"".join(self._body),
            peer[:2] if isinstance(peer, tuple) else None,
        )
        self._pending.append((request, self.parser.should_keep_alive()))
        if len(self._pending) >= PIPELINE:
            self._paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        if self._task is None:
            self._task = self.server.loop.create_task(self._serve_pending())

    async def _serve_pending(self) -> None:
        try:
            while self._pending and not self.disconnected.done():
                request, self._keep_alive = self._pending.popleft()
                self._state, self._head_only = "idle", request.method == "HEAD"
                try:
                    await self.server.handler(request, self)
                except Exception:
                    log.exception("%s %s failed in the router", request.method, request.path)
                    if self._state == "idle":
                        self.error(500, "internal router error; see the router log")
                if self._state != "done" or not self._keep_alive or self._refused or self.server.stopping:
                    self.transport.close()  # type: ignore[union-attr]  # a half-written reply cannot be followed
        finally:
            self._task = None
        if not self.transport.is_closing():  # type: ignore[union-attr]
            if self._paused:
                self._paused = False
                self.transport.resume_reading()  # type: ignore[union-attr]
            self._idle = self.server.loop.call_later(KEEPALIVE_S, self._close_if_idle)

    def _close_if_idle(self) -> None:
        if self._task is None and not self._pending and not self._receiving:
            self.transport.close()  # type: ignore[union-attr]

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the parser or the limits refused, and close: the rest of its bytes
        cannot be read as anything."""
        if self._refused:
            return
        self._refused = True
        if self._task is not None:  # a reply is being written: no more reading; closed after it
            self.transport.pause_reading()  # type: ignore[union-attr]
        elif self.transport is not None and not self.transport.is_closing():
            self._keep_alive, self._state = False, "idle"
            self.error(status, message)
            self.transport.close()

    # ---- writing ----------------------------------------------------------------------------

    def _head(self, status: int, headers: Iterable[tuple[str, str]], framing: bytes) -> bytes:
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, PHRASES.get(status, b"")), framing]
        lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers]
        if not self._keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def reply(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> None:
        """The whole reply; its content-length is set here."""
        assert self._state == "idle", "a reply was already written"
        self._state = "done"
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(
            self._head(status, headers, b"content-length: %d\r\n" % len(body)) + (b"" if self._head_only else body)
        )

    def error(self, status: int, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        """An error reply, as the router and SGLang's OpenAI routes answer one."""
        self.reply(status, error_body(status, message), [("content-type", "application/json"), *headers])

    def start(self, status: int, headers: Iterable[tuple[str, str]] = ()) -> None:
        """A reply whose body follows in `send` calls (chunked)."""
        assert self._state == "idle", "a reply was already written"
        self._state = "streaming"
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self._head(status, headers, b"transfer-encoding: chunked\r\n"))

    async def send(self, chunk: bytes) -> None:
        """One chunk of a started reply; waits while the client reads slower than we write.
        Raises ConnectionResetError once the client has gone."""
        if self.disconnected.done():
            raise ConnectionResetError("the client closed the connection")
        if chunk:
            self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))  # type: ignore[union-attr]
        if self._drained is not None:
            await self._drained

    def end(self) -> None:
        assert self._state == "streaming", "end() without start()"
        self._state = "done"
        if not self.disconnected.done():
            self.transport.write(b"0\r\n\r\n")  # type: ignore[union-attr]

    def pause_writing(self) -> None:
        self._drained = self.server.loop.create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None


def error_body(status: int, message: str) -> bytes:
    """The body of `Connection.error` (and of the FastAPI routes' errors)."""
    return json.dumps({"error": {"message": message, "code": status}}).encode()


class _Server:
    def __init__(self, handler: Handler, max_body: int) -> None:
        self.handler, self.max_body = handler, max_body
        self.loop = asyncio.get_running_loop()
        self.connections: set[Connection] = set()
        self.stopping = False


async def serve(
    handler: Handler,
    sockets: list[socket.socket],
    *,
    max_body: int,
    lifespan: AsyncContextManager | None = None,
    ready: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
    signals: bool = False,
) -> None:
    """Serve on `sockets` (bound, not listening) until `stop` is set, or SIGTERM / SIGINT when
    `signals`. `lifespan` is entered before the first request is taken and left after the last
    reply; `ready` is called in between."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT) if signals else ():
        loop.add_signal_handler(sig, stop.set)
    state = _Server(handler, max_body)
    async with lifespan or contextlib.nullcontext():
        servers = [await loop.create_server(lambda: Connection(state), sock=sock, backlog=2048) for sock in sockets]
        if ready is not None:
            ready()
        await stop.wait()
        state.stopping = True
        for server in servers:
            server.close()
        busy = [c._task for c in state.connections if c._task is not None]
        for conn in list(state.connections):
            if conn._task is None:
                conn.transport.close()  # type: ignore[union-attr]
        if busy:
            _, late = await asyncio.wait(busy, timeout=GRACE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)


def bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to host:port (not listening yet); a clear error naming the flag."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"--port {port}: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def run(main: Awaitable[Any]) -> Any:
    """`main` on uvloop where it is installed (measured: 55 against 60 us of router CPU per request)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)  # type: ignore[arg-type]
    return uvloop.run(main)  # type: ignore[arg-type]


# ---- the rest of the routes: FastAPI, through a buffered ASGI bridge ---------------------------


async def asgi(app: Callable, request: ClientRequest, out: Connection) -> None:
    """`request` through an ASGI app, its reply collected and written whole (admin routes: small
    bodies, no streams)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.raw_path,
        "query_string": request.query,
        "root_path": "",
        "client": request.client,
        "server": None,
        "state": {},
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
    }
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await asyncio.shield(out.disconnected)
        return {"type": "http.disconnect"}

    start: dict[str, Any] = {}
    body: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:
        if not start:
            raise  # the connection answers it with a 500
        log.exception("%s %s failed after its reply started", request.method, request.path)
    headers = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in start.get("headers", ())
        if k.lower() != b"content-length"
    ]
    out.reply(start["status"], b"".join(body), headers)
