"""`slimish tinker --model DIR`: the Tinker API (SDK `tinker` 0.38) on this machine.

Each `create_model` is a LoRA adapter on the one base model held here (slimish/tinker/training.py),
trained on one worker thread in each model's `seq_id` order (futures.py); sampling sessions are
adapters loaded into a built-in engine child (sampling.py); `tinker://` paths are directories under
`ROOT/checkpoints/` (runs.py). The routes are in routes.py.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slimish.flags import add_config_arguments, config_from_args
from slimish.serving import run_uvicorn
from slimish.tinker.config import TinkerConfig
from slimish.tinker.futures import Futures, Ordered, UserError
from slimish.tinker.routes import HEALTH, ROUTERS, Api
from slimish.tinker.runs import Runs
from slimish.tinker.sampling import Sampler
from slimish.tinker.training import TinkerModels
from slimish.tinker.wire import WireError


def build_app(cfg: TinkerConfig, models: TinkerModels, engine_url: str) -> FastAPI:
    """The API over `models` (trained here) and the engine at `engine_url` (sampling)."""
    api = Api(
        cfg,
        models,
        Runs(Path(cfg.root)),
        Futures(cfg.poll_s),
        Ordered(cfg.seq_gap_s),
        Sampler(engine_url, cfg.keep_snapshots),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        api.ordered.close()
        await api.sampler.close()

    app = FastAPI(title="slimish tinker", lifespan=lifespan)

    @app.middleware("http")
    async def api_key(request: Request, call_next: Any) -> Response:
        given = request.headers.get("x-api-key", "").encode()
        if cfg.api_key and request.url.path != HEALTH and not hmac.compare_digest(given, cfg.api_key.encode()):
            return JSONResponse({"detail": "X-API-Key: missing or wrong"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(WireError)
    @app.exception_handler(UserError)
    async def bad_request(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "category": "user"}, status_code=400)

    for routes in ROUTERS:
        app.include_router(routes(api))
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TinkerConfig)


def run(args: argparse.Namespace) -> int:
    from slimish.launch.local import engine_process

    try:
        cfg = config_from_args(TinkerConfig, args)
    except ValueError as exc:
        raise SystemExit(f"slimish tinker: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    root = Path(cfg.root)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    engine = engine_process(
        cfg.model,
        log_path=root / "logs" / "engine.log",
        device=cfg.device,
        enable_lora=True,
        max_lora_rank=cfg.max_lora_rank,
        lora_target_modules=["all", "lm_head"],  # train_unembed (Tinker's default) adapts the LM head
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # reach the finally: no orphan engine
    try:
        engine.launch()  # loads while the base model loads here
        models = TinkerModels(
            cfg.model,
            device=cfg.device,
            micro_batch_tokens=cfg.micro_batch_tokens,
            chunk_tokens=cfg.logprob_chunk_tokens,
        )
        engine.wait_healthy(cfg.start_timeout)
        print(f"slimish tinker: serving {cfg.model_name or cfg.model} at http://{cfg.host}:{cfg.port}", flush=True)
        return run_uvicorn(build_app(cfg, models, engine.url), cfg.host, cfg.port, cfg.fd, "warning")
    finally:
        engine.stop()
