"""The worker registry and its health checks.

Shapes follow sglang-router 0.3.x (`GET /workers` entries), so tools written against it read ours.
A worker is routable only while healthy; health checks bring it back on their own. A worker that
joins a running fleet (`POST /workers`, `/add_worker`) is also held out until it serves the
fleet's weights: a run's newcomer must not answer a single request on its checkpoint while the
others serve step N's policy (docs/elastic.md). The gate reads `/model_info`'s `weight_version`,
which SGLang's engines serve as well as ours, so it needs nothing of the engine: SGLang has no
`--await-weights`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

import aiohttp

from slimish.protocol import auth_headers, version_number
from slimish.router.config import RouterConfig
from slimish.router.upstream import ConnectFailed, Disconnected

log = logging.getLogger("slimish.router")


def normalize_url(url: str) -> str:
    """`http://h:p` without a trailing slash; a clear error for anything else."""
    if not isinstance(url, str):
        raise ValueError(f"url: expected a string like http://127.0.0.1:30000, got {url!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"url: expected http(s)://host:port, got {url!r}")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"url: expected no path or query after host:port, got {url!r}")
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(eq=False)
class Worker:
    url: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    healthy: bool = False
    inflight: int = 0
    failures: int = 0  # consecutive failed health checks
    last_error: str = "not checked yet"
    metadata: dict[str, Any] = field(default_factory=dict)
    adapters: set[str] = field(default_factory=set)  # LoRA adapters it holds (slimish/router/lora.py)
    model_id: str | None = None  # registered under this name: serves only requests naming it (proxy.serving)
    joining: bool = False  # joined a running fleet: unroutable until it reports the fleet's weight version

    def as_dict(self) -> dict[str, Any]:
        """The entry shape of sglang-router 0.3.x `GET /workers`."""
        return {
            "id": self.id,
            "url": self.url,
            "model_id": self.model_id or self.metadata.get("served_model_name", "unknown"),
            "priority": 50,
            "cost": 1.0,
            "worker_type": "regular",
            "is_healthy": self.healthy,
            "load": self.inflight,
            "connection_mode": "http",
            "metadata": {k: self.metadata.get(k) for k in ("dp_size", "tp_size", "model_path")},
            "disable_health_check": False,
            "last_error": None if self.healthy and not self.joining else self.last_error,
            "lora_adapters": sorted(self.adapters),
            "joining": self.joining,  # slimish's: healthy, but not yet on the fleet's weights
        }


class WorkerRegistry:
    """Registered workers in insertion order (round_robin relies on a stable order)."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        # On every call to a worker (forwarded, fanned out, health and info reads): the router's
        # `api_key`, as sglang-router sends its `--api-key` to its workers. A caller's key is
        # checked by the router, never passed on.
        self.auth = auth_headers(cfg.api_key)
        self._workers: dict[str, Worker] = {}
        self._session: aiohttp.ClientSession | None = None
        self._pending: set[asyncio.Task] = set()
        self._timeout = aiohttp.ClientTimeout(total=cfg.health_check_timeout)
        self.changed: Callable[[], None] = lambda: None  # after each health check (scaleout.py publishes)
        self.fleet_version: str | None = None  # the newest weight version a serving worker reported

    def bind(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    # ---- membership ------------------------------------------------------------------------

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def healthy(self) -> list[Worker]:
        """The routable workers: healthy, and not joining."""
        return [w for w in self._workers.values() if w.healthy and not w.joining]

    def joiners(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.joining]

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def by_url(self, url: str) -> Worker | None:
        url = normalize_url(url)
        return next((w for w in self._workers.values() if w.url == url), None)

    def add(self, url: str, model_id: str | None = None, joining: bool = False) -> Worker:
        """Register `url` (unhealthy until its first good check, which starts now); under
        `model_id`, a named worker. `joining`: added to a running fleet, so unroutable until it
        serves the fleet's weights too (named workers serve another model: never held)."""
        url = normalize_url(url)
        if (existing := self.by_url(url)) is not None:
            raise KeyError(f"worker {url} is already registered as id {existing.id}")
        serving = any(w.model_id is None and not w.joining for w in self._workers.values())
        worker = Worker(url, model_id=model_id, joining=joining and model_id is None and serving)
        self._workers[worker.id] = worker
        if self._session is not None:
            task = asyncio.get_running_loop().create_task(self.check(worker))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        return worker

    def remove(self, worker: Worker) -> None:
        self._workers.pop(worker.id, None)

    def snapshot(self) -> list[dict[str, Any]]:
        """What another router process needs to route like this one (`--processes N`), as JSON."""
        return [
            {
                "id": w.id,
                "url": w.url,
                "model_id": w.model_id,
                "healthy": w.healthy,
                "last_error": w.last_error,
                "metadata": w.metadata,
                "adapters": sorted(w.adapters),
                "joining": w.joining,
            }
            for w in self._workers.values()
        ]

    def restore(self, entries: list[dict[str, Any]]) -> None:
        """Become `snapshot()`'s registry, keeping the in-flight counts of workers still in it."""
        old, self._workers = self._workers, {}
        for e in entries:
            worker = old.get(e["id"]) or Worker(e["url"], id=e["id"], model_id=e["model_id"])
            worker.healthy, worker.last_error, worker.metadata, worker.adapters, worker.joining = (
                e["healthy"],
                e["last_error"],
                e["metadata"],
                set(e["adapters"]),
                e["joining"],
            )
            self._workers[worker.id] = worker

    def mark_failed(self, worker: Worker, cause: str) -> None:
        """A request could not reach `worker`: stop routing to it until a check passes."""
        if worker.healthy:
            log.warning("worker %s marked unhealthy: %s", worker.url, cause)
        worker.healthy, worker.last_error = False, cause
        worker.failures = max(worker.failures, self.cfg.health_failure_threshold)

    # ---- health checks ---------------------------------------------------------------------

    async def check(self, worker: Worker) -> bool:
        try:
            return await self._check(worker)
        finally:
            self.changed()

    async def _check(self, worker: Worker) -> bool:
        assert self._session is not None, "registry not bound to a client session"
        try:
            async with self._session.get(worker.url + "/health", headers=self.auth, timeout=self._timeout) as resp:
                ok, cause = resp.status == 200, f"GET /health replied {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, cause = False, f"GET /health failed: {describe_exc(exc, self.cfg.health_check_timeout)}"
        if ok:
            if not worker.healthy:
                log.info("worker %s is healthy", worker.url)
                if not worker.metadata:
                    worker.metadata = await self._get_json(worker, "/server_info")
                models = (await self._get_json(worker, "/v1/models")).get(
                    "data"
                )  # back from a restart, it may hold none
                worker.adapters = {
                    m.get("id") for m in models or [] if isinstance(m, dict) and m.get("parent") is not None
                }
            worker.healthy, worker.failures = True, 0
            if worker.joining:
                await self._admit(worker)
            return True
        worker.failures += 1
        worker.last_error = cause
        if worker.healthy and worker.failures >= self.cfg.health_failure_threshold:
            log.warning("worker %s marked unhealthy: %s", worker.url, cause)
            worker.healthy = False
        return False

    async def _admit(self, worker: Worker) -> None:
        """A joining worker becomes routable once its weight version is the fleet's: the newest
        any serving (healthy, unnamed, not joining) worker reports, or, none answering, the last
        one seen. Exact: an engine's initial "default" is not step 0's weights. With no version
        ever seen, no run holds one: the worker is admitted as it is."""
        serving = [w for w in self.healthy() if w.model_id is None]
        reported = [v for v in await asyncio.gather(*(self._version(w) for w in serving)) if v is not None]
        if reported:
            self.fleet_version = max(reported, key=version_number)
        mine = await self._version(worker)
        if self.fleet_version is None or mine == self.fleet_version:
            log.info("worker %s joins the fleet at weight version %s", worker.url, mine)
            worker.joining = False
        else:
            worker.last_error = f"joining: serves weight version {mine}, the fleet {self.fleet_version}"

    async def _version(self, worker: Worker) -> str | None:
        version = (await self._get_json(worker, "/model_info")).get("weight_version")
        return version if isinstance(version, str) else None

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.all()))

    async def run_health_checks(self) -> None:
        """Until cancelled: every worker each `health_check_interval`, joining ones each
        `join_check_interval` (a push that brought one the fleet's weights lets it take load at
        once); also cancels the first checks of workers added meanwhile."""
        try:
            await asyncio.gather(
                self._every(self.cfg.health_check_interval, self.all),
                self._every(self.cfg.join_check_interval, self.joiners),
            )
        finally:
            for task in list(self._pending):
                task.cancel()

    async def _every(self, interval: float, which: Callable[[], list[Worker]]) -> None:
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self.check(w) for w in which()))

    async def _get_json(self, worker: Worker, path: str) -> dict[str, Any]:
        """`/server_info` (dp/tp size and model path for `GET /workers`) or `/v1/models` (adapters);
        optional, as not every engine has them: {} then."""
        assert self._session is not None
        try:
            async with self._session.get(worker.url + path, headers=self.auth, timeout=self._timeout) as resp:
                info = await resp.json() if resp.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def stats(self) -> dict[str, Any]:
        healthy = sum(w.healthy for w in self._workers.values())
        return {"healthy_count": healthy, "unhealthy_count": len(self._workers) - healthy}


def describe_exc(exc: BaseException, timeout: float) -> str:
    """A short cause for error messages: what failed, not a traceback."""
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the worker closed the connection"
    if isinstance(exc, (ConnectFailed, Disconnected)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
