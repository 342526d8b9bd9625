"""Start slimish servers (engines, routers) as child processes on this machine.

Used by `slimish serve`, by the trainer's embedded mode and by the tests, so that all of them
start, wait for and stop servers the same way: bounded waits, no orphans.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from slimish.colocate import WeightStore, shared_store
from slimish.launch.commands import colocate_launch, engine_argv, engine_command
from slimish.launch.cpus import Place
from slimish.launch.plan import engine_gpus
from slimish.launch.workers import existing_engine_urls, key_client
from slimish.net import connect_host, free_port, listening_socket
from slimish.processes import ServerProcess, start_all

if TYPE_CHECKING:
    from slimish.launch.config import LaunchConfig

log = logging.getLogger(__name__)


def engine_process(
    model: str | Path,
    port: int | None = None,
    log_path: str | Path | None = None,
    host: str = "127.0.0.1",
    **flags: object,
) -> ServerProcess:
    """A built-in engine child on `host`:`port` (default: a free port, held from here on);
    `flags` as `engine_argv` writes them."""
    sock = listening_socket(host, port or 0)
    port = sock.getsockname()[1]
    argv = engine_argv(model, host, port, flags)
    return ServerProcess(argv, port=port, host=connect_host(host), log_path=log_path, sock=sock)


def engine_server(
    launch: "LaunchConfig",
    model: str | Path,
    log_path: str | Path | None,
    host: str = "127.0.0.1",
    gpus: tuple[int, ...] = (),
    place: Place = Place(),
) -> ServerProcess:
    """`engine_command`'s engine on a free port of `host` (held from here on for a built-in
    engine; SGLang binds its own), not started; on `place`'s CPUs and threads
    (slimish/launch/cpus.py), where it places the engine."""
    sock = listening_socket(host) if launch.engine_kind == "builtin" else None
    port = sock.getsockname()[1] if sock else free_port(host)
    module, argv = engine_command(launch, model, host, port, gpus, place.threads)
    return ServerProcess(
        argv,
        port=port,
        host=connect_host(host),
        log_path=log_path,
        module=module,
        cpus=place.cpus,
        api_key=launch.api_key,
        sock=sock,
    )


def await_weights_on_relaunch(engine: ServerProcess) -> None:
    """A built-in engine started again serves nothing (503) until a push has set every parameter,
    so it is waited for on `/model_info` (up and loaded). SGLang has no such gate: a restarted
    SGLang server serves its checkpoint until the push that follows its restart. Nor has an
    engine that maps a colocated run's store: its weights are the trainer's, whole."""
    if engine.module != "slimish.cli" or any(a.startswith("--shared-weights") for a in engine.argv):
        return
    if "--await-weights" not in engine.argv:
        engine.argv += ["--await-weights"]
    engine.health_path = "/model_info"


def router_process(launch: "LaunchConfig", worker_urls: list[str], log_dir: Path) -> ServerProcess:
    """The run's router, in front of `worker_urls`, not started; on a port held from here on
    where it is one process (N processes bind theirs: `slimish router --processes`)."""
    sock = listening_socket() if launch.router_processes == 1 else None
    port = sock.getsockname()[1] if sock else free_port()
    argv = [
        "router",
        "--port",
        str(port),
        "--policy",
        launch.policy,
        "--processes",
        str(launch.router_processes),
        "--worker-urls",
        *worker_urls,
    ]
    if launch.api_key:
        argv += ["--api-key", launch.api_key]
    return ServerProcess(argv, port=port, log_path=log_dir / "router.log", sock=sock)


class RouterWatch:
    """The run's router, kept up: a thread waits on the process and starts it again, on the same
    port, whenever it exits before the run is done. Rollouts reconnect to the same URL (their
    client re-sends what got no reply: `launch.router_reconnect_s`). Nothing is lost with the
    process: the router's workers come from its command line, and which adapters each holds it
    learns again from the workers."""

    def __init__(self, router: ServerProcess, timeout: float) -> None:
        self.router, self.timeout = router, timeout
        self.restarts = 0
        self._lock = threading.Lock()  # a restart and `close` never interleave
        self._closing = False
        self._thread = threading.Thread(target=self._watch, name="router-watch", daemon=True)

    def start(self) -> None:
        """Start the router and its watch, once; from the thread that lives as long as the run."""
        if self.router.proc is None:
            self.router.start(self.timeout)
            self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self.router.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout)

    def _watch(self) -> None:
        """Runs as long as the router should: a child's parent-death signal follows the thread
        that spawned it, and restarts are spawned here."""
        while True:
            assert self.router.proc is not None
            code = self.router.proc.wait()
            with self._lock:
                if self._closing:
                    return
                log.warning("router on port %d exited with %s: starting it again there", self.router.port, code)
                self.router.launch()
                self.restarts += 1
            try:
                self.router.wait_healthy(self.timeout)
            except (RuntimeError, TimeoutError) as exc:
                if not self._closing:
                    log.error("router on port %d did not come back: %s", self.router.port, exc)
                return


@dataclass
class Servers:
    """What a run talks to: the router (rollouts) and each engine (weight sync); `engines` are
    the processes when this run started them (none for `launch.router_url` or external engines).
    Other launchers (slimish/launch/ray_engines.py) subclass it and keep `restart_dead`'s contract."""

    router_url: str
    engine_urls: list[str]
    engines: list[ServerProcess] = field(default_factory=list)
    router: RouterWatch | None = None  # when this run started the router
    store: WeightStore | None = None  # launch.colocate: the weights the engines map (slimish/colocate.py)

    def router_restarts(self) -> int:
        """How often the run's router exited and was started again."""
        return self.router.restarts if self.router is not None else 0

    def own_urls(self) -> list[str]:
        """The engines this run started (and restarts): always in its weight-update group."""
        return [e.url for e in self.engines]

    def ready(self, timeout: float) -> None:
        """Waits for engines that `local_servers(wait=False)` spawned, then starts the router in
        front of them (it finds them up at its first health check); nothing to do otherwise."""
        for engine in self.engines:
            engine.wait_healthy(timeout)
        if self.router is not None:
            self.router.start()

    def restart_dead(self, timeout: float, await_weights: bool = True) -> list[str]:
        """Start again, on the same port, every engine of ours that exited; returns their URLs.
        Built-in ones come back with `--await-weights`: the router sees them unhealthy, and they
        serve nothing, until the trainer's next push has set every parameter. Not for a LoRA run
        (`await_weights=False`): its base is never pushed, the engine's checkpoint is right, and
        the router sends adapter requests only to engines that hold the adapter (the next push
        loads it)."""
        dead = [e for e in self.engines if e.exited()]
        for engine in dead:
            if await_weights:
                await_weights_on_relaunch(engine)
            engine.launch()
        for engine in dead:
            engine.wait_healthy(timeout)
        return [e.url for e in dead]


