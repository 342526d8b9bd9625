"""The router's own HTTP/1.1 server and upstream client (wire.py, upstream.py) at the byte level:
pipelining, limits on bodies and headers, `Expect: 100-continue`, malformed input, a client that leaves, a worker that
drops a kept-alive connection, and a graceful stop.

The router runs on this test's event loop in front of a raw-asyncio worker whose behaviour each
request's body picks: answer at once, answer after a delay, never answer, or close the kept-alive
connection without answering. Clients are raw sockets, so every byte on the wire is the test's.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import uvloop

from slimish.router.app import create_app
from slimish.router.config import RouterConfig
from slimish.router.upstream import Disconnected, _Pool
from slimish.router.wire import bind

REPLY = b'{"text": "a", "output_ids": [5], "meta_info": {"id": "0"}}'


class Worker(asyncio.Protocol):
    """A worker that keeps its connections alive; `seen` counts /generate requests per connection."""

    connections: list["Worker"] = []

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport, self.buf, self.generates, self.gone = transport, b"", 0, asyncio.Event()
        Worker.connections.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].decode("latin-1").lower()
            length = int(head.split("content-length:")[1].split("\r\n")[0]) if "content-length:" in head else 0
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
            if not head.startswith("post /generate"):
                self.answer(b"{}")
                continue
            self.generates += 1
            how = json.loads(body).get("how", "now")
            if how == "now":
                self.answer(REPLY)
            elif how == "later":
                asyncio.get_running_loop().call_later(0.3, self.answer, REPLY)
            elif how == "drop-second" and self.generates == 2:
                self.transport.close()  # as a worker closing an idle kept-alive connection does
            elif how == "drop-second":
                self.answer(REPLY)
            elif how.startswith("stream"):
                self.transport.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                asyncio.get_running_loop().create_task(self.stream(how))
            # "never": no answer

    async def stream(self, how: str) -> None:
        """Events 0, 1, ...: `stream` sends 3 and ends; `stream-break` breaks the connection after
        2; `stream-slow` goes on (every 20 ms, 500 at most) until the client side is gone."""
        for i in range({"stream": 3, "stream-break": 2, "stream-slow": 500}[how]):
            if self.transport.is_closing():
                return
            event = b"data: %d\n\n" % i
            self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
            await asyncio.sleep(0.02 if how == "stream-slow" else 0)
        if how == "stream-break":
            self.transport.abort()
        else:
            self.transport.write(b"0\r\n\r\n")

    def answer(self, body: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )


def post(body: bytes, extra: bytes = b"") -> bytes:
    return b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


async def read_reply(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    return int(head.split(b" ")[1]), await asyncio.wait_for(reader.readexactly(length), 10)


def with_router(test, **settings):
    """Run `test(router_port)` on one event loop with the router and a fresh worker."""

    async def main():
        Worker.connections = []
        loop = asyncio.get_running_loop()
        worker = await loop.create_server(Worker, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{worker.sockets[0].getsockname()[1]}"
        sock = bind("127.0.0.1", 0, reuse_port=False)
        stop, ready = asyncio.Event(), asyncio.Event()
        router = create_app(RouterConfig(worker_urls=[url], **settings))
        serving = asyncio.create_task(router.serve([sock], ready=ready.set, stop=stop))
        await asyncio.wait_for(ready.wait(), 30)
        try:
            return await test(sock.getsockname()[1], stop, serving)
        finally:
            stop.set()
            await asyncio.wait_for(serving, 30)
            worker.close()

    return asyncio.run(main())


def test_pipelined_requests_are_answered_in_order_on_one_connection():
    async def test(port, *_):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(b'{"how": "later"}') + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" + post(b'{"how": "now"}'))
        first, second, third = [await read_reply(reader) for _ in range(3)]
        writer.close()
        return first, second, third

    first, second, third = with_router(test)
    assert first == (200, REPLY) and second == (200, b"OK") and third == (200, REPLY)


@pytest.mark.parametrize(
    "request_bytes, status, says",
    [
        (post(b'{"how": "now", "pad": "' + b"x" * 200 + b'"}'), 413, "--max-body-bytes"),
        (
            b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n80\r\n"
            + b"x" * 128
            + b"\r\n80\r\n"
            + b"x" * 128
            + b"\r\n0\r\n\r\n",
            413,
            "--max-body-bytes",
        ),
        (
            post(b'{"how": "now"}', b"".join(b"x-pad-%d: %s\r\n" % (i, b"y" * 1000) for i in range(80))),
            431,
            "exceed 65536 bytes",
        ),
        (b"POST /generate HTTP/1.1\r\ncontent-length: nope\r\n\r\n", 400, "malformed HTTP request"),
    ],
    ids=["body", "chunked body", "headers", "malformed"],
)
def test_a_refused_request_gets_a_4xx_naming_why_and_the_connection_closes(request_bytes, status, says):
    async def test(port, *_):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_bytes)
        return await read_reply(reader), await asyncio.wait_for(reader.read(), 10)

    (got, body), rest = with_router(test, max_body_bytes=200)
    assert got == status and says in json.loads(body)["error"]["message"] and rest == b""
    assert sum(w.generates for w in Worker.connections) == 0


def test_expect_continue_is_answered_before_the_body_is_sent():
    async def test(port, *_):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = post(b'{"how": "now"}', b"expect: 100-continue\r\n")
        head, body = request.split(b"\r\n\r\n", 1)
        writer.write(head + b"\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.write(body)
        return interim, await read_reply(reader)

    interim, reply = with_router(test)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n" and reply == (200, REPLY)


def test_a_client_that_leaves_drops_its_upstream_request():
    async def test(port, *_):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(b'{"how": "never"}'))
        while not Worker.connections or Worker.connections[-1].generates == 0:
            await asyncio.sleep(0.01)
        writer.close()
        await asyncio.wait_for(Worker.connections[-1].gone.wait(), 10)  # the engine would abort the request now

    with_router(test)


async def read_stream(reader: asyncio.StreamReader) -> bytes:
    """A chunked reply's body, whole."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while size := int(await asyncio.wait_for(reader.readuntil(b"\r\n"), 10), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readexactly(2)
    return body


