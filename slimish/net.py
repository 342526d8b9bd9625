"""Addresses: a free port to bind, and where to reach a server from its bind address. Shared by
the launcher, the trainer's process groups and the tests, and importing nothing of slimish."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now (the usual small race is accepted)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def connect_host(bind_host: str) -> str:
    """Where to reach a server bound to `bind_host`: loopback for the wildcard addresses."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host