@contextmanager
def local_servers(
    launch: "LaunchConfig",
    model: str | Path,
    log_dir: str | Path,
    first_gpu: int = 0,
    wait: bool = True,
    places: tuple[Place, ...] = (),
) -> Iterator[Servers]:
    """The engines and router a run needs: started here (children, stopped on exit) unless
    `launch.router_url` names existing ones, whose engines are then read from its worker list,
    or `launch.engine_kind` is external (a router is started in front of `launch.engine_urls`).
    GPU engines go on this machine's GPUs from `first_gpu` on (`engine_gpus`). With `wait=False`
    the engines are only spawned and the caller calls `Servers.ready` later: the trainer loads
    its model meanwhile (seconds off every run's start). `places`: each engine's CPUs
    (`local_engines`)."""
    if launch.router_url:
        with key_client(launch.api_key) as http:
            urls = existing_engine_urls(http, launch.router_url, launch.teacher.served_name)
        yield Servers(launch.router_url, urls)
        return
    with (
        shared_store(model) if launch.colocate and launch.engine_kind == "builtin" else nullcontext() as store,
        engines_only(colocated(launch, store), model, log_dir, first_gpu, wait=False, places=places) as engines,
    ):
        urls = [e.url for e in engines] or [u.rstrip("/") for u in launch.engine_urls]
        watch = RouterWatch(router_process(launch, urls, Path(log_dir)), launch.start_timeout)
        servers = Servers(watch.router.url, urls, engines, watch, store)
        try:
            if wait:
                servers.ready(launch.start_timeout)
            yield servers
        finally:
            watch.close()


def colocated(launch: "LaunchConfig", store: WeightStore | None) -> "LaunchConfig":
    """`launch` with its built-in engines mapping `store` (`launch.colocate`), packing no copy;
    or its SGLang engines able to hand their GPU memory back (`--enable-memory-saver`; they go
    on the trainer's GPU, `first_free_gpu`)."""
    if store is None:
        return colocate_launch(launch)
    flags = [f"shared_weights={store.path}", "cpu_packed_linear=false"]
    return dataclasses.replace(launch, engine_flag=[*launch.engine_flag, *flags])


def local_engines(
    launch: "LaunchConfig", model: str | Path, log_dir: Path, first_gpu: int = 0, places: tuple[Place, ...] = ()
) -> list[ServerProcess]:
    """`launch.engines` engines of `launch.engine_kind` for this machine, not started (none for
    external ones), each on its own GPUs from `first_gpu` on (slimish/launch/plan.py) and on
    its CPUs in `places` (slimish/launch/cpus.py; none given: not pinned)."""
    if launch.engine_kind == "external":
        return []
    gpus = engine_gpus(launch, first_gpu)
    places = places or (Place(),) * len(gpus)
    return [
        engine_server(launch, model, log_dir / f"engine{i}.log", gpus=ids, place=place)
        for i, (ids, place) in enumerate(zip(gpus, places, strict=True))
    ]


@contextmanager
def engines_only(
    launch: "LaunchConfig",
    model: str | Path,
    log_dir: str | Path,
    first_gpu: int = 0,
    wait: bool = True,
    places: tuple[Place, ...] = (),
) -> Iterator[list[ServerProcess]]:
    """`local_engines` started and healthy (only spawned, with `wait=False`), stopped when the
    block ends."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    engines = local_engines(launch, model, log_dir, first_gpu, places)
    try:
        if wait:
            start_all(engines, launch.start_timeout)
        else:
            for engine in engines:
                engine.launch()
        yield engines
    finally:
        for proc in engines:
            proc.stop()
