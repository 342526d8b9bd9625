"""`slimish router`: its flags, and serving them: one process (here), or N sharing the port
(`--processes N`, scaleout.py). `slimish serve` runs the one-process router in front of the
engines it starts (slimish/launch/serve.py)."""

from __future__ import annotations

import argparse
import logging
import socket
from typing import Callable

from slimish.flags import add_config_arguments, config_from_args
from slimish.router import wire
from slimish.router.app import create_app
from slimish.router.config import RouterConfig
from slimish.router.scaleout import serve
from slimish.serving import warn_if_exposed

log = logging.getLogger("slimish.router")


def add_arguments(parser: argparse.ArgumentParser, worker_urls: bool = True) -> None:
    """All router flags; without `--worker-urls` and `--processes` for `slimish serve`, whose
    router runs inside its own process in front of the engines it starts."""
    add_config_arguments(parser, RouterConfig, skip=() if worker_urls else ("worker_urls", "processes"))


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C: requests in flight finish first (exit 0)."""
    cfg = config_from_args(RouterConfig, args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    warn_if_exposed("router", cfg.host, cfg.api_key)
    if cfg.processes > 1:
        return serve(cfg)
    serve_forever(cfg, lambda url: log.info("slimish router serving on %s", url))
    return 0


def serve_forever(cfg: RouterConfig, announce: Callable[[str], None]) -> None:
    """One router process on --host/--port until SIGTERM or Ctrl-C, when requests in flight finish
    first; `announce(url)` once it takes requests (after the startup health checks)."""
    sock = wire.bind(cfg.host, cfg.port, reuse_port=False) if cfg.fd is None else socket.socket(fileno=cfg.fd)
    url = f"http://{cfg.host}:{sock.getsockname()[1]}"
    wire.run(create_app(cfg).serve([sock], signals=True, ready=lambda: announce(url)))
