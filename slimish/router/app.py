"""The router's HTTP surface: FastAPI routes over the registry, the policy and the proxy.

`slimish router --worker-urls URL...` serves SGLang's native `/generate`, the OpenAI routes,
sglang-router 0.3.x's worker registry (and the legacy `/add_worker` family slime uses), fan-out
control for the trainer, and health/metrics. One process, one event loop; with `--processes N`,
N such processes on one port (scaleout.py), each built here as a follower of the parent's
registry (shared.py). The serving routes run straight on wire.py's server; the rest on FastAPI.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from slimish.formats.openai import ChatCompletionRequest, CompletionRequest
from slimish.protocol import (
    ROUTING_KEY_HEADER,
    WEIGHT_UPDATE_ROUTES,
    AddWorkerReq,
    GenerateReqInput,
    describe_validation_error,
)
from slimish.router import wire
from slimish.router.config import RouterConfig
from slimish.router.gate import apply_cap, check_key, check_prompt_length, parse_object, prompt_of, read_body
from slimish.router.lora import adapters_of, lora_routes
from slimish.router.metrics import RouterMetrics
from slimish.router.policy import RouteInfo, make_policy
from slimish.router.proxy import PROCESS_HEADER, Proxy, RouterError, error_response
from slimish.router.shared import RegistryFollower
from slimish.router.workers import Worker, WorkerRegistry
from slimish.serving import document_bodies

HotRoute = Callable[[wire.ClientRequest, wire.Connection], Awaitable[None]]

SERVING_POST = ("/generate", "/v1/completions", "/v1/chat/completions")
SERVING_GET = ("/v1/models", "/model_info", "/get_model_info", "/server_info", "/get_server_info")
# Every engine admin route: fanned out to all workers (one result each), or sent to one with
# `?worker=<id or URL>` and its reply passed back as it came. Methods as the engine serves them.
ENGINE_ADMIN = {
    **dict.fromkeys(
        (
            "/pause_generation",
            "/continue_generation",
            "/abort_request",
            *WEIGHT_UPDATE_ROUTES,
        ),
        ("POST",),
    ),
    **dict.fromkeys(
        (
            "/flush_cache",
            "/get_weights_by_name",
            "/get_weight_version",
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/start_profile",
            "/stop_profile",
        ),
        ("GET", "POST"),
    ),
}


def create_app(cfg: RouterConfig, follower: RegistryFollower | None = None) -> "Router":
    """The router; with `follower`, one of `--processes N` processes: it serves the serving and
    health routes itself over the parent's registry, and passes every other route to the parent."""
    workers = WorkerRegistry(cfg)
    refresh = follower.attach(workers) if follower is not None else None
    for url in cfg.worker_urls if follower is None else ():
        workers.add(url)
    policy = make_policy(cfg)
    metrics = RouterMetrics(workers)
    proxy = Proxy(cfg, workers, policy, metrics)
    if follower is not None:
        proxy.reply_headers.append((PROCESS_HEADER, str(follower.index)))
    admin_key = cfg.admin_api_key if cfg.admin_api_key is not None else cfg.api_key

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        checks = None
        if follower is None:  # a follower's registry is the parent's, checked there
            await workers.check_all()
            checks = asyncio.create_task(workers.run_health_checks())
        try:
            yield
        finally:
            if checks is not None:
                checks.cancel()
            await proxy.close()

    app = FastAPI(title="slimish router", lifespan=lifespan, docs_url=None, redoc_url=None)
    document_bodies(
        app,
        {
            "/generate": GenerateReqInput,
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
        },
    )

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return error_response(400, f"{request.method} {request.url.path}: {problems}")

    def admin(request: Request) -> None:
        check_key(request, admin_key, "--admin-api-key" if cfg.admin_api_key is not None else "--api-key")

    _health_routes(app, workers, metrics)
    if follower is None:
        _registry_routes(app, cfg, workers, admin)
        _engine_admin_routes(app, cfg, workers, proxy, admin)
        lora_routes(app, cfg, workers, proxy, admin)
    else:
        follower.pass_the_rest(app, cfg, proxy)
    return Router(app, _serving_routes(cfg, proxy, policy, metrics, workers), cfg, metrics, workers, refresh)


