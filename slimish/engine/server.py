"""`slimish engine`: the built-in engine's HTTP server, SGLang's native protocol (PROTOCOL.md).

Routes parse bodies with `slimish.protocol`, hand work to `Engine`, and shape replies exactly as
SGLang 0.5.23 does, including its error bodies, so that clients, sglang-router and the trainer
cannot tell this server from SGLang on the paths RL uses.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import slimish
from slimish.config import EngineConfig, add_config_arguments, config_from_args
from slimish.serving import document_bodies, load_json, warn_if_exposed
from slimish.engine.engine import Engine, Item, Overloaded, RequestError, Unavailable
from slimish.engine.openai_api import build_openai_router
from slimish.engine.scheduler import LogprobWish
from slimish.protocol import (
    AbortReq,
    BeginWeightUpdateReq,
    ChatCompletionRequest,
    CompletionRequest,
    ContinueGenerationReq,
    DestroyWeightsUpdateGroupReq,
    GenerateReqInput,
    GetWeightsByNameReq,
    InitWeightsUpdateGroupReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    SamplingParams,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightVersionReq,
    describe_validation_error,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

OPEN_ROUTES = {"/health", "/health_generate", "/ready", "/metrics"}
ADMIN_ROUTES = {
    "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
    "/update_weights_from_disk", "/begin_weight_update", "/end_weight_update", "/update_weight_version",
    "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request",
    "/release_memory_occupation", "/resume_memory_occupation",
}  # fmt: skip
FLUSH_OK = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"


class BadRequest(Exception):
    """Carries a ready 400 reply (SGLang's two error body shapes)."""

    def __init__(self, body: Any) -> None:
        self.body = body


def error_message(message: str, status: int = 400, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status, headers=headers)


class BodyTooLarge(Exception):
    """Raised from `receive` when a body without a (truthful) Content-Length grows past the limit."""


class BodyLimit:
    """413 for request bodies over `limit` bytes, before they are read into memory: by the
    declared Content-Length, else by counting the chunks as the route reads them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            response = error_message(f"body: {int(declared)} bytes; this engine accepts at most {self.limit} (--max-body-bytes)", 413)
            return await response(scope, receive, send)
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > self.limit:
                raise BodyTooLarge()
            return message

        await self.app(scope, counted, send)


async def parse(request: Request, model: type[M], empty_ok: bool = True) -> M:
    """Body -> model, or a 400 naming the field (malformed JSON included)."""
    raw = await request.body()
    if not raw.strip() and empty_ok:
        data: Any = {}
    else:
        try:
            data = load_json(raw)
        except ValueError as exc:
            raise BadRequest({"error": {"message": f"body: malformed JSON ({exc})"}}) from None
    if not isinstance(data, dict):
        raise BadRequest({"error": f"body: expected a JSON object, got {type(data).__name__}"})
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadRequest({"error": describe_validation_error(exc)}) from None


def control(success: bool, message: str, status: int | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=status or (200 if success else 400))


def create_app(cfg: EngineConfig, engine: Engine | None = None) -> FastAPI:
    engine = engine or Engine(cfg)
    session = {"open": False}  # the 0.5.23 begin/end weight-update session

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="slimish engine", version=slimish.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        path = request.url.path
        key = (cfg.admin_api_key or cfg.api_key) if path in ADMIN_ROUTES else cfg.api_key
        if key and path not in OPEN_ROUTES:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return error_message("Unauthorized: send `Authorization: Bearer <key>`", 401)
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse(exc.body, status_code=400)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_message(str(exc))

    @app.exception_handler(Unavailable)
    async def unavailable(_: Request, exc: Unavailable) -> JSONResponse:
        return error_message(str(exc), 503)

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return error_message(str(exc), 503, {"Retry-After": str(cfg.retry_after_s)})

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return error_message(f"body: over {cfg.max_body_bytes} bytes, this engine's limit (--max-body-bytes)", 413)

    # ---- generation -------------------------------------------------------------------------

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await parse(request, GenerateReqInput, empty_ok=False)
        items = engine.items_from_generate(body)
        batch = body.is_batch or len(items) > 1
        text_lp = body.return_text_in_logprobs
        if body.stream:
            updates = engine.submit(items, stream=True)  # scheduled now: a full engine is a 503, not a broken stream
            return StreamingResponse(stream_native(updates, batch, text_lp), media_type="text/event-stream")
        reqs = await engine.generate(items)
        out = [engine.reply(r, len(r.output_ids), True, text_lp) for r in reqs]
        return JSONResponse(out if batch else out[0])

    async def stream_native(progress: AsyncIterator[tuple[list[Any], Any]], batch: bool, text_lp: bool) -> AsyncIterator[str]:
        reqs: list[Any] = []
        async with aclosing(progress) as updates:  # a client gone aborts
            async for reqs, up in updates:
                chunk = engine.reply(reqs[up.index], up.n, up.finished, text_lp)
                if batch:
                    chunk["index"] = up.index
                yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = await parse(request, AbortReq)
        await engine.run(lambda: engine.scheduler.abort(req.rid, req.abort_all))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        req = await parse(request, PauseGenerationReq)
        await engine.run(lambda: engine.scheduler.pause(req.mode))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await parse(request, ContinueGenerationReq)
        await engine.run(engine.scheduler.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        # There is no prefix cache to drop; like SGLang, refuse while requests are in flight.
        busy = await engine.run(lambda: bool(engine.scheduler.running or engine.scheduler.waiting))
        if busy:
            return PlainTextResponse("Cache not flushed because there are pending requests.\n", status_code=400)
        return PlainTextResponse(FLUSH_OK)

    # ---- weights ----------------------------------------------------------------------------

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        req = await parse(request, InitWeightsUpdateGroupReq)
        try:  # blocks until every rank joined: off the scheduler thread, generation goes on
            await asyncio.to_thread(engine.weights.init_group, req)
        except Exception as exc:
            return control(False, f"Failed to initialize custom process group: {exc}.")
        return control(True, "Succeeded to initialize custom process group.")

    async def apply_update(req: Any, load: Callable[[], None], ok: str, fail: str, **extra: Any) -> JSONResponse:
        """Abort if asked; load while no request runs (SGLang's writer lock) or while paused; version."""
        if req.abort_all_requests:
            await engine.run(lambda: engine.scheduler.abort(abort_all=True))

        def load_and_version() -> None:
            load()
            if req.weight_version is not None:
                engine.scheduler.weight_version = req.weight_version

        try:
            await engine.run(load_and_version, needs_idle=True)
        except Exception as exc:
            if (torn := engine.weights.torn_error()) is not None:  # paused requests must not resume on it
                await engine.run(lambda: engine.scheduler.abort(abort_all=True))
                return control(False, f"{fail.format(exc=exc)} ({torn})", **extra)
            return control(False, fail.format(exc=exc), **extra)
        note = f" Weight version updated to {req.weight_version}." if req.weight_version is not None else ""
        return control(True, ok + note, **extra)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        req = await parse(request, UpdateWeightsFromDistributedReq)
        return await apply_update(
            req, lambda: engine.weights.update_from_distributed(req), "Succeeded to update parameter online.",
            "Failed to update parameter online: {exc}. Please discard the whole weights.",
        )  # fmt: skip

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        req = await parse(request, DestroyWeightsUpdateGroupReq)
        try:
            await engine.run(lambda: engine.weights.destroy_group(req.group_name))
        except Exception as exc:
            return control(False, str(exc))
        return control(True, "Succeeded to destroy custom process group.")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        req = await parse(request, UpdateWeightsFromDiskReq)

        def load() -> None:
            engine.weights.update_from_disk(req.model_path)
            engine.model_path = req.model_path

        return await apply_update(
            req, load, "Succeeded to update model weights.",
            "Failed to update weights: {exc}. Rolled back to the previous weights.", num_paused_requests=0,
        )  # fmt: skip

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> JSONResponse:
        await parse(request, BeginWeightUpdateReq)
        if session["open"]:
            return control(False, "a weight-update session is already open; call end_weight_update() first")
        session["open"] = True
        return control(True, "Weight-update session opened.")

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        if not session["open"]:
            return control(False, "no weight-update session is open; call begin_weight_update() first")
        session["open"] = False
        return control(True, "Weight-update session closed.")

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        req = await parse(request, UpdateWeightVersionReq)

        def apply() -> None:
            if req.abort_all_requests:
                engine.scheduler.abort(abort_all=True)
            engine.scheduler.weight_version = req.new_version

        await engine.run(apply)
        return JSONResponse({"success": True, "message": f"Weight version updated to {req.new_version}", "new_version": req.new_version})

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> JSONResponse:
        req = await parse(request, GetWeightsByNameReq, empty_ok=False)
        try:
            return JSONResponse(await engine.run(lambda: engine.weights.get_weights_by_name(req.name, req.truncate_size)))
        except ValueError as exc:
            return control(False, str(exc))

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def memory_occupation(request: Request) -> JSONResponse:
        await parse(request, MemoryOccupationReq)  # nothing to release on CPU; SGLang replies `null`
        return JSONResponse(None)

    # ---- health and info --------------------------------------------------------------------

    @app.get("/health")
    @app.get("/ready")
    async def health() -> Response:
        return Response(status_code=503 if engine.weights.torn else 200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        s = engine.scheduler
        if engine.weights.torn:
            return Response(status_code=503)
        if s.running or s.waiting:
            return Response(status_code=200)
        item = Item([0], SamplingParams(max_new_tokens=1, temperature=0.0), f"health-{time.monotonic_ns()}", LogprobWish())
        try:
            await asyncio.wait_for(engine.generate([item]), timeout=20)
        except asyncio.TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        config = engine.model.config
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.scheduler.weight_version,
            "load_format": None,
            "reasoning_parser": engine.format.reasoning_parser,
            "tool_call_parser": engine.format.tool_call_parser,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.model_type,
            "architectures": config.architectures,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        s = engine.scheduler
        args = {k: v for k, v in vars(cfg).items() if k not in ("api_key", "admin_api_key")}
        return {
            **args,
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "context_length": engine.context_length,
            "tp_size": 1,
            "dp_size": 1,
            "max_total_num_tokens": engine.context_length * cfg.max_running_requests,
            "startup_time": engine.started_at,
            "internal_states": [{"last_gen_throughput": s.last_gen_throughput, "#running-req": len(s.running), "#queue-req": len(s.waiting)}],
            "version": slimish.__version__,
            "frontend": "python",
            "launch_command": "slimish engine",
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = engine.served_model_name
        card = {"id": name, "object": "model", "created": int(engine.started_at), "owned_by": "sglang",
                "root": name, "parent": None, "max_model_len": engine.context_length}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(engine.metrics.render(engine.scheduler), media_type=CONTENT_TYPE_LATEST)

    app.include_router(build_openai_router(engine))
    document_bodies(app, REQUEST_BODIES)
    return app


REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateReqInput, "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/abort_request": AbortReq, "/pause_generation": PauseGenerationReq, "/continue_generation": ContinueGenerationReq,
    "/init_weights_update_group": InitWeightsUpdateGroupReq, "/update_weights_from_distributed": UpdateWeightsFromDistributedReq,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupReq, "/update_weights_from_disk": UpdateWeightsFromDiskReq,
    "/begin_weight_update": BeginWeightUpdateReq, "/update_weight_version": UpdateWeightVersionReq,
    "/get_weights_by_name": GetWeightsByNameReq, "/release_memory_occupation": MemoryOccupationReq,
    "/resume_memory_occupation": MemoryOccupationReq,
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, EngineConfig)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(EngineConfig, args)
    logging.basicConfig(level=cfg.log_level.upper())
    warn_if_exposed("engine", cfg.host, cfg.api_key)
    app = create_app(cfg)  # loads the model before listening: /health is 200 only when ready
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False)
    return 0
