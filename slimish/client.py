"""Async client for SGLang-protocol servers: the built-in engine, SGLang itself, or the router.

Rollout code, the trainer's weight sync and the tests all talk to servers through this class, so
every request body is built from `slimish.protocol` and every failure raises `ServerError`
naming the server, the route and the server's own message (`ServerUnreachable` when no HTTP
reply came back at all).

aiohttp, not httpx: a rollout sends thousands of small requests per step from one event loop,
and on these CPUs httpx spends 3.7-6.3 ms of CPU per request against 0.76 ms for aiohttp
(benchmarks/rollout_throughput.py measures what that costs end to end).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from slimish.protocol import (
    ROUTING_KEY_HEADER,
    ControlResult,
    GenerateResponse,
    InitWeightsUpdateGroupReq,
    LoadLoraAdapterReq,
    LoraUpdateResult,
    UnloadLoraAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    auth_headers,
)

RECONNECT_EVERY_S = 0.2  # while a server is gone (`reconnect_s`), a request is sent again this often


class ServerError(RuntimeError):
    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} -> HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


class ServerUnreachable(ServerError):
    """No HTTP reply: refused, reset, or timed out. `status` is 0."""

    def __init__(self, url: str, exc: BaseException) -> None:
        RuntimeError.__init__(self, f"{url} -> no reply: {type(exc).__name__}: {exc}")
        self.url, self.status, self.message = url, 0, f"{type(exc).__name__}: {exc}"


def _message(status: int, raw: bytes) -> str:
    """The server's error text, from either SGLang error shape, a control reply, or plain text."""
    text = raw.decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        return text
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        if "message" in body:
            return str(body["message"])
        if body.get("error_message"):  # the LoRA routes' replies
            return str(body["error_message"])
    return text


def _gone(exc: BaseException) -> bool:
    """No reply because the server is not there (refused, reset, closed mid-reply), as opposed to
    a server too slow to answer (a timeout: sending again would only add load)."""
    return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)) and not isinstance(
        exc, asyncio.TimeoutError
    )


