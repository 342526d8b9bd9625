"""Weight updates: the broadcast group (init / update / destroy), from disk, versions, the
0.5.23 update session, reading a weight back, and memory release (the KV cache, on CPU)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from slimish.engine.engine import Engine
from slimish.engine.http import control, error_message, parse
from slimish.engine.items import RequestError
from slimish.engine.weights import Tensors
from slimish.protocol import (
    BeginWeightUpdateReq,
    DestroyWeightsUpdateGroupReq,
    GetWeightsByNameReq,
    GetWeightVersionReq,
    InitWeightsUpdateGroupReq,
    MemoryOccupationReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightVersionReq,
)


def build_weights_router(engine: Engine) -> APIRouter:
    router = APIRouter()
    _broadcast_routes(router, engine)
    _session_routes(router, engine)
    _update_routes(router, engine)
    return router


def _broadcast_routes(router: APIRouter, engine: Engine) -> None:
    """The trainer's path: a process group, then broadcasts into it."""

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        req = await parse(request, InitWeightsUpdateGroupReq)
        try:  # blocks until every rank joined: off the scheduler thread, generation goes on
            await asyncio.to_thread(engine.weights.init_group, req)
        except Exception as exc:
            return control(False, f"Failed to initialize custom process group: {exc}.")
        return control(True, "Succeeded to initialize custom process group.")

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        req = await parse(request, UpdateWeightsFromDistributedReq)
        fail = "Failed to update parameter online: {exc}. Please discard the whole weights."
        if req.lora_name is None:
            load = lambda: engine.weights.update_from_distributed(req)  # noqa: E731
        else:  # an adapter-only push (slimish extension): the named adapter's PEFT tensors
            try:
                target = adapter_tensors(engine, req.lora_name)
                if engine.adapter(req.lora_name, "lora_name").mapped:
                    raise RequestError(
                        f"lora_name: lora adapter {req.lora_name!r} is mapped from a colocated trainer's store; "
                        "version it with /update_weight_version and lora_name"
                    )
            except RequestError as exc:  # refused before any receive: the trainer's broadcast would hang otherwise
                return control(False, fail.format(exc=exc))

            def load() -> None:
                try:
                    engine.weights.update_from_distributed(req, target)
                finally:  # its slot holds what arrived whole; a torn adapter is refused anyway
                    engine.lora.refresh(req.lora_name)

        update = engine.load_weights(load, req.weight_version, req.lora_name, req.abort_all_requests)
        return await reply_to_update(engine, update, req, "Succeeded to update parameter online.", fail, req.lora_name)

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        req = await parse(request, DestroyWeightsUpdateGroupReq)
        try:
            await engine.run(lambda: engine.weights.destroy_group(req.group_name))
        except Exception as exc:
            return control(False, str(exc))
        return control(True, "Succeeded to destroy custom process group.")


def _session_routes(router: APIRouter, engine: Engine) -> None:
    """The 0.5.23 begin/end weight-update session. Begin and end run as SGLang's do, under its
    writer lock unless paused: they wait until no request runs (sglang 0.5.23:
    python/sglang/srt/managers/tokenizer_control_mixin.py:471), which is what drains a
    `weight_sync.pause_mode=drain` push."""
    session = {"open": False}

    def toggle(opening: bool) -> bool:
        if session["open"] == opening:
            return False
        session["open"] = opening
        return True

    @router.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> JSONResponse:
        await parse(request, BeginWeightUpdateReq)
        if not await engine.run(lambda: toggle(True), needs_idle=True):
            return control(False, "a weight-update session is already open; call end_weight_update() first")
        return control(True, "Weight-update session opened.")

    @router.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        if not await engine.run(lambda: toggle(False), needs_idle=True):
            return control(False, "no weight-update session is open; call begin_weight_update() first")
        return control(True, "Weight-update session closed.")


def _update_routes(router: APIRouter, engine: Engine) -> None:
    """Loading from disk, versioning, and reading weights and versions back."""

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        req = await parse(request, UpdateWeightsFromDiskReq)
        return await reply_to_update(
            engine,
            engine.load_weights_from_disk(req.model_path, req.weight_version, req.abort_all_requests),
            req,
            "Succeeded to update model weights.",
            "Failed to update weights: {exc}. Rolled back to the previous weights.",
            num_paused_requests=0,
        )

    @router.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        req = await parse(request, UpdateWeightVersionReq)
        if req.lora_name is None:
            await engine.set_weight_version(req.new_version, req.abort_all_requests)
        else:
            name = req.lora_name
            try:
                engine.adapter(name, "lora_name")
            except RequestError as exc:
                return control(False, str(exc))
            await engine.load_weights(lambda: engine.lora.refresh(name), req.new_version, name, req.abort_all_requests)
        return JSONResponse(
            {"success": True, "message": f"Weight version updated to {req.new_version}", "new_version": req.new_version}
        )

    @router.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> JSONResponse:
        req = await parse(request, GetWeightsByNameReq, empty_ok=False)
        try:
            target = None if req.lora_name is None else adapter_tensors(engine, req.lora_name)
            return JSONResponse(
                await engine.run(lambda: engine.weights.get_weights_by_name(req.name, req.truncate_size, target))
            )
        except ValueError as exc:
            return control(False, str(exc))

    @router.api_route("/get_weight_version", methods=["GET", "POST"])
    async def get_weight_version(request: Request) -> JSONResponse:
        """slimish's: the base model's version (`/model_info` has it too), or with `lora_name` an adapter's."""
        body = await parse(request, GetWeightVersionReq)
        name = request.query_params.get("lora_name", body.lora_name)
        try:
            version = engine.weight_version if name is None else engine.adapter(name, "lora_name").version
        except RequestError as exc:
            return control(False, str(exc))
        return JSONResponse({"weight_version": version, "lora_name": name})

    @router.api_route("/release_memory_occupation", methods=["GET", "POST"])
    @router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def memory_occupation(request: Request) -> JSONResponse:
        """SGLang replies `null`, or a 400 when it cannot (a release while requests run)."""
        req = await parse(request, MemoryOccupationReq)
        try:
            await engine.occupy_memory(req.tags, release=request.url.path == "/release_memory_occupation")
        except ValueError as exc:
            return error_message(str(exc))
        return JSONResponse(None)


def adapter_tensors(engine: Engine, name: str) -> Tensors:
    """A loaded adapter's tensors as a push target (its torn record shared)."""
    adapter = engine.adapter(name, "lora_name")
    return Tensors(adapter.tensors, f"a tensor of lora adapter {name!r}", adapter.torn)


async def reply_to_update(
    engine: Engine, update: Awaitable[None], req: Any, ok: str, fail: str, lora_name: str | None = None, **extra: Any
) -> JSONResponse:
    """Await `update` (an `Engine.load_weights`) and reply as SGLang does; a failure that left the
    weights torn says so."""
    try:
        await update
    except Exception as exc:
        torn = engine.torn_error(lora_name)
        return control(False, fail.format(exc=exc) + (f" ({torn})" if torn is not None else ""), **extra)
    note = f" Weight version updated to {req.weight_version}." if req.weight_version is not None else ""
    return control(True, ok + note, **extra)
