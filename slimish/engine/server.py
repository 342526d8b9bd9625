"""`slimish engine`: the built-in engine's HTTP server, SGLang's native protocol (docs/protocol.md).

Routes parse bodies with `slimish.protocol`, hand work to `Engine`, and shape replies exactly as
SGLang 0.5.23 does, including its error bodies, so that clients, sglang-router and the trainer
cannot tell this server from SGLang on the paths RL uses.
"""

from __future__ import annotations

import argparse
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import slimish
from slimish.engine.api_generate import build_generate_router
from slimish.engine.api_info import build_info_router
from slimish.engine.api_lora import build_lora_router
from slimish.engine.api_weights import build_weights_router
from slimish.engine.config import EngineConfig
from slimish.engine.engine import Engine, Overloaded, Unavailable
from slimish.engine.http import BadRequest, BodyLimit, BodyTooLarge, KeyCheck, error_message
from slimish.engine.items import RequestError
from slimish.engine.openai_api import build_openai_router
from slimish.flags import add_config_arguments, config_from_args
from slimish.formats.openai import ChatCompletionRequest, CompletionRequest
from slimish.protocol import (
    WEIGHT_UPDATE_ROUTES,
    AbortReq,
    BeginWeightUpdateReq,
    ContinueGenerationReq,
    DestroyWeightsUpdateGroupReq,
    DetokenizeRequest,
    GenerateReqInput,
    GetWeightsByNameReq,
    GetWeightVersionReq,
    InitWeightsUpdateGroupReq,
    LoadLoraAdapterReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    ProfileReq,
    TokenizeRequest,
    UnloadLoraAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightVersionReq,
)
from slimish.serving import document_bodies, run_uvicorn, warn_if_exposed

log = logging.getLogger(__name__)

OPEN_ROUTES = {"/health", "/health_generate", "/ready", "/metrics"}
ADMIN_ROUTES = {
    *WEIGHT_UPDATE_ROUTES,
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/abort_request",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/start_profile",
    "/stop_profile",
    "/load_lora_adapter",
    "/unload_lora_adapter",
}


def create_app(cfg: EngineConfig, engine: Engine | None = None) -> FastAPI:
    engine = engine or Engine(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="slimish engine", version=slimish.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)

    def key_of(path: str) -> str | None:
        if path in OPEN_ROUTES:
            return None
        return (cfg.admin_api_key or cfg.api_key) if path in ADMIN_ROUTES else cfg.api_key

    app.add_middleware(KeyCheck, key_of=key_of)  # added last: runs first

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

    routers = (
        build_generate_router(engine),
        build_weights_router(engine),
        build_lora_router(engine),
        build_info_router(engine, cfg),
        build_openai_router(engine),
    )
    for router in routers:
        app.include_router(router)
    document_bodies(app, REQUEST_BODIES)
    return app


REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateReqInput,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/abort_request": AbortReq,
    "/pause_generation": PauseGenerationReq,
    "/continue_generation": ContinueGenerationReq,
    "/init_weights_update_group": InitWeightsUpdateGroupReq,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedReq,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupReq,
    "/update_weights_from_disk": UpdateWeightsFromDiskReq,
    "/begin_weight_update": BeginWeightUpdateReq,
    "/update_weight_version": UpdateWeightVersionReq,
    "/get_weights_by_name": GetWeightsByNameReq,
    "/release_memory_occupation": MemoryOccupationReq,
    "/resume_memory_occupation": MemoryOccupationReq,
    "/tokenize": TokenizeRequest,
    "/v1/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
    "/start_profile": ProfileReq,
    "/get_weight_version": GetWeightVersionReq,
    "/load_lora_adapter": LoadLoraAdapterReq,
    "/unload_lora_adapter": UnloadLoraAdapterReq,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, EngineConfig)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(EngineConfig, args)
    logging.basicConfig(level=cfg.log_level.upper())
    warn_if_exposed("engine", cfg.host, cfg.api_key)
    app = create_app(cfg)  # loads the model before listening: /health is 200 only when ready
    return run_uvicorn(app, cfg.host, cfg.port, cfg.fd, cfg.log_level)