def _serving_routes(
    cfg: RouterConfig, proxy: Proxy, policy: Any, metrics: RouterMetrics, workers: WorkerRegistry
) -> dict[str, tuple[HotRoute, tuple[str, ...]]]:
    """The hot paths: each forwarded to a worker chosen by the policy."""

    def serve_post(route: str) -> HotRoute:
        async def handler(request: wire.ClientRequest, out: wire.Connection) -> None:
            started = time.perf_counter()
            try:
                check_key(request, cfg.api_key, "--api-key")
                body = request.body  # the server held it to --max-body-bytes
                payload = parse_object(body)
                if cfg.max_prompt_tokens is not None:
                    check_prompt_length(route, payload, cfg.max_prompt_tokens)
                if cfg.max_new_tokens_cap is not None and apply_cap(route, payload, cfg.max_new_tokens_cap):
                    body = json.dumps(payload).encode()
                routing_key = request.headers.get(ROUTING_KEY_HEADER.lower())
                headers = {"content-type": "application/json"}
                if routing_key is not None:
                    headers[ROUTING_KEY_HEADER] = routing_key
                model = payload.get("model") if isinstance(payload.get("model"), str) else None
                info = RouteInfo(
                    prompt_of(route, payload) if policy.needs_prompt else None,
                    routing_key,
                    adapters_of(route, payload, workers.all()),
                    route,
                    model,
                )
                stream = payload.get("stream") is True
                await proxy.forward(out, route, started, request.method, body, headers, info, stream)
            except RouterError as exc:
                metrics.observe(route, exc.status, time.perf_counter() - started)
                exc.write(out)

        return handler

    def serve_get(route: str) -> HotRoute:
        async def handler(request: wire.ClientRequest, out: wire.Connection) -> None:
            started = time.perf_counter()
            try:
                check_key(request, cfg.api_key, "--api-key")
                await proxy.forward(out, route, started, "GET", None, {})
            except RouterError as exc:
                metrics.observe(route, exc.status, time.perf_counter() - started)
                exc.write(out)

        return handler

    hot = {route: (serve_post(route), ("POST", "PUT") if route == "/generate" else ("POST",)) for route in SERVING_POST}
    hot.update({route: (serve_get(route), ("GET",)) for route in SERVING_GET})
    return hot


def _by_url(workers: WorkerRegistry, url: str) -> Worker | None:
    try:
        return workers.by_url(url)
    except ValueError as exc:
        raise RouterError(400, str(exc)) from exc


def _lookup(workers: WorkerRegistry, worker_id: str) -> Worker:
    """By id, or by URL as older routers' `DELETE /workers/<url>` did."""
    worker = workers.get(worker_id) or (_by_url(workers, worker_id) if "://" in worker_id else None)
    if worker is None:
        raise RouterError(404, f"no worker with id {worker_id!r}; GET /workers lists them")
    return worker


def _registry_routes(
    app: FastAPI, cfg: RouterConfig, workers: WorkerRegistry, admin: Callable[[Request], None]
) -> None:
    """The worker registry: sglang-router 0.3.x's shapes, and the legacy ones slime uses."""

    def register(url: Any, model_id: str | None = None) -> Worker:
        try:
            return workers.add(url, model_id, joining=True)
        except ValueError as exc:
            raise RouterError(400, str(exc)) from exc
        except KeyError as exc:
            raise RouterError(409, exc.args[0]) from exc

    @app.get("/workers")
    async def list_workers(request: Request) -> dict[str, Any]:
        admin(request)
        everyone = workers.all()
        return {"workers": [w.as_dict() for w in everyone], "total": len(everyone), "stats": workers.stats()}

    @app.post("/workers", status_code=202)
    async def add_worker(request: Request) -> dict[str, Any]:
        admin(request)
        try:
            req = AddWorkerReq.model_validate(parse_object(await read_body(request, cfg.max_body_bytes)))
        except ValidationError as exc:
            raise RouterError(400, f"POST /workers: {describe_validation_error(exc)}") from None
        worker = register(req.url, req.model_id)
        return {
            "status": "accepted",
            "worker_id": worker.id,
            "url": worker.url,
            "location": f"/workers/{worker.id}",
            "message": "Worker addition queued; it takes traffic once GET /health succeeds",
        }

    @app.get("/workers/{worker_id:path}")
    async def get_worker(worker_id: str, request: Request) -> dict[str, Any]:
        admin(request)
        return _lookup(workers, worker_id).as_dict()

    @app.delete("/workers/{worker_id:path}", status_code=202)
    async def delete_worker(worker_id: str, request: Request) -> dict[str, Any]:
        admin(request)
        worker = _lookup(workers, worker_id)
        workers.remove(worker)
        return {
            "status": "accepted",
            "worker_id": worker.id,
            "url": worker.url,
            "message": f"Worker {worker.url} removed",
        }

    @app.post("/add_worker")
    async def legacy_add(request: Request, url: str) -> PlainTextResponse:
        admin(request)
        worker = register(url)
        return PlainTextResponse(f"Successfully added worker: {worker.url}")

    @app.post("/remove_worker")
    async def legacy_remove(request: Request, url: str) -> PlainTextResponse:
        admin(request)
        worker = _by_url(workers, url)
        if worker is None:
            raise RouterError(404, f"worker {url} is not registered; GET /list_workers lists them")
        workers.remove(worker)
        return PlainTextResponse(f"Successfully removed worker: {worker.url}")

    @app.get("/list_workers")
    async def legacy_list(request: Request) -> dict[str, Any]:
        admin(request)
        return {"urls": [w.url for w in workers.all()]}


