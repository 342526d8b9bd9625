"""Forwarding: a request to one worker chosen by the policy, with retries, timeouts, clear errors.

Bodies pass through as bytes and streams as they arrive: the router is a proxy, not a parser.
A request is retried on another worker when it could not connect, when the connection broke
before the reply was complete, or on a 5xx: in all three cases before any byte reached the
client. A timeout is not retried (the work may still be running there); it is a 504.

Serving requests go out through upstream.py's lean client and their replies are written straight
to the client's connection (wire.py); control requests and fan-outs use aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from starlette.responses import Response

from slimish.router.config import RouterConfig
from slimish.router.metrics import RouterMetrics
from slimish.router.policy import Policy, RouteInfo
from slimish.router.upstream import ConnectFailed, Disconnected, Upstream, WorkerReply
from slimish.router.wire import Connection, error_body
from slimish.router.workers import Worker, WorkerRegistry, describe_exc

WORKER_HEADER = "x-slimish-worker"  # which worker served the reply: for logs and tests
PROCESS_HEADER = "x-slimish-router-process"  # with --processes N, which router process (0..N-1) did


class RouterError(Exception):
    def __init__(self, status: int, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after

    def response(self) -> Response:
        return error_response(
            self.status, self.message, {"retry-after": self.retry_after} if self.retry_after else None
        )

    def write(self, out: Connection) -> None:
        out.error(self.status, self.message, [("retry-after", self.retry_after)] if self.retry_after else ())


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message), status, headers=headers, media_type="application/json")


def holders(healthy: list[Worker], everyone: list[Worker], adapters: frozenset[str]) -> list[Worker]:
    """The healthy workers that hold every adapter of a request; a RouterError naming what is missing."""
    able = [w for w in healthy if adapters <= w.adapters]
    if able:
        return able
    for name in sorted(adapters):
        held_by = [w.url for w in everyone if name in w.adapters]
        if not held_by:
            raise RouterError(
                400, f"lora adapter {name!r} is not loaded on any worker; load it with POST /load_lora_adapter"
            )
        if not any(name in w.adapters for w in healthy):
            raise RouterError(503, f"lora adapter {name!r} is held only by unhealthy workers ({', '.join(held_by)})")
    raise RouterError(
        400,
        f"no healthy worker holds all of the lora adapters {sorted(adapters)}; a batch must name adapters one worker holds",
    )


def model_ids(everyone: list[Worker]) -> set[str]:
    """The model ids workers were registered under (`POST /workers {"url", "model_id"}`)."""
    return {w.model_id for w in everyone if w.model_id is not None}


def serving(healthy: list[Worker], everyone: list[Worker], route: str, model: str | None) -> list[Worker]:
    """The healthy workers a serving request naming `model` may reach; a RouterError when none may.

    Named workers (registered under a model id) serve another model beside the policy's, e.g. on-
    policy distillation's teacher: only requests naming that id reach them, and only them, so
    the policy's traffic can never land there. Any other request goes to the unnamed workers; on
    `/generate`, where `model` selects nothing else, a name that is neither a registered id nor an
    unnamed worker's served model is refused (a typo must not land on the policy). The OpenAI
    routes pass other names on (the served model, an adapter): the engine decides."""
    ids = model_ids(everyone)
    if model in ids:
        named = [w for w in healthy if w.model_id == model]
        if not named:
            down = ", ".join(w.url for w in everyone if w.model_id == model)
            raise RouterError(503, f"model {model!r}: every worker registered under it is unhealthy ({down})")
        return named
    if (
        route == "/generate"
        and model is not None
        and model not in {w.metadata.get("served_model_name") for w in everyone}
    ):
        raise RouterError(
            404,
            f"model {model!r} is served by no worker; model ids registered with POST /workers: "
            f"{', '.join(sorted(ids)) or 'none'} (omit model for the unnamed workers)",
        )
    unnamed = [w for w in healthy if w.model_id is None]
    if not unnamed:
        raise RouterError(
            503,
            f"no healthy unnamed worker; the named ones ({', '.join(sorted(ids))}) serve only requests "
            "whose model names them",
        )
    return unnamed


def admin_targets(everyone: list[Worker], model: str | None) -> list[Worker]:
    """The workers an engine admin fan-out reaches: the unnamed ones, so a policy push never
    reaches a named worker; with `?model=NAME`, that name's workers only."""
    if model is None:
        unnamed = [w for w in everyone if w.model_id is None]
        if everyone and not unnamed:
            raise RouterError(
                503,
                f"no unnamed worker to send this to; the named ones take it with ?model= one of {sorted(model_ids(everyone))}",
            )
        return unnamed
    named = [w for w in everyone if w.model_id == model]
    if not named:
        raise RouterError(
            404,
            f"model: no worker is registered under {model!r}; model ids: {', '.join(sorted(model_ids(everyone))) or 'none'}",
        )
    return named


