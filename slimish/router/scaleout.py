"""`slimish router --processes N`: N router processes serving one port, and the parent that keeps
them one router.

Why: one Python event loop tops out near 1,700 req/s; the hot path (parse, pick, forward) has no
state that must be exact across requests except what shared.py shares, so it scales with
processes. Each child binds the port with SO_REUSEPORT and the kernel spreads new connections
over them: no front process, no extra hop. The parent serves no client; it owns the registry and
its health checks (shared.py says how children see it) and answers the admin routes children
pass it on a private loopback port.

Lifetimes: children get SIGTERM when the parent dies, even by SIGKILL (Linux parent-death
signal), and the parent stops, with an error, when a child dies: never half a router.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
from multiprocessing.connection import wait
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

from slimish.processes import die_with_parent
from slimish.router.app import create_app
from slimish.router.config import RouterConfig
from slimish.router.shared import RegistryFollower, RegistryPublisher
from slimish.router.wire import bind, run

log = logging.getLogger("slimish.router")


def serve(cfg: RouterConfig) -> int:
    """Run until SIGTERM / Ctrl-C (0) or until a router process dies (1)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise SystemExit("--processes: more than one router process needs SO_REUSEPORT (Linux, BSD, macOS)")
    if cfg.port == 0:
        raise SystemExit(f"--port 0: with --processes {cfg.processes} every process must bind the same port; name one")
    bind(cfg.host, cfg.port, reuse_port=False).close()  # taken by anyone, even another slimish router: say so now
    state_dir = Path(tempfile.mkdtemp(prefix="slimish-router-"))
    try:
        return run(_supervise(cfg, state_dir / "workers.json"))
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


async def _supervise(cfg: RouterConfig, state: Path) -> int:
    ctx = mp.get_context("spawn")
    version = ctx.RawValue("Q", 0)
    router = create_app(cfg)
    publisher = RegistryPublisher(router.workers, state, version)
    publisher.publish()
    router.app = publisher.wrap(router.app)  # type: ignore[assignment]
    control = bind("127.0.0.1", 0, reuse_port=False)
    parent_url = f"http://127.0.0.1:{control.getsockname()[1]}"
    stop, ready = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(router.serve([control], ready=ready.set, stop=stop))
    await asyncio.wait({serving, asyncio.ensure_future(ready.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():  # the startup health checks are in before ready, as in one process
        return 1
    children = [
        ctx.Process(
            target=_child,
            args=(cfg, i, parent_url, str(state), version, os.getpid()),
            name=f"slimish-router-{i}",
            daemon=True,
        )
        for i in range(cfg.processes)
    ]
    for child in children:
        child.start()
    try:
        died = asyncio.ensure_future(asyncio.to_thread(wait, [c.sentinel for c in children]))
        await asyncio.wait({serving, died}, return_when=asyncio.FIRST_COMPLETED)
        if not died.done():
            return 0
        gone = next(c for c in children if not c.is_alive())
        log.error("router process %s exited with %s: stopping the router", gone.name, gone.exitcode)
        print(f"slimish router: process {gone.name} exited with {gone.exitcode}; stopping", file=sys.stderr, flush=True)
        stop.set()
        await serving
        return 1
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join()


def _child(cfg: RouterConfig, index: int, parent_url: str, state: str, version: Synchronized, parent_pid: int) -> None:
    """One of the N processes on the public port."""
    if sys.platform == "linux":
        die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        return
    logging.basicConfig(level=cfg.log_level.upper(), format=f"%(asctime)s %(name)s[{index}] %(levelname)s %(message)s")
    sock = bind(cfg.host, cfg.port, reuse_port=True)
    run(create_app(cfg, RegistryFollower(index, parent_url, Path(state), version)).serve([sock], signals=True))