def _engine_admin_routes(
    app: FastAPI, cfg: RouterConfig, workers: WorkerRegistry, proxy: Proxy, admin: Callable[[Request], None]
) -> None:
    """Every engine admin route: fanned out (to the unnamed workers, or with `?model=NAME` to
    those registered under NAME), or to the one worker `?worker=` names, named or not."""

    async def engine_admin(request: Request) -> Response:
        admin(request)
        body = await read_body(request, cfg.max_body_bytes) or None
        query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k not in ("worker", "model")])
        target = request.url.path + (f"?{query}" if query else "")
        if (named := request.query_params.get("worker")) is None:
            status, result = await proxy.fan_out(request.method, target, body, request.query_params.get("model"))
            return JSONResponse(result, status_code=status)
        reply = await proxy.control(_lookup(workers, named), request.method, target, body)
        if "status_code" not in reply:
            raise RouterError(502, f"{request.url.path} on {reply['url']}: {reply['error']}")
        if isinstance(reply["body"], str):
            return PlainTextResponse(reply["body"], status_code=reply["status_code"])
        return JSONResponse(reply["body"], status_code=reply["status_code"])

    for route, methods in ENGINE_ADMIN.items():
        app.router.add_route(route, engine_admin, methods=list(methods))


def _health_routes(app: FastAPI, workers: WorkerRegistry, metrics: RouterMetrics) -> None:
    """No key: load balancers and scrapers call these."""

    @app.get("/health")
    @app.get("/liveness")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("OK")

    @app.get("/readiness")
    async def readiness() -> JSONResponse:
        healthy, total = len(workers.healthy()), len(workers.all())
        body = {"status": "ready" if healthy else "not_ready", "healthy_workers": healthy, "total_workers": total}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/health_generate")
    async def health_generate() -> PlainTextResponse:
        healthy = len(workers.healthy())
        return PlainTextResponse(f"{healthy} healthy workers", status_code=200 if healthy else 503)

    @app.get("/get_loads")
    async def get_loads() -> dict[str, Any]:
        return {"workers": [{"worker": w.url, "load": w.inflight} for w in workers.all()]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


class Router:
    """The router app: serving routes dispatched straight from wire.py's server, everything else
    through FastAPI (`app`).

    Here too the concurrency limit: `active` counts serving requests from arrival until their
    reply (a stream's last byte) is written; checked and counted with no await between, so the
    limit is exact (per process with `--processes N`). `refresh`, in a follower, first takes the
    parent's registry if it changed."""

    def __init__(
        self,
        app: FastAPI,
        routes: dict[str, tuple[HotRoute, tuple[str, ...]]],
        cfg: RouterConfig,
        metrics: RouterMetrics,
        workers: WorkerRegistry,
        refresh: Callable[[], None] | None = None,
    ) -> None:
        self.app, self.routes, self.cfg, self.metrics, self.workers, self.refresh = (
            app,
            routes,
            cfg,
            metrics,
            workers,
            refresh,
        )
        self.lifespan = app.router.lifespan_context(app)  # kept: `app` may be wrapped (scaleout.py)
        self.active = 0

    async def handle(self, request: wire.ClientRequest, out: wire.Connection) -> None:
        if self.refresh is not None:
            self.refresh()
        if not ((hit := self.routes.get(request.path)) and request.method in hit[1]):
            return await wire.asgi(self.app, request, out)
        if self.active >= self.cfg.max_concurrent_requests:
            self.metrics.observe(request.path, 429, 0.0)
            message = (
                f"the router is full: {self.active} requests in flight, the limit is "
                f"{self.cfg.max_concurrent_requests} (--max-concurrent-requests); retry after {self.cfg.retry_after_s} s"
            )
            return RouterError(429, message, str(self.cfg.retry_after_s)).write(out)
        self.active += 1
        try:
            await hit[0](request, out)
        finally:
            self.active -= 1

    async def serve(self, sockets: list[socket.socket], **kw: Any) -> None:
        """Serve on `sockets` (wire.serve's keywords: ready, stop, signals), once: the startup
        health checks run before the first request is taken."""
        await wire.serve(self.handle, sockets, max_body=self.cfg.max_body_bytes, lifespan=self.lifespan, **kw)
