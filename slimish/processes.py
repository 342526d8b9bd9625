"""A server as a child process: spawn, wait until healthy (bounded), stop without orphans. The
built-in engine, the router and SGLang are all started through this."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from slimish.net import listening_socket
from slimish.protocol import auth_headers

log = logging.getLogger(__name__)
KILL_WAIT_S = 10.0  # how long a SIGKILLed child is waited for before it is left to be reaped later


class ServerProcess:
    """A `python -m <module> <argv>` child (`slimish.cli` unless told) serving HTTP on `host:port`.
    With `sock` (`listening_socket`), the child serves on that socket (`--fd N` added to `argv`),
    so the port is this child's from the start; it is passed at each spawn and bound again on the
    same port for a respawn. Without it (SGLang, which takes no socket), the child binds `port`."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        host: str = "127.0.0.1",
        health_path: str = "/health",
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        module: str = "slimish.cli",
        cpus: tuple[int, ...] = (),
        api_key: str | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        self.argv, self.host, self.port, self.health_path, self.module = argv, host, port, health_path, module
        self.cpus = cpus  # pinned to these CPUs (launch.cpu_placement); (): this process's
        self.api_key = api_key  # a keyed server's: `health_path` may be a keyed route (/model_info)
        self.name = argv[0] if module == "slimish.cli" else module  # for messages: "engine", "sglang.launch_server"
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.sock = sock  # held until the next spawn, which takes it
        self.bind_address = sock.getsockname()[:2] if sock else None  # where a respawn binds its socket again

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
        the thread that lives as long as the child should: the signal follows the spawning thread.
        With `cpus`, the child is pinned to them before it runs (every thread it makes inherits them)."""
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        if self.bind_address and self.sock is None:
            self.sock = listening_socket(*self.bind_address)
        fds = (self.sock.fileno(),) if self.sock else ()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.argv, *(["--fd", str(fds[0])] if fds else [])],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=fds,
            preexec_fn=self._in_child if sys.platform == "linux" else None,
        )
        if self.sock:  # the child's copy alone: the port refuses connections once the child is gone
            self.sock.close()
            self.sock = None

    def _in_child(self) -> None:
        die_with_parent()
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)

    def wait_healthy(self, timeout: float) -> None:
        """Poll `health_path` until it answers 200 from the child. A child that binds its own port
        (SGLang, `router --processes N`) can find it taken by another process in the minute it
        takes to start; that server's 200 is not the child's, so it is not taken as healthy."""
        deadline, other = time.monotonic() + timeout, ""
        # One client for the polls: each builds an SSL context (~80 ms).
        with httpx.Client(timeout=2.0, headers=auth_headers(self.api_key)) as http:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} on port {self.port} exited with {self.proc.returncode}{other}{self._log_tail()}"
                    )
                try:
                    if http.get(self.url + self.health_path).status_code == 200:
                        if self.proc is None or self.listens() is not False:
                            return
                        # named once: reading every process's sockets is not a per-poll cost
                        other = other or f" (port {self.port} answers from another process: {listeners(self.port)})"
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(
            f"{self.name} on port {self.port} not healthy within {timeout:.0f}s{other}{self._log_tail()}"
        )

    def listens(self) -> bool | None:
        """Whether the child, or a process it started, listens on `port`; None where the OS does
        not let this process read that."""
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        for proc in tree:
            try:
                if any(_listening(c, self.port) for c in proc.net_connections("inet")):
                    return True
            except psutil.NoSuchProcess:
                continue  # gone since it was listed
            except psutil.AccessDenied:
                return None
        return False

    def _log_tail(self) -> str:
        """Where to read why: the child's log, named, and its tail."""
        if self.log_path and self.log_path.exists():
            return (
                f"; read its log, {self.log_path} (tail below):\n" + self.log_path.read_text(errors="replace")[-3000:]
            )
        return ""

    def exited(self) -> bool:
        """Whether the child has exited (False before it is spawned). A child killed while its
        threads were busy shows its main thread as a zombie, its port closed already, before the
        kernel lets it be reaped (once its last thread is gone: up to seconds on a loaded
        machine); `poll` reads it as running until then. Such a child is finished off and reaped
        here: it counts as exited, and its port is free for a respawn."""
        if self.proc is None:
            return False
        if self.proc.poll() is None and not main_thread_exited(self.proc.pid):
            return False
        self.kill()
        return True

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault-injection tests). A child stuck in the kernel (a GPU
        driver call) dies only when that call returns: it is left to be reaped then, with a
        warning, rather than failing the stop or the watch loop that called this."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s (pid %d) did not exit within %.0f s of SIGKILL; left to be reaped later",
                    self.name,
                    self.proc.pid,
                    KILL_WAIT_S,
                )

    def stop(self, timeout: float = 10.0) -> None:
        if self.sock:  # never spawned
            self.sock.close()
            self.sock = None
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


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on, sorted (all of them where affinity is not available)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def _listening(conn, port: int) -> bool:
    return conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port


def listeners(port: int) -> str:
    """The processes listening on `port`, as "pid N (name)", for messages."""
    try:
        pids = {c.pid for c in psutil.net_connections("inet") if c.pid and _listening(c, port)}
    except psutil.AccessDenied:
        return "not readable here"
    names = []
    for pid in sorted(pids):
        try:
            names.append(f"pid {pid} ({psutil.Process(pid).name()})")
        except psutil.Error:
            names.append(f"pid {pid}")
    return ", ".join(names) or "none found"


def main_thread_exited(pid: int) -> bool:
    """Whether `pid`'s main thread is a zombie: the process has exited or is exiting, whether or
    not its other threads are gone yet. False where that cannot be read (or no such process)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
