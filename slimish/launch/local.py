"""Start slimish servers (engines, routers) as child processes on this machine.

Used by `slimish serve`, by the trainer's embedded mode and by the tests, so that all of them
start, wait for and stop servers the same way: bounded waits, no orphans.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from slimish.launch.process import ServerProcess, start_all
from slimish.net import connect_host, free_port

if TYPE_CHECKING:
    from slimish.config import LaunchConfig


def engine_process(
    model: str | Path, port: int | None = None, log_path: str | Path | None = None, host: str = "127.0.0.1", **flags: object
) -> ServerProcess:
    """A built-in engine child bound to `host`; `flags` become `--flag value` (`max_running_requests=8`),
    a list `--flag v1 v2 ...` (`lora_paths=[...]`)."""
    port = port or free_port(host)
    argv = ["engine", "--model", str(model), "--host", host, "--port", str(port)]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    return ServerProcess(argv, port=port, host=connect_host(host), log_path=log_path)


def engine_server(launch: "LaunchConfig", model: str | Path, log_path: str | Path | None, host: str = "127.0.0.1") -> ServerProcess:
    """One engine of `launch.engine_kind` (builtin or sglang) on a free port of `host`, not started."""
    if launch.engine_kind == "sglang":
        from slimish.launch.sglang import sglang_process

        return sglang_process(model, launch.sglang_args, host, api_key=launch.api_key, log_path=log_path)
    values: dict[str, list[str]] = {}
    for pair in launch.engine_flag:  # a NAME given again adds a value: a list flag's values
        name, value = pair.split("=", 1)
        values.setdefault(name, []).append(value)
    flags: dict[str, object] = {name: v[0] if len(v) == 1 else v for name, v in values.items()}
    if owned := {"model", "host", "port"} & set(flags):
        raise ValueError(f"launch.engine_flag: {', '.join(sorted(owned))} set by the launcher (the run's model; "
                         "127.0.0.1, or the node's address under launch.mode=ray; a free port); remove it")  # fmt: skip
    if launch.api_key:
        flags.setdefault("api_key", launch.api_key)
    return engine_process(model, log_path=log_path, host=host, **flags)


def await_weights_on_relaunch(engine: ServerProcess) -> None:
    """A built-in engine started again serves nothing (503) until a push has set every parameter,
    so it is waited for on `/model_info` (up and loaded). SGLang has no such gate: a restarted
    SGLang server serves its checkpoint until the push that follows its restart."""
    if engine.module != "slimish.cli":
        return
    if "--await-weights" not in engine.argv:
        engine.argv += ["--await-weights", "true"]
    engine.health_path = "/model_info"


def router_process(launch: "LaunchConfig", worker_urls: list[str], log_dir: Path) -> ServerProcess:
    """The run's router, in front of `worker_urls`, not started."""
    port = free_port()
    argv = ["router", "--port", str(port), "--policy", launch.policy, "--workers", str(launch.router_workers), "--worker-urls", *worker_urls]
    if launch.api_key:
        argv += ["--api-key", launch.api_key]
    return ServerProcess(argv, port=port, log_path=log_dir / "router.log")


@dataclass
class Servers:
    """What a run talks to: the router (rollouts) and each engine (weight sync); `engines` are
    the processes when this run started them (none for `launch.router_url` or external engines).
    Other launchers (slimish/launch/ray_engines.py) subclass it and keep `restart_dead`'s contract."""

    router_url: str
    engine_urls: list[str]
    engines: list[ServerProcess] = field(default_factory=list)

    def restart_dead(self, timeout: float, await_weights: bool = True) -> list[str]:
        """Start again, on the same port, every engine of ours that exited; returns their URLs.
        Built-in ones come back with `--await-weights`: the router sees them unhealthy, and they
        serve nothing, until the trainer's next push has set every parameter. Not for a LoRA run
        (`await_weights=False`): its base is never pushed, the engine's checkpoint is right, and
        the router sends adapter requests only to engines that hold the adapter (the next push
        loads it)."""
        dead = [e for e in self.engines if e.proc is not None and e.proc.poll() is not None]
        for engine in dead:
            if await_weights:
                await_weights_on_relaunch(engine)
            engine.launch()
        for engine in dead:
            engine.wait_healthy(timeout)
        return [e.url for e in dead]


@contextmanager
def local_servers(launch: "LaunchConfig", model: str | Path, log_dir: str | Path) -> Iterator[Servers]:
    """The engines and router a run needs: started here (children, stopped on exit) unless
    `launch.router_url` names existing ones, whose engines are then read from its worker list,
    or `launch.engine_kind` is external (a router is started in front of `launch.engine_urls`)."""
    if launch.router_url:
        yield Servers(launch.router_url, existing_engine_urls(launch.router_url, launch.api_key, launch.teacher.served_name))
        return
    with engines_only(launch, model, log_dir) as engines:
        urls = [e.url for e in engines] or [u.rstrip("/") for u in launch.engine_urls]
        with router_process(launch, urls, Path(log_dir)).start(launch.start_timeout) as router:
            yield Servers(router.url, urls, engines)


@contextmanager
def engines_only(launch: "LaunchConfig", model: str | Path, log_dir: str | Path) -> Iterator[list[ServerProcess]]:
    """`launch.engines` engines of `launch.engine_kind` started and healthy (none for external
    ones), stopped when the block ends."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    engines = []
    if launch.engine_kind != "external":
        engines = [engine_server(launch, model, log_dir / f"engine{i}.log") for i in range(launch.engines)]
    try:
        start_all(engines, launch.start_timeout)
        yield engines
    finally:
        for proc in engines:
            proc.stop()


def admin_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def existing_engine_urls(url: str, api_key: str | None = None, skip_model: str | None = None) -> list[str]:
    """A router's workers (`GET /list_workers`) less those registered under `skip_model` (the
    teacher's, never pushed to), or `[url]` when `url` is an engine itself."""
    r = httpx.get(url.rstrip("/") + "/list_workers", headers=admin_headers(api_key), timeout=10.0)
    if r.status_code == 404:
        return [url.rstrip("/")]
    r.raise_for_status()
    if skip_model is None:
        return list(r.json()["urls"])
    from slimish.launch.named import named_workers

    skipped = named_workers(url, skip_model, api_key)
    return [u for u in r.json()["urls"] if u.rstrip("/") not in skipped]


def replace_worker(router_url: str, old: str | None, new: str, api_key: str | None = None) -> None:
    """Swap `old` for `new` in a router's worker list with the sglang-router 0.3 registry routes
    (`GET|POST /workers`, `DELETE /workers/<id>`), which the slimish router serves as well."""
    with httpx.Client(base_url=router_url.rstrip("/"), headers=admin_headers(api_key), timeout=10.0) as http:
        listed = http.get("/workers")
        listed.raise_for_status()
        ids = {w["url"].rstrip("/"): w["id"] for w in listed.json()["workers"]}
        old, new = (old or "").rstrip("/"), new.rstrip("/")
        if old in ids and old != new:
            http.delete(f"/workers/{ids[old]}").raise_for_status()
        if new not in ids:  # one still listed comes back by the router's health checks
            http.post("/workers", json={"url": new}).raise_for_status()
