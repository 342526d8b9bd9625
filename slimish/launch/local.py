"""Start slimish servers (engines, routers) as child processes on this machine.

Used by `slimish serve`, by the trainer's embedded mode and by the tests, so that all of them
start, wait for and stop servers the same way: bounded waits, no orphans.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from slimish.config import LaunchConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now (the usual small race is accepted)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `python -m slimish.cli <argv>` child serving HTTP on `host:port`."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        host: str = "127.0.0.1",
        health_path: str = "/health",
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.argv, self.host, self.port, self.health_path = argv, host, port, health_path
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        self.launch()
        self.wait_healthy(timeout)
        return self

    def launch(self) -> None:
        """Spawn without waiting. The child gets SIGTERM if this process dies, even by SIGKILL
        (Linux parent-death signal), so a crashed trainer leaves no engines behind. Call it from
        the thread that lives as long as the child should: the signal follows the spawning thread."""
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slimish.cli", *self.argv], env=self.env, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )  # fmt: skip

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as http:  # one client: each bare httpx.get builds an SSL context (~80 ms)
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"{self.argv[0]} on port {self.port} exited with {self.proc.returncode}{self._log_tail()}")
                try:
                    if http.get(self.url + self.health_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"{self.argv[0]} on port {self.port} not healthy within {timeout:.0f}s{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log_path and self.log_path.exists():
            return "; log tail:\n" + self.log_path.read_text(errors="replace")[-3000:]
        return ""

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault-injection tests)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_all(procs: list[ServerProcess], timeout: float) -> None:
    """Spawn all, then wait for each: the model copies load concurrently."""
    for proc in procs:
        proc.launch()
    for proc in procs:
        proc.wait_healthy(timeout)


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def engine_process(model: str | Path, port: int | None = None, log_path: str | Path | None = None, **flags: object) -> ServerProcess:
    """A built-in engine child; `flags` become `--flag value` (`max_running_requests=8`)."""
    port = port or free_port()
    argv = ["engine", "--model", str(model), "--port", str(port)]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return ServerProcess(argv, port=port, log_path=log_path)


@dataclass
class Servers:
    """What a run talks to: the router (rollouts) and each engine (weight sync)."""

    router_url: str
    engine_urls: list[str]


@contextmanager
def local_servers(launch: "LaunchConfig", model: str | Path, log_dir: str | Path) -> Iterator[Servers]:
    """The engines and router a run needs: started here (children, stopped on exit) unless
    `launch.router_url` names existing ones, whose engines are then read from its worker list."""
    if launch.router_url:
        yield Servers(launch.router_url, existing_engine_urls(launch.router_url, launch.api_key))
        return
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = dict(pair.split("=", 1) for pair in launch.engine_flag)
    if launch.api_key:
        flags.setdefault("api_key", launch.api_key)
    engines = [engine_process(model, log_path=log_dir / f"engine{i}.log", **flags) for i in range(launch.engines)]
    router: ServerProcess | None = None
    try:
        start_all(engines, launch.start_timeout)
        port = free_port()
        argv = ["router", "--port", str(port), "--policy", launch.policy, "--worker-urls", *[e.url for e in engines]]
        if launch.api_key:
            argv += ["--api-key", launch.api_key]
        router = ServerProcess(argv, port=port, log_path=log_dir / "router.log").start(launch.start_timeout)
        yield Servers(router.url, [e.url for e in engines])
    finally:
        for proc in [router, *engines]:
            if proc is not None:
                proc.stop()


def existing_engine_urls(url: str, api_key: str | None = None) -> list[str]:
    """A router's workers (`GET /list_workers`), or `[url]` when `url` is an engine itself."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/list_workers", headers=headers, timeout=10.0)
    if r.status_code == 404:
        return [url.rstrip("/")]
    r.raise_for_status()
    return list(r.json()["urls"])
