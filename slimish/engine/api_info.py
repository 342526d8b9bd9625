"""What clients read about the engine: health, model and server info, the model list, Prometheus
metrics, tokenizing, profiling, and a JSON 501 for SGLang routes this engine does not serve."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import slimish
from slimish.engine.config import EngineConfig
from slimish.engine.engine import Engine
from slimish.engine.http import BadRequest, parse
from slimish.engine.items import Item
from slimish.engine.profiler import ProfileError
from slimish.engine.scheduler import LogprobWish
from slimish.formats.template import TemplateError
from slimish.protocol import DetokenizeRequest, ProfileReq, SamplingParams, TokenizeRequest


def build_info_router(engine: Engine, cfg: EngineConfig) -> APIRouter:
    router = APIRouter()
    _health_routes(router, engine)
    _info_routes(router, engine, cfg)
    _models_routes(router, engine)
    _tokenizer_routes(router, engine)
    _profile_routes(router, engine)
    for path, why in UNSERVED.items():  # never a bare 404 for an SGLang route
        router.add_api_route(
            path, _unserved(path, why), methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False
        )
    return router


def _health_routes(router: APIRouter, engine: Engine) -> None:
    @router.get("/health")
    @router.get("/ready")
    async def health() -> Response:
        return Response(status_code=503 if engine.weights.torn else 200)

    @router.get("/health_generate")
    async def health_generate() -> Response:
        if engine.weights.torn:
            return Response(status_code=503)
        if any(engine.in_flight()):
            return Response(status_code=200)
        item = Item(
            [0], SamplingParams(max_new_tokens=1, temperature=0.0), f"health-{time.monotonic_ns()}", LogprobWish()
        )
        try:
            await asyncio.wait_for(engine.generate([item]), timeout=20)
        except asyncio.TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)


def _info_routes(router: APIRouter, engine: Engine, cfg: EngineConfig) -> None:
    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        config = engine.model.config
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "load_format": None,
            "reasoning_parser": engine.format.reasoning_parser,
            "tool_call_parser": engine.format.tool_call_parser,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.model_type,
            "architectures": config.architectures,
        }

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        running, waiting = engine.in_flight()
        args = {k: v for k, v in vars(cfg).items() if k not in ("api_key", "admin_api_key")}
        capacity = engine.context_length * cfg.max_running_requests
        ranks = {"dp_size": 1, "attn_dp_size": 1, "tp_size": 1, "pp_size": 1}
        weight_gb = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 1e9
        state = {  # one per data-parallel rank, as SGLang: what bench_one_batch_server reads
            **args,
            **ranks,
            "world_size": 1,
            "startup_time": engine.started_at,
            "effective_max_running_requests_per_dp": cfg.max_running_requests,
            "last_gen_throughput": engine.last_gen_throughput,
            "memory_usage": {
                "weight": round(weight_gb, 3),
                "kvcache": engine.kv_cache_bytes() / 1e9,  # GB, as "weight"; read between steps or not, roughly
                "token_capacity": capacity,
                "token_capacity_swa": None,
                "graph": {},
            },
            "#running-req": running,
            "#queue-req": waiting,
        }
        return {
            **args,
            **ranks,
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "context_length": engine.context_length,
            "status": "ready",
            "max_total_num_tokens": capacity,
            "max_req_input_len": engine.context_length - 1,
            "page_size": cfg.page_size,  # the prefix cache's unit
            "disable_radix_cache": cfg.disable_radix_cache,
            "startup_time": engine.started_at,
            "internal_states": [state],
            "version": slimish.__version__,
            "frontend": "python",
            "launch_command": "slimish engine",
        }

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)


def _models_routes(router: APIRouter, engine: Engine) -> None:
    """`/v1/models`: the base model and each loaded LoRA adapter."""

    def card() -> dict[str, Any]:
        name = engine.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": int(engine.started_at),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": engine.context_length,
        }

    def adapter_cards() -> dict[str, dict[str, Any]]:
        """One card per loaded LoRA adapter, its parent the base model (as SGLang lists them)."""
        loaded = engine.lora.loaded() if engine.lora is not None else {}
        return {
            name: {**card(), "id": name, "root": path, "parent": engine.served_model_name}
            for name, path in loaded.items()
        }

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(), *adapter_cards().values()]}

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model == engine.served_model_name:
            return JSONResponse(card())
        if (adapter := adapter_cards().get(model)) is not None:
            return JSONResponse(adapter)
        error = {
            "message": f"The model '{model}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return JSONResponse({"error": error}, status_code=404)


def _tokenizer_routes(router: APIRouter, engine: Engine) -> None:
    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = await parse(request, TokenizeRequest, empty_ok=False)
        if req.messages is not None:
            generation = True if req.add_generation_prompt is None else req.add_generation_prompt
            try:
                tokens: Any = engine.format.template.render(
                    req.messages, req.tools, generation, **(req.chat_template_kwargs or {})
                )
            except TemplateError as exc:
                raise BadRequest.of(str(exc)) from None
        elif isinstance(req.prompt, str):
            tokens = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            tokens = [engine.tokenizer.encode(p, add_special_tokens=req.add_special_tokens) for p in req.prompt]
        count = len(tokens) if not tokens or isinstance(tokens[0], int) else [len(t) for t in tokens]
        return JSONResponse({"tokens": tokens, "count": count, "max_model_len": engine.context_length})

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await parse(request, DetokenizeRequest, empty_ok=False)
        batch = bool(req.tokens) and isinstance(req.tokens[0], list)
        for ids in req.tokens if batch else [req.tokens]:
            if bad := [t for t in ids if not 0 <= t < engine.vocab_size]:
                raise BadRequest.of(f"tokens: token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})")
        decode = lambda ids: engine.decode(ids, req.skip_special_tokens)  # noqa: E731
        return JSONResponse({"text": [decode(ids) for ids in req.tokens] if batch else decode(req.tokens)})


def _profile_routes(router: APIRouter, engine: Engine) -> None:
    @router.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request) -> PlainTextResponse:
        req = await parse(request, ProfileReq)
        try:
            await engine.run(lambda: engine.profiler.start(req))
        except ProfileError as exc:
            raise BadRequest.of(str(exc)) from None
        return PlainTextResponse("Start profiling.\n")

    @router.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> PlainTextResponse:
        try:
            await engine.run(engine.profiler.stop)
        except ProfileError as exc:
            raise BadRequest.of(str(exc)) from None
        return PlainTextResponse("Stop profiling. This will take some time.\n")


def _unserved(path: str, why: str) -> Any:
    async def handler() -> JSONResponse:
        return JSONResponse(
            {"error": {"message": f"{path}: not implemented by the slimish built-in engine{why}"}}, status_code=501
        )

    return handler


# SGLang 0.5.23's routes (srt/entrypoints/http_server.py) that the built-in engine leaves out.
UNSERVED = {
    "/update_weights_from_tensor": " (its body is pickled tensors, which this engine never unpickles); push weights by "
    "broadcast (/init_weights_update_group, /update_weights_from_distributed) or from disk (/update_weights_from_disk)",
    **{
        path: ""
        for path in (
            "/encode",
            "/classify",
            "/set_internal_state",
            "/update_weights_from_ipc",
            "/weights_checker",
            "/slow_down",
            "/init_weights_send_group_for_remote_instance",
            "/send_weights_to_remote_instance",
            "/get_remote_instance_transfer_engine_info",
            "/remote_instance_transfer_engine_info",
            "/load_lora_adapter_from_tensors",
            "/open_session",
            "/close_session",
            "/configure_logging",
            "/parse_function_call",
            "/separate_reasoning",
            "/set_trace_level",
            "/freeze_gc",
            "/pd_role_switch",
            "/start_expert_distribution_record",
            "/stop_expert_distribution_record",
            "/dump_expert_distribution_record",
            "/add_external_corpus",
            "/remove_external_corpus",
            "/list_external_corpora",
            "/hicache/storage-backend",
            "/hicache/storage-backend/clear",
            "/get_hicache_l3_cache_layout",
            "/v1/embeddings",
            "/v1/classify",
            "/v1/score",
            "/v1/decisions",
            "/v1/rerank",
            "/v1/audio/transcriptions",
            "/v1/responses",
            "/v1/responses/{response_id}",
            "/v1/responses/{response_id}/cancel",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/loads",
            "/scale_elastic_ep",
            "/is_scaling_elastic_ep",
            "/api/chat",
            "/api/generate",
            "/api/tags",
            "/api/show",
        )
    },
}
