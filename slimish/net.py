"""Addresses: a free port to bind, a port held for a child server, and where to reach a server
from its bind address. Shared by the launcher, the trainer's process groups and the tests, and
importing nothing of slimish."""

from __future__ import annotations

import socket

FD_DOC = "serve on this inherited listening socket, not on host:port (a launcher's: slimish/processes.py)"


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now, for a child that binds it itself (SGLang): another
    process may take it first, so a child's health counts only from its own listener
    (`ServerProcess.wait_healthy`); `listening_socket` holds a port instead."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket listening on host:port (0: a free port) for a child server to serve on
    (`--fd`, slimish/processes.py). The port is held from here on: one only picked free
    (`free_port`) was taken by another process in the seconds a child took to start and bind it,
    whose server then answered the child's health checks."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=2048)


def connect_host(bind_host: str) -> str:
    """Where to reach a server bound to `bind_host`: loopback for the wildcard addresses."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host
