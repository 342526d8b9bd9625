"""`slimish serve --model DIR --engines N`: N built-in engines and a router, one command.

The engines are child processes on free ports (logs in `--log-dir`); the router runs in this
process in front of them. Ctrl-C or SIGTERM stops the router, then every engine: no orphans.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

from slimish.flags import add_config_arguments, config_from_args
from slimish.launch.commands import engine_flags
from slimish.launch.config import ServeConfig
from slimish.launch.local import engine_process
from slimish.processes import ServerProcess, start_all
from slimish.router.cli import add_arguments as add_router_arguments
from slimish.router.cli import serve_forever
from slimish.router.config import RouterConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ServeConfig)
    add_router_arguments(parser, worker_urls=False)


def run(args: argparse.Namespace) -> int:
    serve = config_from_args(ServeConfig, args)
    log_dir = Path(serve.log_dir or tempfile.mkdtemp(prefix="slimish-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        flags = engine_flags(serve.engine_flag, "--engine-flag")
        engines: list[ServerProcess] = [
            engine_process(serve.model, log_path=log_dir / f"engine{i}.log", **flags) for i in range(serve.engines)
        ]
    except ValueError as exc:
        raise SystemExit(f"slimish serve: {exc}") from None
    # SIGTERM while engines start must still reach the `finally` that stops them (the router
    # installs its own handlers once it runs: a graceful stop, exit 0).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        print(f"slimish serve: starting {serve.engines} engine(s) for {serve.model} (logs in {log_dir})", flush=True)
        start_all(engines, serve.start_timeout)
        for e in engines:
            print(f"slimish serve: engine ready at {e.url}", flush=True)
        cfg = config_from_args(RouterConfig, args, worker_urls=[e.url for e in engines])
        serve_forever(
            cfg,
            lambda url: print(
                f"slimish serve: router at {url} in front of {serve.engines} engine(s); Ctrl-C to stop", flush=True
            ),
        )
    finally:
        for e in engines:
            e.stop()
    return 0
