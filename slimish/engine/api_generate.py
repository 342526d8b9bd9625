"""Generation and its control: `/generate` (streamed or not), abort, pause / continue, flush."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from slimish.engine.engine import Engine
from slimish.engine.http import parse
from slimish.protocol import AbortReq, ContinueGenerationReq, GenerateReqInput, PauseGenerationReq

FLUSH_OK = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"


def build_generate_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await parse(request, GenerateReqInput, empty_ok=False, contract=True)
        items = engine.items_from_generate(body)
        batch = body.is_batch or len(items) > 1
        text_lp = body.return_text_in_logprobs
        if body.stream:
            updates = engine.submit(items, stream=True)  # scheduled now: a full engine is a 503, not a broken stream
            return StreamingResponse(stream_native(updates, batch, text_lp), media_type="text/event-stream")
        reqs = await engine.generate(items)
        out = [engine.reply(r, len(r.output_ids), True, text_lp) for r in reqs]
        return JSONResponse(out if batch else out[0])

    async def stream_native(
        progress: AsyncIterator[tuple[list[Any], Any]], batch: bool, text_lp: bool
    ) -> AsyncIterator[str]:
        reqs: list[Any] = []
        async with aclosing(progress) as updates:  # a client gone aborts
            async for reqs, up in updates:
                chunk = engine.reply(reqs[up.index], up.n, up.finished, text_lp)
                if batch:
                    chunk["index"] = up.index
                yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    @router.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = await parse(request, AbortReq)
        await engine.abort(req.rid, req.abort_all)
        return Response(status_code=200)

    @router.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        req = await parse(request, PauseGenerationReq)
        await engine.pause(req.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @router.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await parse(request, ContinueGenerationReq)
        await engine.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if not await engine.flush_cache():
            return PlainTextResponse("Cache not flushed because there are pending requests.\n", status_code=400)
        return PlainTextResponse(FLUSH_OK)

    return router
