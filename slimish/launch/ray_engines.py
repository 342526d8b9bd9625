"""Engines as Ray actors (`launch.mode: ray`): placed by a placement group, supervised from rank 0.

Each actor owns one engine child process (built-in or SGLang) on the node Ray placed it on, so the
child runs where the bundle's CPUs / GPUs are and dies with its actor (parent-death signal). The
router stays on rank 0's machine, a local child as in `launch.mode: local`. An engine whose actor
died is replaced by a new actor in the same bundle; its URL (node, port) may change, so the router
is told, and it waits for the trainer's next push before it serves (`RayServers.restart_dead`:
the contract `slimish.train` relies on for local engines too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slimish.launch.local import Servers, await_weights_on_relaunch, engine_server, router_process
from slimish.launch.workers import replace_worker
from slimish.processes import ServerProcess

if TYPE_CHECKING:
    from slimish.launch.config import LaunchConfig

ACTOR_NAME = "slimish-engine-{index}"  # ray list actors; a replacement gets a `-r<n>` suffix
CALL_TIMEOUT = 60.0  # an actor that does not answer a status call within this is replaced


class EngineActor:
    """One engine child on this actor's node."""

    def __init__(self, launch: "LaunchConfig", model: str, log_path: str) -> None:
        self.launch, self.model, self.log_path = launch, model, Path(log_path)
        self.proc: ServerProcess | None = None

    def start(self, await_weights: bool, timeout: float) -> str:
        """Start (or start again) the engine on a free port of this node; its URL once healthy.
        With `await_weights` it serves nothing until a full weight push (built-in engines)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = engine_server(self.launch, self.model, self.log_path, host=ray.util.get_node_ip_address())
        if await_weights:
            await_weights_on_relaunch(self.proc)
        self.proc.start(timeout)
        return self.proc.url

    def running(self) -> bool:
        return self.proc is not None and self.proc.proc is not None and not self.proc.exited()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


_Actor = ray.remote(max_restarts=0, max_concurrency=1)(EngineActor)


@dataclass
class RayServers(Servers):
    """`Servers` whose engines are Ray actors; `restart_dead` replaces dead actors."""

    launch: "LaunchConfig | None" = None
    model: str = ""
    log_dir: Path = Path(".")
    group: PlacementGroup | None = None
    actors: list[Any] = field(default_factory=list)  # ActorHandle per engine, in bundle order
    replaced: list[int] = field(default_factory=list)  # per engine: how many actors replaced the first

    def spawn(self, index: int) -> Any:
        """A new actor in bundle `index` (not yet running an engine)."""
        assert self.launch is not None
        n = self.replaced[index]
        name = ACTOR_NAME.format(index=index) + (f"-r{n}" if n else "")
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        return _Actor.options(
            name=name, num_cpus=self.launch.engine_cpus, num_gpus=self.launch.engine_gpus, scheduling_strategy=strategy
        ).remote(self.launch, self.model, str(self.log_dir / f"engine{index}.log"))

    def own_urls(self) -> list[str]:
        return list(self.engine_urls)  # each actor's engine, under its URL now

    def restart_dead(self, timeout: float, await_weights: bool = True) -> list[str]:
        """Every engine whose actor died (or whose child exited) runs again, awaiting weights
        unless told not to (`Servers.restart_dead`), and is in the router's list under its new
        URL; returns those URLs."""
        assert self.launch is not None
        states = [_running(actor) for actor in self.actors]
        dead = [i for i, running in enumerate(states) if not running]
        for i in dead:
            if states[i] is None:  # the actor itself is gone: a new one, same bundle
                ray.kill(self.actors[i])
                self.replaced[i] += 1
                self.actors[i] = self.spawn(i)
        urls = ray.get(
            [self.actors[i].start.remote(await_weights, timeout) for i in dead], timeout=timeout + CALL_TIMEOUT
        )
        for i, url in zip(dead, urls):
            replace_worker(self.router_url, self.engine_urls[i], url, self.launch.api_key)
            self.engine_urls[i] = url
        return urls

    def stop(self) -> None:
        """Engines first (each actor stops its child), then the actors and their bundles."""
        stops = [actor.stop.remote() for actor in self.actors]
        try:
            ray.get(stops, timeout=CALL_TIMEOUT)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a dead actor's child died with it
        for actor in self.actors:
            ray.kill(actor)
        if self.group is not None:
            remove_placement_group(self.group)


def _running(actor: Any) -> bool | None:
    """True: serving; False: the actor lives but its engine exited; None: the actor is gone (or
    hangs, and is treated as gone)."""
    try:
        return ray.get(actor.running.remote(), timeout=CALL_TIMEOUT)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def connect(address: str | None) -> bool:
    """Join `address`, or start a Ray instance of this run's own on loopback; True when this call
    connected (and so should disconnect). A driver that is connected already is reused."""
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


def engine_bundle(launch: "LaunchConfig") -> dict[str, float]:
    """The resources one engine's actor takes: CPUs, and GPUs when it needs them."""
    bundle = {"CPU": launch.engine_cpus}
    if launch.engine_gpus:
        bundle["GPU"] = launch.engine_gpus
    return bundle


@contextmanager
def ray_servers(launch: "LaunchConfig", model: str | Path, log_dir: str | Path) -> Iterator[RayServers]:
    """`launch.engines` engines as actors of one placement group (one bundle each), and a local
    router in front of them; all stopped on exit."""
    owned = connect(launch.ray_address)
    log_dir = Path(log_dir).absolute()
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = RayServers(
        "", [], launch=launch, model=str(Path(model).absolute()), log_dir=log_dir, replaced=[0] * launch.engines
    )
    router: ServerProcess | None = None
    try:
        bundle = engine_bundle(launch)
        servers.group = placement_group([bundle] * launch.engines, strategy=launch.placement_strategy)
        try:
            ray.get(servers.group.ready(), timeout=launch.start_timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"launch: {launch.engines} bundles of {bundle} ({launch.placement_strategy}) not placed within "
                f"{launch.start_timeout:.0f}s; `ray status` shows what the cluster has"
            ) from None
        servers.actors = [servers.spawn(i) for i in range(launch.engines)]
        starts = [actor.start.remote(False, launch.start_timeout) for actor in servers.actors]
        servers.engine_urls = ray.get(starts, timeout=launch.start_timeout + CALL_TIMEOUT)
        router = router_process(launch, servers.engine_urls, log_dir).start(launch.start_timeout)
        servers.router_url = router.url
        yield servers
    finally:
        if router is not None:
            router.stop()
        servers.stop()
        if owned:
            ray.shutdown()
