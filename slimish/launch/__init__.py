"""Starting engines and routers: child processes on this machine (`launch.mode: local`) or Ray
actors across a cluster (`launch.mode: ray`); built-in, SGLang or external engines."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from slimish.launch.commands import teacher_launch_config
from slimish.launch.cpus import Place
from slimish.launch.local import Servers, engines_only, local_servers
from slimish.launch.workers import named_workers, registered

if TYPE_CHECKING:
    from slimish.launch.config import LaunchConfig


def start_servers(
    launch: "LaunchConfig",
    model: str | Path,
    log_dir: str | Path,
    first_gpu: int = 0,
    wait: bool = True,
    places: tuple[Place, ...] = (),
) -> AbstractContextManager[Servers]:
    """The engines and router of a run, by `launch.mode`; Ray is imported only when used. Local
    GPU engines go on this machine's GPUs from `first_gpu` on (slimish/launch/plan.py), local
    engines on their CPUs in `places` (slimish/launch/cpus.py). With `wait=False`,
    `Servers.ready` waits for local engines (Ray's are up on entry)."""
    if launch.mode == "ray":
        from slimish.launch.ray_engines import ray_servers

        return ray_servers(launch, model, log_dir)
    return local_servers(launch, model, log_dir, first_gpu, wait, places)


@contextmanager
def teacher_servers(
    launch: "LaunchConfig", log_dir: str | Path, policy_router: str, first_gpu: int = 0
) -> Iterator[Servers]:
    """On-policy distillation's teacher (`launch.teacher`): its own engines and router, started
    on this machine like the policy's local ones (logs in `log_dir`; GPUs from `first_gpu` on),
    or the server at `teacher.router_url`; with `teacher.served_name`, its engines (started, or
    already there) behind `policy_router` by that name. Never part of the policy's `Servers`, so
    weight sync never reaches it."""
    t = launch.teacher
    own = teacher_launch_config(launch)
    if t.served_name is None:
        with local_servers(own, t.model or "", log_dir, first_gpu) as servers:
            yield servers
    elif not t.model:
        urls = list(named_workers(policy_router, t.served_name, launch.api_key))
        if not urls:
            raise ValueError(
                f"launch.teacher.served_name: no worker is registered under {t.served_name!r} on {policy_router}"
            )
        yield Servers(policy_router, urls)
    else:
        with engines_only(own, t.model, log_dir, first_gpu) as engines:
            urls = [e.url for e in engines]
            with registered(policy_router, urls, t.served_name, launch.api_key, launch.start_timeout):
                yield Servers(policy_router, urls, engines)


def check_push_targets(policy_urls: list[str], teacher_urls: list[str]) -> None:
    """Weight sync targets the policy's engines only: fail if one of them is also the teacher's."""
    shared = {u.rstrip("/") for u in policy_urls} & {u.rstrip("/") for u in teacher_urls}
    if shared:
        raise ValueError(
            f"launch.teacher: engines {sorted(shared)} serve both the policy and the teacher; weight pushes would "
            "change the teacher. Give the teacher engines of its own"
        )
