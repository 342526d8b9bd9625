"""LoRA in the router: which worker holds which adapter, which adapters a request needs, and the
load / unload routes fanned out to every worker.

Why: workers may hold different adapter sets (an adapter is loaded where it is trained or
served), and a request for adapter A must never run on a worker that lacks A (an engine would
refuse it; SGLang behind another gateway might serve the base model). The router learns the
sets from each worker's `/v1/models` when the worker turns healthy (added, or back after a
restart, which empties it) and from every `/load_lora_adapter` / `/unload_lora_adapter` reply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from slimish.protocol import LoadLoraAdapterReq, LoraUpdateResult, UnloadLoraAdapterReq, describe_validation_error
from slimish.router.config import RouterConfig
from slimish.router.gate import parse_object, read_body
from slimish.router.proxy import Proxy, RouterError
from slimish.router.workers import Worker, WorkerRegistry

LORA_ROUTES = {"/load_lora_adapter": LoadLoraAdapterReq, "/unload_lora_adapter": UnloadLoraAdapterReq}


def adapters_of(route: str, payload: dict[str, Any], workers: list[Worker]) -> frozenset[str]:
    """The adapters a serving request names: `/generate`'s `lora_path` (a name, or one per batch
    item), or an OpenAI body's `model` when it is an adapter some worker holds or SGLang's
    `base:adapter` form. Any other `model` passes on: the engine decides (a base model name, or
    a 400 from an engine with LoRA on)."""
    if route == "/generate":
        names = payload.get("lora_path")
        names = names if isinstance(names, list) else [names]
        return frozenset(n for n in names if isinstance(n, str))
    model = payload.get("model")
    if not isinstance(model, str):
        return frozenset()
    if any(model in w.adapters for w in workers):
        return frozenset([model])
    base, sep, name = model.rpartition(":")
    if sep and any(base == w.metadata.get("served_model_name") for w in workers):
        return frozenset([name])
    return frozenset()


def learn(worker: Worker, reply: Any) -> None:
    """Take a worker's adapter set from its `/load_lora_adapter` or `/unload_lora_adapter` reply."""
    if isinstance(reply, dict) and isinstance(reply.get("loaded_adapters"), dict):
        worker.adapters = set(reply["loaded_adapters"])


def lora_routes(
    app: FastAPI, cfg: RouterConfig, workers: WorkerRegistry, proxy: Proxy, admin: Callable[[Request], None]
) -> None:
    """`/load_lora_adapter` and `/unload_lora_adapter`, to every worker: success only if all
    succeeded, each worker's reply kept under `workers`."""

    async def handler(request: Request) -> JSONResponse:
        admin(request)
        body = await read_body(request, cfg.max_body_bytes)
        try:
            LORA_ROUTES[request.url.path].model_validate(parse_object(body))
        except ValidationError as exc:  # refused here, before any worker is asked
            raise RouterError(400, f"{request.url.path}: {describe_validation_error(exc)}") from None
        status, result = await proxy.fan_out("POST", request.url.path, body)
        errors, loaded = [], {}
        for reply in result["workers"]:
            worker = workers.get(reply["worker_id"])
            if worker is not None:
                learn(worker, reply.get("body"))
            if isinstance(reply.get("body"), dict):
                loaded.update(reply["body"].get("loaded_adapters") or {})
            if not reply["success"]:
                errors.append(f"{reply['url']}: {_error_of(reply)}")
        answer = LoraUpdateResult(
            success=not errors,
            error_message="; ".join(errors) or None,
            loaded_adapters=loaded,
            workers=result["workers"],
        )
        unreachable = any("status_code" not in r for r in result["workers"])
        return JSONResponse(answer.model_dump(), status_code=200 if not errors else 502 if unreachable else 400)

    for route in LORA_ROUTES:
        app.router.add_route(route, handler, methods=["POST"])


def _error_of(reply: dict[str, Any]) -> str:
    body = reply.get("body")
    if isinstance(body, dict):
        message = body.get("error_message") or body.get("error")
        return str(message.get("message", message) if isinstance(message, dict) else message)
    return str(reply.get("error") or body)