class _Retry(Exception):
    """This attempt failed in a way another worker may not: try again if attempts are left.
    `retry_after` is set when the worker was full (503 with Retry-After)."""

    def __init__(self, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Proxy:
    def __init__(self, cfg: RouterConfig, workers: WorkerRegistry, policy: Policy, metrics: RouterMetrics) -> None:
        self.cfg, self.workers, self.policy, self.metrics = cfg, workers, policy, metrics
        self.session: aiohttp.ClientSession | None = None  # control requests, health checks, fan-outs
        self.upstream = Upstream(cfg.connect_timeout, cfg.keepalive_timeout)  # serving requests
        self._timeout = aiohttp.ClientTimeout(total=cfg.request_timeout, connect=cfg.connect_timeout)
        self.reply_headers: list[tuple[str, str]] = []  # added to every forwarded reply

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.cfg.keepalive_timeout)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        self.workers.bind(self.session)

    async def close(self) -> None:
        self.upstream.close()
        if self.session is not None:
            await self.session.close()

    # ---- choosing ----------------------------------------------------------------------------

    def choose(self, info: RouteInfo, tried: list[Worker]) -> Worker:
        healthy = self.workers.healthy()
        if not healthy:
            raise RouterError(503, self._no_worker_message())
        healthy = serving(healthy, self.workers.all(), info.route, info.model)
        if info.adapters:
            healthy = holders(healthy, self.workers.all(), info.adapters)
        fresh = [w for w in healthy if w not in tried]
        return self.policy.pick(fresh or healthy, info)

    def _no_worker_message(self) -> str:
        everyone = self.workers.all()
        if not everyone:
            return 'no workers registered; add one with POST /workers {"url": ...}'
        causes = "; ".join(f"{w.url}: {w.last_error}" for w in everyone)
        return f"no healthy worker among {len(everyone)} registered ({causes})"

    # ---- one request, one worker (with retries) ------------------------------------------------

    async def forward(
        self,
        out: Connection,
        route: str,
        started: float,
        method: str,
        body: bytes | None,
        headers: dict[str, str],
        info: RouteInfo = RouteInfo(),
        stream: bool = False,
    ) -> None:
        """The worker's reply, written to `out`; RouterError, with nothing written, when no
        worker could give one."""
        tried: list[Worker] = []
        failure = _Retry("")
        for _ in range(self.cfg.max_retries + 1):
            if tried:
                self.metrics.retries.labels(tried[-1].url).inc()
            worker = self.choose(info, tried)
            tried.append(worker)
            try:
                return await self._attempt(out, route, started, worker, method, body, headers, stream)
            except _Retry as exc:
                failure = exc
        gave_up = f"{failure} (gave up after {len(tried)} attempt{'s' * (len(tried) > 1)})"
        if failure.retry_after is not None:  # every engine tried was full: the client should come back
            raise RouterError(503, gave_up, failure.retry_after)
        raise RouterError(502, gave_up)

    async def _attempt(
        self,
        out: Connection,
        route: str,
        started: float,
        worker: Worker,
        method: str,
        body: bytes | None,
        headers: dict[str, str],
        stream: bool,
    ) -> None:
        self.metrics.sent(worker.url)
        worker.inflight += 1
        reply: WorkerReply | None = None
        timeout = self.cfg.request_timeout
        try:
            reply = await self.upstream.send(worker.url, method, route, body, {**headers, **self.workers.auth}, timeout)
            if reply.status >= 500:
                detail = (await reply.read())[:500].decode(errors="replace")
                self.metrics.errors.labels(worker.url, f"status_{reply.status}").inc()
                raise _Retry(f"worker {worker.url} replied {reply.status}: {detail}", reply.headers.get("retry-after"))
            said = [
                ("content-type", reply.headers.get("content-type", "application/json")),
                (WORKER_HEADER, worker.url),
                *self.reply_headers,
            ]
            if stream and reply.content_type == "text/event-stream":
                return await self._relay(out, route, started, worker, reply, said)
            data = await reply.read()
        except ConnectFailed as exc:
            raise self._unreachable(worker, "connect_timeout" if exc.timed_out else "connect", str(exc)) from exc
        except Disconnected as exc:
            self.metrics.errors.labels(worker.url, "disconnect").inc()
            raise _Retry(f"worker {worker.url} broke the connection before replying: {exc}") from exc
        except asyncio.TimeoutError as exc:
            self.metrics.errors.labels(worker.url, "timeout").inc()
            raise RouterError(
                504, f"worker {worker.url} did not answer {route} within {timeout:g} s (--request-timeout)"
            ) from exc
        finally:
            worker.inflight -= 1
            if reply is not None:
                reply.release()  # whole: back to the pool; cut short (client gone, error): closed, so the engine aborts
        self.metrics.observe(route, reply.status, time.perf_counter() - started)
        out.reply(reply.status, data, said)

    async def _relay(
        self,
        out: Connection,
        route: str,
        started: float,
        worker: Worker,
        reply: WorkerReply,
        headers: list[tuple[str, str]],
    ) -> None:
        """An upstream SSE stream passed through chunk by chunk; a worker failing mid-stream ends
        it with an error event naming the worker."""
        out.start(reply.status, headers)
        try:
            async for chunk in reply.chunks(self.cfg.request_timeout):
                await out.send(chunk)
        except (Disconnected, asyncio.TimeoutError) as exc:
            cause = describe_exc(exc, self.cfg.request_timeout)
            self.metrics.errors.labels(worker.url, "stream").inc()
            await out.send(sse_error(f"worker {worker.url} failed mid-stream: {cause}", 502))
        finally:
            self.metrics.observe(route, reply.status, time.perf_counter() - started)
        out.end()

    def _unreachable(self, worker: Worker, cause: str, message: str) -> _Retry:
        self.metrics.errors.labels(worker.url, cause).inc()
        self.workers.mark_failed(worker, message)
        return _Retry(f"worker {worker.url} is unreachable: {message}")

    # ---- fan-out -----------------------------------------------------------------------------

    async def fan_out(
        self, method: str, path_and_query: str, body: bytes | None, model: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Send a control request to every unnamed worker at once (those registered under `model`
        when given); one result per worker."""
        workers = admin_targets(self.workers.all(), model)
        if not workers:
            raise RouterError(503, self._no_worker_message())
        results = await asyncio.gather(*(self.control(w, method, path_and_query, body) for w in workers))
        failed = [r["url"] for r in results if not r["success"]]
        path = path_and_query.split("?")[0]
        message = (
            f"{path} failed on {', '.join(failed)}" if failed else f"{path} succeeded on all {len(results)} workers"
        )
        return (502 if failed else 200), {"success": not failed, "message": message, "workers": results}

    async def control(self, worker: Worker, method: str, path: str, body: bytes | None) -> dict[str, Any]:
        """One control request to one worker: its status and body, or the error that kept them."""
        assert self.session is not None
        result: dict[str, Any] = {"worker_id": worker.id, "url": worker.url}
        try:
            async with self.session.request(
                method, worker.url + path, data=body, headers={"content-type": "application/json", **self.workers.auth}
            ) as resp:
                raw = await resp.read()
                result.update(
                    status_code=resp.status, success=200 <= resp.status < 300, body=_decode(raw, resp.content_type)
                )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.metrics.errors.labels(worker.url, "control").inc()
            result.update(success=False, error=describe_exc(exc, self.cfg.request_timeout))
        return result


def _decode(raw: bytes, content_type: str) -> Any:
    if not raw:
        return None
    text = raw.decode(errors="replace")
    if content_type == "application/json":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def sse_error(message: str, code: int) -> bytes:
    """An error as SGLang streams it (docs/protocol.md 1.4), then the end of the stream."""
    event = {"error": {"message": message, "type": "router_error", "code": code, "retryable": False}}
    return b"\n\ndata: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