class Client:
    """One server. Long timeouts by default: a generate call lasts as long as its tokens take.

    The aiohttp session is opened on first use, on the event loop that uses it; a client stays
    on that loop."""

    def __init__(
        self, base_url: str, api_key: str | None = None, timeout: float = 600.0, reconnect_s: float = 0.0
    ) -> None:
        """`reconnect_s`: how long a request that got no reply because the server was gone
        (refused, or the connection cut before a whole reply) is sent again, for a server that
        comes back on the same port (a run's router, restarted by its launcher). Only for
        requests safe to repeat: a reply never read recorded nothing (a generate's tokens)."""
        self.base_url = base_url.rstrip("/")
        self.reconnect_s = reconnect_s
        self.headers = auth_headers(api_key)
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Idle sockets are dropped after 2 s, well before uvicorn's (and the router's) 5 s
            # keep-alive closes them server-side. The server's clock starts when it has written a
            # reply, ours when we have read it: on a loaded machine that gap passed the 1 s a 4 s
            # timeout left, and a request sent on a socket the server was closing failed (a 502
            # in the gateway's training test, under load average 8 on 2 cores).
            connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers, timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """The reply's JSON (None for an empty body)."""
        url = self.base_url + path
        kw = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
        gone_since: float | None = None
        while True:
            try:
                async with self.session.request(method, url, json=body, headers=headers, **kw) as r:
                    raw = await r.read()
                break
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                gone_since = gone_since or time.monotonic()
                if not _gone(exc) or time.monotonic() - gone_since >= self.reconnect_s:
                    raise ServerUnreachable(url, exc) from exc
            await asyncio.sleep(RECONNECT_EVERY_S)
        if r.status >= 400:
            raise ServerError(url, r.status, _message(r.status, raw))
        return json.loads(raw) if raw else None

    async def _control(self, path: str, body: Any = None) -> ControlResult:
        return ControlResult.model_validate(await self.request("POST", path, body or {}))

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, routing_key: str | None = None, **body: Any) -> GenerateResponse | list[GenerateResponse]:
        """POST /generate with the docs/protocol.md 1.1 fields as keywords (`input_ids=`, `sampling_params=`...);
        `routing_key` goes in the header sglang-router's `session` policy pins a conversation by."""
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        data = await self.request("POST", "/generate", {**body, "stream": False}, headers=headers)
        if isinstance(data, list):
            return [GenerateResponse.model_validate(d) for d in data]
        return GenerateResponse.model_validate(data)

    async def generate_stream(self, **body: Any) -> AsyncIterator[GenerateResponse]:
        """Cumulative chunks as the server sends them; an error chunk raises."""
        url = self.base_url + "/generate"
        try:
            async with self.session.post(url, json={**body, "stream": True}) as r:
                if r.status >= 400:
                    raise ServerError(url, r.status, _message(r.status, await r.read()))
                async for raw in r.content:
                    line = raw.decode().rstrip("\r\n")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise ServerError(url, chunk["error"].get("code", 500), chunk["error"]["message"])
                    yield GenerateResponse.model_validate(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ServerUnreachable(url, exc) from exc

    async def chat(self, **body: Any) -> dict[str, Any]:
        """POST /v1/chat/completions (OpenAI body as keywords)."""
        return await self.request("POST", "/v1/chat/completions", body)

    async def completions(self, **body: Any) -> dict[str, Any]:
        return await self.request("POST", "/v1/completions", body)

    async def models(self) -> dict[str, Any]:
        """GET /v1/models."""
        return await self.request("GET", "/v1/models")

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        await self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> None:
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        """SGLang replies in plain text, not JSON (a 400 while requests are pending)."""
        url = self.base_url + "/flush_cache"
        async with self.session.post(url) as r:
            if r.status >= 400:
                raise ServerError(url, r.status, _message(r.status, await r.read()))

    # ---- weights ----------------------------------------------------------------------------

    async def init_weights_update_group(self, req: InitWeightsUpdateGroupReq) -> ControlResult:
        return await self._control("/init_weights_update_group", req.model_dump())

    async def update_weights_from_distributed(self, req: UpdateWeightsFromDistributedReq) -> ControlResult:
        """A bucket of a push; with `req.lora_name`, into that adapter only (slimish's engine; the
        field is left out otherwise, so SGLang gets its own body)."""
        return await self._control(
            "/update_weights_from_distributed", req.model_dump(exclude=None if req.lora_name else {"lora_name"})
        )

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

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True, lora_name: str | None = None
    ) -> ControlResult:
        """The base model's version, or with `lora_name` that adapter's alone (slimish's)."""
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return await self._control(
            "/update_weight_version", {**body, **({"lora_name": lora_name} if lora_name else {})}
        )

    async def get_weights_by_name(self, name: str, truncate_size: int = 100, lora_name: str | None = None) -> list[Any]:
        """A parameter of the model, or with `lora_name` a tensor of that adapter (by its PEFT name)."""
        body = {"name": name, "truncate_size": truncate_size, **({"lora_name": lora_name} if lora_name else {})}
        return await self.request("POST", "/get_weights_by_name", body)

    async def get_weight_version(self, lora_name: str | None = None) -> str:
        """The base model's weight version, or that adapter's (slimish's engine only)."""
        return (await self.request("POST", "/get_weight_version", {"lora_name": lora_name}))["weight_version"]

    # ---- LoRA adapters ------------------------------------------------------------------------
    # Failures raise ServerError (400) with the server's `error_message`.

    async def load_lora_adapter(
        self, name: str, path: str, pinned: bool = False, weight_version: str | None = None
    ) -> LoraUpdateResult:
        body = LoadLoraAdapterReq(
            lora_name=name, lora_path=path, pinned=pinned, weight_version=weight_version
        ).model_dump(exclude_none=True)
        return LoraUpdateResult.model_validate(await self.request("POST", "/load_lora_adapter", body))

    async def unload_lora_adapter(self, name: str) -> LoraUpdateResult:
        body = UnloadLoraAdapterReq(lora_name=name).model_dump()
        return LoraUpdateResult.model_validate(await self.request("POST", "/unload_lora_adapter", body))

    # ---- info -------------------------------------------------------------------------------

    async def health(self) -> bool:
        try:
            await self.request("GET", "/health", timeout=5.0)
        except ServerError:
            return False
        return True

    async def model_info(self) -> dict[str, Any]:
        return await self.request("GET", "/model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self.request("GET", "/server_info")
