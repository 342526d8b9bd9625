"""Async client for SGLang-protocol servers: the built-in engine, SGLang itself, or the router.

Rollout code, the trainer's weight sync and the tests all talk to servers through this class, so
every request body is built from `slimish.protocol` and every failure raises `ServerError`
naming the server, the route and the server's own message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from slimish.protocol import (
    ControlResult,
    GenerateResponse,
    InitWeightsUpdateGroupReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
)


class ServerError(RuntimeError):
    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} -> HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


def _message(r: httpx.Response) -> str:
    """The server's error text, from either SGLang error shape, a control reply, or plain text."""
    try:
        body = r.json()
    except ValueError:
        return r.text
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        if "message" in body:
            return str(body["message"])
    return r.text


class Client:
    """One server. Long timeouts by default: a generate call lasts as long as its tokens take."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Idle sockets are dropped after 4 s, before uvicorn's 5 s keep-alive closes them server-side:
        # with equal timeouts a request sent on a socket the server is closing fails (ReadError).
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=4.0)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, limits=limits)

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(self, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        r = await self.http.request(method, path, json=body, **kw)
        if r.status_code >= 400:
            raise ServerError(self.base_url + path, r.status_code, _message(r))
        return r

    async def _control(self, path: str, body: Any = None) -> ControlResult:
        return ControlResult.model_validate((await self._request("POST", path, body or {})).json())

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, **body: Any) -> GenerateResponse | list[GenerateResponse]:
        """POST /generate with the PROTOCOL.md 1.1 fields as keywords (`input_ids=`, `sampling_params=`...)."""
        data = (await self._request("POST", "/generate", {**body, "stream": False})).json()
        if isinstance(data, list):
            return [GenerateResponse.model_validate(d) for d in data]
        return GenerateResponse.model_validate(data)

    async def generate_stream(self, **body: Any) -> AsyncIterator[GenerateResponse]:
        """Cumulative chunks as the server sends them; an error chunk raises."""
        async with self.http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            if r.status_code >= 400:
                await r.aread()
                raise ServerError(self.base_url + "/generate", r.status_code, _message(r))
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ServerError(self.base_url + "/generate", chunk["error"].get("code", 500), chunk["error"]["message"])
                yield GenerateResponse.model_validate(chunk)

    async def chat(self, **body: Any) -> dict[str, Any]:
        """POST /v1/chat/completions (OpenAI body as keywords)."""
        return (await self._request("POST", "/v1/chat/completions", body)).json()

    async def completions(self, **body: Any) -> dict[str, Any]:
        return (await self._request("POST", "/v1/completions", body)).json()

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> None:
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    # ---- weights ----------------------------------------------------------------------------

    async def init_weights_update_group(self, req: InitWeightsUpdateGroupReq) -> ControlResult:
        return await self._control("/init_weights_update_group", req.model_dump())

    async def update_weights_from_distributed(self, req: UpdateWeightsFromDistributedReq) -> ControlResult:
        return await self._control("/update_weights_from_distributed", req.model_dump())

    async def destroy_weights_update_group(self, group_name: str) -> ControlResult:
        return await self._control("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk(self, req: UpdateWeightsFromDiskReq) -> ControlResult:
        return await self._control("/update_weights_from_disk", req.model_dump())

    async def begin_weight_update(self) -> bool:
        """Open a weight-update session; False if the server predates sessions (404)."""
        try:
            await self._control("/begin_weight_update", {"selector": "all"})
        except ServerError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def end_weight_update(self) -> ControlResult:
        return await self._control("/end_weight_update", {})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> ControlResult:
        return await self._control("/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests})

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        return (await self._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})).json()

    # ---- info -------------------------------------------------------------------------------

    async def health(self) -> bool:
        try:
            return (await self.http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def model_info(self) -> dict[str, Any]:
        return (await self._request("GET", "/model_info")).json()

    async def server_info(self) -> dict[str, Any]:
        return (await self._request("GET", "/server_info")).json()
