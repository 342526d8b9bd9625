"""LoRA adapter routes (SGLang's): `/load_lora_adapter` and `/unload_lora_adapter`.

Loading a name that is loaded is an error, as in SGLang; refreshing an adapter from disk is an
unload and a load. Pushing new adapter weights from a trainer goes by broadcast instead
(`/update_weights_from_distributed` with `lora_name`, api_weights.py), or, for an adapter loaded
from a colocated trainer's shared store, by `/update_weight_version` with `lora_name`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from slimish.engine.engine import Engine
from slimish.engine.http import parse
from slimish.engine.lora import AdapterError, AdapterRef
from slimish.protocol import LoadLoraAdapterReq, LoraUpdateResult, UnloadLoraAdapterReq


def build_lora_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    def result(error: Exception | None) -> JSONResponse:
        loaded = engine.lora.loaded() if engine.lora is not None else {}
        body = LoraUpdateResult(
            success=error is None, error_message=None if error is None else str(error), loaded_adapters=loaded
        )
        return JSONResponse(body.model_dump(), status_code=200 if error is None else 400)

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        req = await parse(request, LoadLoraAdapterReq, empty_ok=False)
        try:
            await engine.load_adapter(AdapterRef(req.lora_name, req.lora_path, req.pinned), req.weight_version)
        except (AdapterError, OSError) as exc:
            return result(exc)
        return result(None)

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        req = await parse(request, UnloadLoraAdapterReq, empty_ok=False)
        try:
            await engine.unload_adapter(req.lora_name)
        except AdapterError as exc:
            return result(exc)
        return result(None)

    return router