def test_a_stream_passes_through_and_a_worker_breaking_it_ends_it_with_an_error_event():
    async def test(port, *_):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        bodies = []
        for how in (b"stream", b"stream-break", b"stream"):  # the connection serves on after each
            writer.write(post(b'{"stream": true, "how": "%s"}' % how))
            bodies.append(await read_stream(reader))
        return bodies

    whole, broken, again = with_router(test)
    assert whole == again == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert broken.startswith(b"data: 0\n\ndata: 1\n\n") and broken.endswith(b"data: [DONE]\n\n")
    error = json.loads(broken.split(b"data: ")[3])["error"]
    assert error["code"] == 502 and "failed mid-stream" in error["message"]


def test_a_client_that_leaves_a_stream_drops_it_upstream():
    async def test(port, *_):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(b'{"stream": true, "how": "stream-slow"}'))
        await asyncio.wait_for(reader.readuntil(b"data: 1\n\n"), 10)
        writer.close()
        await asyncio.wait_for(Worker.connections[-1].gone.wait(), 10)  # long before its 500 events

    with_router(test)


def test_a_kept_alive_connection_the_worker_dropped_is_retried_on_a_fresh_one():
    async def test(port, *_):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        replies = []
        for _ in range(2):
            writer.write(post(b'{"how": "drop-second"}'))
            replies.append(await read_reply(reader))
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        metrics = await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
        return replies, metrics.decode()

    replies, metrics = with_router(test)
    assert replies == [(200, REPLY), (200, REPLY)]
    assert [w.generates for w in Worker.connections if w.generates] == [2, 1]  # the second went out again, alone
    assert "slimish_router_retries_total{" not in metrics and "slimish_router_upstream_errors_total{" not in metrics


def test_a_connection_the_worker_resets_before_the_request_is_sent_is_a_disconnect():
    """A worker being killed can accept a connection and reset it at once; the router's write then
    found a closed transport (uvloop, the router's loop, raised RuntimeError: a 500 instead of a
    retry on another worker, seen in test_train_faults)."""

    async def main() -> None:
        server = await asyncio.start_server(lambda _r, w: w.transport.abort(), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        conn = await _Pool(url, asyncio.get_running_loop(), keepalive_timeout=5).connect(5)
        with pytest.raises(Disconnected):  # waits (at most 5 s) for the reset to arrive
            await conn._wait(5)
        assert conn.transport.is_closing()
        with pytest.raises(Disconnected):
            await conn.exchange(b"POST /generate HTTP/1.1\r\ncontent-length: 0\r\n\r\n", 5)
        server.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def test_a_stop_lets_requests_in_flight_finish_and_takes_no_new_ones():
    async def test(port, stop, serving):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(b'{"how": "later"}'))
        while not Worker.connections or Worker.connections[-1].generates == 0:
            await asyncio.sleep(0.01)
        stop.set()
        reply = await read_reply(reader)
        await asyncio.wait_for(serving, 30)
        try:
            await asyncio.open_connection("127.0.0.1", port)
            refused = False
        except OSError:
            refused = True
        return reply, refused

    reply, refused = with_router(test)
    assert reply == (200, REPLY) and refused
