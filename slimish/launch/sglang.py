"""Real SGLang servers as engines (`launch.engine_kind: sglang`, GPU machines).

An SGLang server speaks the protocol the built-in engine speaks (../shared/PROTOCOL.md), so once
it is up the router, the rollout and the weight sync treat it like any engine; this module only
builds its command line and runs it as a supervised `ServerProcess` child.
"""

from __future__ import annotations

from pathlib import Path

from slimish.launch.process import ServerProcess
from slimish.net import connect_host, free_port

MODULE = "sglang.launch_server"
PREFIX = "--sglang-"
# Set by the launcher (the run's model, a free port on the engine's node): never passed through.
OWNED = ("--model-path", "--model", "--host", "--port")


def pass_through(args: list[str]) -> list[str]:
    """`launch.sglang_args` as SGLang reads them: `--sglang-tp-size` is `--tp-size`. Flags the
    launcher sets itself are refused rather than silently duplicated."""
    out = []
    for arg in args:
        if arg.startswith(PREFIX):
            arg = "--" + arg[len(PREFIX) :]
        flag = arg.split("=", 1)[0]
        if flag in OWNED:
            raise ValueError(f"launch.sglang_args: {flag} is set by the launcher (from `model` and a free port); remove it")
        out.append(arg)
    return out


def sglang_argv(model: str | Path, host: str, port: int, args: list[str], api_key: str | None = None) -> list[str]:
    """The arguments after `python -m sglang.launch_server`."""
    argv = ["--model-path", str(model), "--host", host, "--port", str(port), *pass_through(args)]
    if api_key and not any(a.split("=", 1)[0] == "--api-key" for a in argv):
        argv += ["--api-key", api_key]
    return argv


def sglang_process(
    model: str | Path,
    args: list[str],
    host: str = "127.0.0.1",
    port: int | None = None,
    api_key: str | None = None,
    log_path: str | Path | None = None,
) -> ServerProcess:
    """An SGLang server child bound to `host`, not started. Healthy means `GET /health` is 200,
    which SGLang answers once the model is loaded and warmed up (503 before)."""
    port = port or free_port(host)
    argv = sglang_argv(model, host, port, args, api_key)
    return ServerProcess(argv, port=port, host=connect_host(host), log_path=log_path, module=MODULE)
