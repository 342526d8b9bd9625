"""One worker registry for several router processes (`--processes N`): the parent publishes it,
the children that serve the port follow it.

Why this mechanism: the parent owns every fact that must be one for all processes (the
registry, health, LoRA holdings) and is the only process that changes them; children only read.
After each change the parent writes the registry as JSON to a file (write, then atomic rename)
and bumps a counter in shared memory; a child compares the counter on every request it takes
(one shared-memory read) and reloads the file when it moved. An admin write publishes before its
reply leaves the parent, so the next request, to any child, already sees it. No acks, no
connections to keep alive, nothing to unpickle: a child that is slow or restarting cannot hold up
the others, and a crashed parent leaves a readable file behind rather than a half-sent message.
A child that cannot connect to a worker stops routing to it at once, as a single router does,
until the next reload; the parent's own checks then take it out for every process.

Admin routes (registry, engine fan-outs, LoRA) that reach a child are passed to the parent's own
router app on a private loopback port, where the keys are checked as in a single router, so
each fan-out reaches every engine once whichever child took it.
"""

from __future__ import annotations

import asyncio
import json
import os
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Callable

import aiohttp
from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slimish.router.config import RouterConfig
from slimish.router.gate import read_body
from slimish.router.proxy import Proxy, RouterError
from slimish.router.workers import WorkerRegistry, describe_exc

TO_PARENT = ("authorization", "content-type")  # request headers the parent's routes read
FROM_PARENT = ("content-type", "retry-after")
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]


class RegistryPublisher:
    """The parent's side: the registry to the file, and the counter bumped, whenever it changed."""

    def __init__(self, workers: WorkerRegistry, path: Path, version: Synchronized) -> None:
        self.workers, self.path, self.version = workers, path, version
        self._last: str | None = None
        workers.changed = self.publish

    def publish(self) -> None:
        text = json.dumps(self.workers.snapshot())
        if text == self._last:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        self._last = text
        self.version.value += 1

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """`app`, publishing before each reply starts: a client that got its answer to an admin
        write finds the change in every process."""

        async def publishing(scope: Scope, receive: Receive, send: Send) -> None:
            async def send_after_publish(message: Message) -> None:
                if message["type"] == "http.response.start":
                    self.publish()
                await send(message)

            await app(scope, receive, send_after_publish if scope["type"] == "http" else send)

        return publishing


class RegistryFollower:
    """A child's side: the parent's registry, reloaded when the counter moved; and the routes the
    child does not serve, passed to the parent."""

    def __init__(self, index: int, parent_url: str, path: Path, version: Synchronized) -> None:
        self.index, self.parent_url, self.path, self.version = index, parent_url, path, version
        self._seen = -1
        self._workers: WorkerRegistry | None = None

    def attach(self, workers: WorkerRegistry) -> Callable[[], None]:
        """Follow the parent into `workers`; returns the check to run on every request."""
        self._workers = workers
        self.refresh()
        return self.refresh

    def refresh(self) -> None:
        if (now := self.version.value) != self._seen and self._workers is not None:
            self._seen = now  # first: a publish during the read is picked up next time
            self._workers.restore(json.loads(self.path.read_text()))

    def pass_the_rest(self, app: FastAPI, cfg: RouterConfig, proxy: Proxy) -> None:
        """Every route not registered on `app` before this call goes to the parent, as it came."""

        async def to_parent(request: Request) -> Response:
            body = await read_body(request, cfg.max_body_bytes)
            path = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")
            query = request.scope["query_string"].decode("latin-1")
            headers = {k: v for k, v in request.headers.items() if k in TO_PARENT}
            assert proxy.session is not None, "proxy not started"
            try:
                async with proxy.session.request(
                    request.method,
                    self.parent_url + path + (f"?{query}" if query else ""),
                    data=body or None,
                    headers=headers,
                ) as resp:
                    data = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                cause = describe_exc(exc, cfg.request_timeout)
                raise RouterError(
                    502, f"{request.method} {request.url.path}: the router's parent process did not answer: {cause}"
                ) from exc
            return Response(
                data, resp.status, headers={k: v for k, v in resp.headers.items() if k.lower() in FROM_PARENT}
            )

        app.router.add_route("/{path:path}", to_parent, methods=METHODS)
