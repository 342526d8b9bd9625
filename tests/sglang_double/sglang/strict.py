"""The strict layer: an ASGI app in front of the built-in engine's app that enforces what SGLang
0.5.23's HTTP server and TokenizerManager enforce, where the built-in engine is lenient.

Paths below are SGLang's, under python/sglang/srt/ (`tokenizer_manager.py` is
managers/tokenizer_manager.py). What it copies:

- The model-update lock (managers/tokenizer_manager.py:771, utils/aio_rwlock.py): every
  generation waits while the server is paused, then holds a reader lock for its whole life
  (tokenizer_manager.py:938-941). A weight update, and begin/end of a weight-update session, run
  at once while paused, else take the writer lock, which waits for every running generation
  (tokenizer_control_mixin.py:471-483, :516-524). The lock prefers writers: a waiting writer
  holds back new generations (aio_rwlock.py:43-48).
- Pause (tokenizer_manager.py:2267-2280): `abort` aborts everything and waits until no
  generation holds the lock; `retract` and `in_place` leave the requests alive (the scheduler
  requeues or keeps them, managers/scheduler.py:5817), still holding their reader locks. New
  requests wait until continue (:2282).
- Sessions (managers/scheduler_components/weight_updater.py:192-196, :234-238, :309-336):
  distributed and tensor updates only inside begin_weight_update .. end_weight_update; begin
  twice or end without begin is refused.
- Cache flushes (managers/scheduler.py:5337, :5518): refused unless nothing runs and, unless
  paused, nothing waits; a weight update whose `flush_cache` (default true) is refused so fails
  (weight_updater.py:120-132).
- Request bodies: fields outside SGLang's schema are dropped (utils/msgspec_utils.py:98,
  `extra_behavior="ignore"`; the schemas are managers/io_struct.py's).
- Routed experts: without --enable-return-routed-experts SGLang captures nothing and a reply has
  no `routed_experts`, with no error (state_capturer/routed_experts.py:50-51,
  scheduler_components/batch_result_processor.py:149-153); the built-in engine refuses such a
  request (400), so the double drops `return_routed_experts` from /generate bodies instead. (A bad
  `routed_experts_start_len` is then not refused as SGLang's scheduler.py:3300-3318 would.)
- `/health` runs a one-token generation, so it waits while paused and answers 503 after
  HEALTH_CHECK_TIMEOUT (entrypoints/http_server.py:218, :721-800), unless
  SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false (environ.py:143, :344).
- Routes: SGLang's (entrypoints/http_server.py), and no others: 404 otherwise. `/metrics` only
  with --enable-metrics (http_server.py:314). Routes SGLang has and the built-in engine lacks
  (`/load_lora_adapter_from_tensors`, ...) answer 404 too: nothing in slimish calls them.
  `/update_weights_from_tensor` is checked as SGLang checks it but loads nothing
  (sglang/tensors.py): its CUDA IPC handles need a GPU, and the double never unpickles.
- Versions: a reply's `weight_version` is the server's, adapter or not (tokenizer_manager.py:2511,
  `config_value("weight_version")`); the built-in engine versions each adapter on its own.
- `/server_info` reports the command line's values, tp_size, dp_size and pp_size among them
  (http_server.py:863); updates from distributed assert dp_size == 1
  (tokenizer_control_mixin.py:451, :509), which FastAPI answers with a 500.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from contextlib import asynccontextmanager, nullcontext
from typing import Any

from sglang.routes import BASE_FIELDS, FIELDS, FLUSH_REFUSED, MEMORY_TAGS, RECORDED, ROUTE_PREFIXES, ROUTES
from sglang.tensors import payload_error, record_call
from slimish.engine.api_generate import FLUSH_OK

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def env_bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """environ.py:143 EnvBool."""
    value = environ.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes", "y"):
        return True
    if value.lower() in ("false", "0", "no", "n"):
        return False
    raise ValueError(f'{name}: "{value}" is not a valid boolean value')


class RWLock:
    """utils/aio_rwlock.py: readers share, a writer excludes all; a waiting writer holds back new
    readers."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self.writer_active = False
        self.waiting_writers = 0

    @asynccontextmanager
    async def reader(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer_active and self.waiting_writers == 0)
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def writer(self):
        async with self._cond:
            self.waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self.writer_active and self.readers == 0)
                self.writer_active = True
            finally:
                self.waiting_writers -= 1
        try:
            yield
        finally:
            async with self._cond:
                self.writer_active = False
                self._cond.notify_all()

    def locked(self) -> bool:
        return self.writer_active or self.readers > 0

    async def wait_unlocked(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.locked())


