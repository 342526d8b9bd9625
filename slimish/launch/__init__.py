"""Starting engines and routers: child processes on this machine (`launch.mode: local`) or Ray
actors across a cluster (`launch.mode: ray`); built-in, SGLang or external engines."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from slimish.launch.local import Servers, local_servers

if TYPE_CHECKING:
    from slimish.config import LaunchConfig


def start_servers(launch: "LaunchConfig", model: str | Path, log_dir: str | Path) -> AbstractContextManager[Servers]:
    """The engines and router of a run, by `launch.mode`; Ray is imported only when used."""
    if launch.mode == "ray":
        from slimish.launch.ray_engines import ray_servers

        return ray_servers(launch, model, log_dir)
    return local_servers(launch, model, log_dir)
