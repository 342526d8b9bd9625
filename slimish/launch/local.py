"""Start slimish servers (engines, routers) as child processes on this machine.

Used by `slimish serve`, by the trainer's embedded mode and by the tests, so that all of them
start, wait for and stop servers the same way: bounded waits, no orphans.
"""

from __future__ import annotations

import typing
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
    model: str | Path,
    port: int | None = None,
    log_path: str | Path | None = None,
    host: str = "127.0.0.1",
    **flags: object,
) -> ServerProcess:
    """A built-in engine child bound to `host`; `flags` as `engine_argv` writes them."""
    port = port or free_port(host)
    return ServerProcess(engine_argv(model, host, port, flags), port=port, host=connect_host(host), log_path=log_path)


def engine_command(
    launch: "LaunchConfig", model: str | Path, host: str, port: int | str, gpus: tuple[int, ...] = ()
) -> tuple[str, list[str]]:
    """One engine of `launch.engine_kind` (builtin or sglang) as `python -m MODULE ARGV`: the
    module and the arguments. `gpus`: its GPUs on its node (slimish/launch/plan.py
    `engine_gpus`) where the launcher places it; none under Ray, whose bundle sets the GPUs the
    engine sees, and none for a CPU engine."""
    if launch.engine_kind == "sglang":
        from slimish.launch.sglang import MODULE, sglang_argv

        return MODULE, sglang_argv(model, host, port, launch.sglang_args, launch.api_key, gpus[0] if gpus else None)
    flags = engine_flags(launch.engine_flag)
    if gpus and flags.get("device") == "cuda":
        flags["device"] = f"cuda:{gpus[0]}"
    if owned := {"model", "host", "port"} & set(flags):
        raise ValueError(
            f"launch.engine_flag: {', '.join(sorted(owned))} set by the launcher (the run's model; "
            "127.0.0.1, or the node's address under launch.mode=ray; a free port); remove it"
        )
    if launch.api_key:
        flags.setdefault("api_key", launch.api_key)
    return "slimish.cli", engine_argv(model, host, port, flags)


def engine_argv(model: str | Path, host: str, port: int | str, flags: dict[str, object]) -> list[str]:
    """`slimish engine`'s arguments; `flags` as it reads them: `--flag value`
    (`max_running_requests=8`), a list `--flag v1 v2 ...` (`lora_paths=[...]`), and a boolean
    field a bare flag as SGLang's: `--enable-lora` for True, `--no-enable-lora` for False. A
    boolean may also be the text of a NAME=VALUE pair (`launch.engine_flag: [enable_lora=true]`)."""
    from slimish.config import EngineConfig

    hints, argv = (
        typing.get_type_hints(EngineConfig),
        ["engine", "--model", str(model), "--host", host, "--port", str(port)],
    )
    for key, value in flags.items():
        flag = key.replace("_", "-")
        if hints.get(key) is bool:
            on = value if isinstance(value, bool) else {"true": True, "false": False}.get(str(value).lower())
            if on is None:
                raise ValueError(f"engine flag {key}: true or false, got {value!r}")
            argv.append(f"--{flag}" if on else f"--no-{flag}")
        else:
            argv += [f"--{flag}", *map(str, value if isinstance(value, list) else [value])]
    return argv


def engine_flags(pairs: list[str], field: str = "launch.engine_flag") -> dict[str, object]:
    """NAME=VALUE pairs (`field`, for errors) by name; a NAME given again adds a value: a list
    flag's values. `--max-running-requests=8` and `max_running_requests=8` are the same."""
    values: dict[str, list[str]] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not name:
            raise ValueError(f"{field}: expected NAME=VALUE, got {pair!r}")
        values.setdefault(name, []).append(value)
    return {name: v[0] if len(v) == 1 else v for name, v in values.items()}


def engine_server(
    launch: "LaunchConfig",
    model: str | Path,
    log_path: str | Path | None,
    host: str = "127.0.0.1",
    gpus: tuple[int, ...] = (),
) -> ServerProcess:
    """`engine_command`'s engine on a free port of `host`, not started."""
    port = free_port(host)
    module, argv = engine_command(launch, model, host, port, gpus)
    return ServerProcess(argv, port=port, host=connect_host(host), log_path=log_path, module=module)


def await_weights_on_relaunch(engine: ServerProcess) -> None:
    """A built-in engine started again serves nothing (503) until a push has set every parameter,
    so it is waited for on `/model_info` (up and loaded). SGLang has no such gate: a restarted
    SGLang server serves its checkpoint until the push that follows its restart."""
    if engine.module != "slimish.cli":
        return
    if "--await-weights" not in engine.argv:
        engine.argv += ["--await-weights"]
    engine.health_path = "/model_info"


def router_process(launch: "LaunchConfig", worker_urls: list[str], log_dir: Path) -> ServerProcess:
    """The run's router, in front of `worker_urls`, not started."""
    port = free_port()
    argv = [
        "router",
        "--port",
        str(port),
        "--policy",
        launch.policy,
        "--workers",
        str(launch.router_workers),
        "--worker-urls",
        *worker_urls,
    ]
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
def local_servers(
    launch: "LaunchConfig", model: str | Path, log_dir: str | Path, first_gpu: int = 0
) -> Iterator[Servers]:
    """The engines and router a run needs: started here (children, stopped on exit) unless
    `launch.router_url` names existing ones, whose engines are then read from its worker list,
    or `launch.engine_kind` is external (a router is started in front of `launch.engine_urls`).
    GPU engines go on this machine's GPUs from `first_gpu` on (`engine_gpus`)."""
    if launch.router_url:
        yield Servers(
            launch.router_url, existing_engine_urls(launch.router_url, launch.api_key, launch.teacher.served_name)
        )
        return
    with engines_only(launch, model, log_dir, first_gpu) as engines:
        urls = [e.url for e in engines] or [u.rstrip("/") for u in launch.engine_urls]
        with router_process(launch, urls, Path(log_dir)).start(launch.start_timeout) as router:
            yield Servers(router.url, urls, engines)


def local_engines(launch: "LaunchConfig", model: str | Path, log_dir: Path, first_gpu: int = 0) -> list[ServerProcess]:
    """`launch.engines` engines of `launch.engine_kind` for this machine, not started (none for
    external ones), each on its own GPUs from `first_gpu` on (slimish/launch/plan.py)."""
    from slimish.launch.plan import engine_gpus

    if launch.engine_kind == "external":
        return []
    return [
        engine_server(launch, model, log_dir / f"engine{i}.log", gpus=gpus)
        for i, gpus in enumerate(engine_gpus(launch, first_gpu))
    ]


@contextmanager
def engines_only(
    launch: "LaunchConfig", model: str | Path, log_dir: str | Path, first_gpu: int = 0
) -> Iterator[list[ServerProcess]]:
    """`local_engines` started and healthy, stopped when the block ends."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    engines = local_engines(launch, model, log_dir, first_gpu)
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