class Reply:
    """An ASGI response collected from the inner app."""

    def __init__(self) -> None:
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


async def respond(send: Send, status: int, body: Any, content_type: bytes = b"application/json") -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(raw)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": raw})


class StrictSGLang:
    """ASGI app: SGLang's rules, then the built-in engine's app (`inner`) for the work."""

    def __init__(self, inner: Any, server_args: dict[str, Any], environ: Mapping[str, str]) -> None:
        self.inner = inner
        self.server_args = server_args
        self.health_generates = env_bool(environ, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True)  # environ.py:344
        self.health_timeout = int(environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))  # http_server.py:218
        self.is_pause = False  # tokenizer_manager.py:777
        self.pause_cond = asyncio.Condition()  # :778
        self.lock = RWLock()  # :771 model_update_lock
        self.session = False  # weight_updater.py:99 `_session`
        self.released: set[str] = set()  # memory tags released (/release_memory_occupation)
        self.handlers: dict[str, Callable[[Scope, bytes, Receive, Send], Awaitable[None]]] = {
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/begin_weight_update": self.begin_weight_update,
            "/end_weight_update": self.end_weight_update,
            "/update_weights_from_distributed": self.update_weights,
            "/update_weights_from_tensor": self.update_weights,
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/init_weights_update_group": self.init_weights_update_group,
            "/flush_cache": self.flush_cache,
            "/release_memory_occupation": self.memory,
            "/resume_memory_occupation": self.memory,
            "/health": self.health,
            "/health_generate": self.health,
            "/server_info": self.server_info,
            "/get_server_info": self.server_info,
            "/generate": self.generation,
            "/v1/completions": self.generation,
            "/v1/chat/completions": self.generation,
        }
        self.serve_one_version()

    @property
    def engine(self) -> Any:
        return self.inner.state.engine

    @property
    def scheduler(self) -> Any:
        """The built-in engine's scheduler, which its routes never touch: SGLang's one version per
        server and its idle rule differ from the built-in engine's, so the double applies them there."""
        return self.engine._scheduler

    def serve_one_version(self) -> None:
        """Every request, an adapter's too, is labelled with the server's weight version
        (tokenizer_manager.py:2511)."""
        scheduler = self.scheduler
        scheduler.version_of = lambda lora: scheduler.weight_version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: the engine's own start and stop
            return await self.inner(scope, receive, send)
        path = scope["path"]
        if path == "/metrics" and self.server_args.get("enable_metrics"):
            return await self.inner(scope, receive, send)
        if path not in ROUTES and not path.startswith(ROUTE_PREFIXES):
            return await respond(send, 404, {"detail": "Not Found"})
        body = b""
        if scope["method"] in ("POST", "PUT"):
            body = await read_body(receive)
            body = drop_unknown_fields(path, body)
            if path == "/generate" and not self.server_args.get("enable_return_routed_experts"):
                body = without_routes(body)
            if path in RECORDED:
                record_call(path, body)
        handler = self.handlers.get(path)
        await (handler or self.forward)(scope, body, receive, send)

    # -- forwarding ------------------------------------------------------------------------------

    async def forward(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await self.inner(with_body_length(scope, body), replay(body, receive), send)

    async def call(self, scope: Scope, body: bytes, receive: Receive) -> Reply:
        reply = Reply()
        await self.inner(with_body_length(scope, body), replay(body, receive), reply.send)
        return reply

    async def send_reply(self, send: Send, reply: Reply) -> None:
        await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers})
        await send({"type": "http.response.body", "body": reply.body})

    # -- generation and pause --------------------------------------------------------------------

    async def generation(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """tokenizer_manager.py:938-941: wait out a pause, then hold a reader lock throughout."""
        async with self.pause_cond:
            await self.pause_cond.wait_for(lambda: not self.is_pause)
        async with self.lock.reader():
            await self.forward(scope, body, receive, send)

    async def pause_generation(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """tokenizer_manager.py:2267-2280. The scheduler's retract / in_place (scheduler.py:5817)
        are the built-in engine's own; abort aborts all and waits for the lock to be free,
        aborting again every second (as SGLang does) for requests that slipped in."""
        mode = (json.loads(body or b"{}") or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):  # io_struct.py:1927: refused before the handler
            return await self.forward(scope, body, receive, send)
        async with self.pause_cond:
            self.is_pause = True
            reply = await self.call(scope, body, receive)
            while mode == "abort" and self.lock.locked():
                try:
                    await asyncio.wait_for(self.lock.wait_unlocked(), 1.0)
                except asyncio.TimeoutError:
                    await self.engine.abort(abort_all=True, message="Abort by pause_generation.")
        await self.send_reply(send, reply)

    async def continue_generation(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """tokenizer_manager.py:2282-2286."""
        async with self.pause_cond:
            self.is_pause = False
            reply = await self.call(scope, body, receive)
            self.pause_cond.notify_all()
        await self.send_reply(send, reply)

    async def health(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """http_server.py:721-800: the built-in engine answers 503 while starting; past that, a
        generation (unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false, for /health only)
        that must get through within HEALTH_CHECK_TIMEOUT."""
        if not self.health_generates and scope["path"] == "/health":
            return await self.forward(scope, body, receive, send)

        async def generation() -> Reply:
            async with self.pause_cond:
                await self.pause_cond.wait_for(lambda: not self.is_pause)
            async with self.lock.reader():
                return await self.call(scope, body, receive)

        try:
            reply = await asyncio.wait_for(generation(), self.health_timeout)
        except asyncio.TimeoutError:
            return await respond(send, 503, b"", b"text/plain")
        await self.send_reply(send, reply)

    # -- weight updates --------------------------------------------------------------------------

    @asynccontextmanager
    async def exclusive(self, hold_pause_cond: bool = True):
        """tokenizer_control_mixin.py:471-483, :516-524: at once while paused (holding the pause
        condition, so a continue waits for the update), else under the writer lock. The disk
        update only reads the pause state (tokenizer_manager.py:2302-2308)."""
        async with self.pause_cond:
            paused = self.is_pause
            if paused and hold_pause_cond:
                yield
                return
        async with nullcontext() if paused else self.lock.writer():
            yield

    async def begin_weight_update(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """weight_updater.py:309-321."""
        async with self.exclusive():
            if self.session:
                return await control(
                    send, False, "a weight-update session is already open; call end_weight_update() first"
                )
            self.session = True
        await control(send, True, "Success")

    async def end_weight_update(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """weight_updater.py:323-336."""
        async with self.exclusive():
            if not self.session:
                return await control(send, False, "no weight-update session is open; call begin_weight_update() first")
            self.session = False
        await control(send, True, "Success")

    async def init_weights_update_group(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """tokenizer_control_mixin.py:451: an assertion, so FastAPI's plain 500."""
        if int(self.server_args.get("dp_size") or 1) != 1:
            return await respond(send, 500, b"Internal Server Error", b"text/plain; charset=utf-8")
        await self.forward(scope, body, receive, send)

    async def update_weights(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """tokenizer_control_mixin.py:503-561 and weight_updater.py:187-271: a session is
        required; the update's flush must be possible."""
        req = json.loads(body or b"{}") or {}
        if int(self.server_args.get("dp_size") or 1) != 1:
            return await respond(send, 500, b"Internal Server Error", b"text/plain; charset=utf-8")
        if req.get("abort_all_requests"):
            await self.engine.abort(abort_all=True)
        route = scope["path"].lstrip("/")
        async with self.exclusive():
            if not self.session:
                return await control(
                    send, False, f"{route} must run between begin_weight_update() and end_weight_update()"
                )
            if route == "update_weights_from_tensor":
                return await self.update_from_tensor(send, req)
            await self.update_and_flush(scope, body, receive, send, req)

    async def update_from_tensor(self, send: Send, req: dict) -> None:
        """weight_updater.py:232-271 up to the load (sglang/tensors.py): the payload is checked,
        not loaded (the built-in engine has no route for it, and the double unpickles nothing).
        Into released weights it is refused: their memory is not there (torch_memory_saver)."""
        if error := payload_error(req, int(self.server_args.get("tp_size") or 1)):
            return await control(send, False, error)
        if "weights" in self.released:
            return await control(send, False, "the weights are released: resume_memory_occupation first")
        if req.get("flush_cache", True) and not await self.idle():
            return await control(send, False, FLUSH_REFUSED)
        await control(send, True, "Success")

    async def memory(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """The built-in engine frees the KV cache; the double keeps which tags are released."""
        reply = await self.call(scope, body, receive)
        if reply.status == 200:
            tags = set((json.loads(body or b"{}") or {}).get("tags") or MEMORY_TAGS)
            self.released = (
                self.released | tags if scope["path"] == "/release_memory_occupation" else self.released - tags
            )
        await self.send_reply(send, reply)

    async def update_weights_from_disk(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """tokenizer_manager.py:2288-2322: no session needed; the flush rule holds."""
        req = json.loads(body or b"{}") or {}
        if req.get("abort_all_requests"):
            await self.engine.abort(abort_all=True)
        async with self.exclusive(hold_pause_cond=False):
            await self.update_and_flush(scope, body, receive, send, req, num_paused_requests=0)

    async def update_and_flush(
        self, scope: Scope, body: bytes, receive: Receive, send: Send, req: dict, **extra: Any
    ) -> None:
        reply = await self.call(scope, body, receive)
        if reply.status == 200 and req.get("flush_cache", True) and not await self.idle():
            return await control(send, False, FLUSH_REFUSED, **extra)
        await self.send_reply(send, reply)

    # -- cache and info --------------------------------------------------------------------------

    async def idle(self) -> bool:
        """scheduler.py:5337 `is_fully_idle(ignore_waiting=paused)`: nothing running and, unless
        paused, nothing waiting (the built-in engine's retract moves running to waiting)."""
        s = self.scheduler
        return await self.engine.run(lambda: not s.running and (s.paused is not None or not s.waiting))

    async def flush_cache(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """http_server.py:1025-1040, scheduler.py:5518: refused (400) unless idle."""
        s = self.scheduler

        def flush() -> bool:
            if s.running or (s.paused is None and s.waiting):
                return False
            s.runner.flush_cache()
            return True

        if not await self.engine.run(flush):
            return await respond(send, 400, b"Flush cache failed.\n", b"text/plain; charset=utf-8")
        await respond(send, 200, FLUSH_OK.encode(), b"text/plain; charset=utf-8")

    async def server_info(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """http_server.py:863: the resolved command line (flattened) plus live state."""
        reply = await self.call(scope, body, receive)
        if reply.status != 200:
            return await self.send_reply(send, reply)
        info = {**reply.json(), **self.server_args, "version": "0.5.23"}
        await respond(send, 200, info)


async def control(send: Send, success: bool, message: str, **extra: Any) -> None:
    """SGLang's control reply: 200, or 400 when it failed (http_server.py:1458-1505)."""
    await respond(send, 200 if success else 400, {"success": success, "message": message, **extra})


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return body
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields `body` once, then the client's own messages (its disconnect)."""
    sent = False

    async def again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def with_body_length(scope: Scope, body: bytes) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}


def without_routes(body: bytes) -> bytes:
    """A /generate body as a server without --enable-return-routed-experts serves it: no routes asked."""
    try:
        req = json.loads(body) if body else None
    except ValueError:
        return body  # the engine's parser answers a bad body
    if not isinstance(req, dict) or "return_routed_experts" not in req:
        return body
    return json.dumps({k: v for k, v in req.items() if k != "return_routed_experts"}).encode()


def drop_unknown_fields(path: str, body: bytes) -> bytes:
    """utils/msgspec_utils.py:98: a control body's fields outside the schema are ignored."""
    allowed = FIELDS.get(path)
    if allowed is None or not body:
        return body
    try:
        req = json.loads(body)
    except ValueError:
        return body  # the engine's parser answers a bad body
    if not isinstance(req, dict):
        return body
    return json.dumps({k: v for k, v in req.items() if k in allowed | BASE_FIELDS}).encode()
