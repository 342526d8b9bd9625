"""Real SGLang servers as engines (`launch.engine_kind: sglang`, GPU machines).

An SGLang server speaks the protocol the built-in engine speaks (docs/protocol.md), so once
it is up the router, the rollout and the weight sync treat it like any engine; this module only
builds its command line and runs it as a supervised `ServerProcess` child.
"""

from __future__ import annotations

from pathlib import Path

from slimish.net import connect_host, free_port
from slimish.processes import ServerProcess

MODULE = "sglang.launch_server"
# /health answers from the server's state instead of running a one-token generation, which waits
# out a pause: a weight push longer than the router's health timeout would otherwise have every
# engine marked down mid-push (sglang 0.5.23: python/sglang/srt/environ.py:344,
# python/sglang/srt/entrypoints/http_server.py:744). Still 503 until the server is up.
ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
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
            raise ValueError(
                f"launch.sglang_args: {flag} is set by the launcher (from `model` and a free port); remove it"
            )
        out.append(arg)
    return out


def flag_value(args: list[str], *names: str) -> str | None:
    """The value of the last of `names` (one flag and its aliases, e.g. `--tp-size`,
    `--tensor-parallel-size`) in `launch.sglang_args`, given as `--flag V` or `--flag=V`; None
    when absent."""
    value = None
    args = pass_through(args)
    for i, arg in enumerate(args):
        flag, sep, given = arg.partition("=")
        if flag in names:
            value = given if sep else (args[i + 1] if i + 1 < len(args) else None)
    return value


def sglang_tp(args: list[str]) -> int:
    """The tensor-parallel size SGLang will run with: the GPUs one engine takes."""
    return int(flag_value(args, "--tp-size", "--tensor-parallel-size") or 1)


def without(args: list[str], flag: str) -> list[str]:
    """`args` less `flag` and its value (`--flag V` or `--flag=V`)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


# Added unless `launch.sglang_args` sets them. bfloat16: under SGLang's own default (`auto`) an
# fp32 checkpoint (slimish make-tiny-model, many fine-tunes) is served in fp16 (sglang 0.5.23:
# python/sglang/srt/arg_groups/fields/model.py), while the trainer computes in bf16 on GPU: the
# rollout's log-probs would come from another precision, and fp16 activations can overflow.
DEFAULT_ARGS = {"--dtype": "bfloat16"}


def sglang_argv(
    model: str | Path, host: str, port: int, args: list[str], api_key: str | None = None, base_gpu_id: int | None = None
) -> list[str]:
    """The arguments after `python -m sglang.launch_server`. `base_gpu_id`: the first of this
    engine's GPUs on its node, set by the launcher per engine (it replaces a `--base-gpu-id` in
    `args`, which placed the first engine)."""
    args = pass_through(args)
    argv = ["--model-path", str(model), "--host", host, "--port", str(port)]
    if base_gpu_id is not None:
        argv += ["--base-gpu-id", str(base_gpu_id)]
        args = without(args, "--base-gpu-id")
    for flag, value in DEFAULT_ARGS.items():
        if flag_value(args, flag) is None:
            argv += [flag, value]
    argv += args
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
    base_gpu_id: int | None = None,
) -> ServerProcess:
    """An SGLang server child bound to `host`, not started. Healthy means `GET /health` is 200,
    which SGLang answers once the model is loaded and warmed up (503 before)."""
    port = port or free_port(host)
    argv = sglang_argv(model, host, port, args, api_key, base_gpu_id)
    return ServerProcess(argv, port=port, host=connect_host(host), env=ENV, log_path=log_path, module=MODULE)
