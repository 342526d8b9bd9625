"""`python -m sglang.launch_server ...`: SGLang 0.5.23's command line, the built-in engine behind
the strict layer (tests only).

`SGLANG_SHIM_RECORD`: a file each start appends `{"argv", "pid"}` to (after the command line
parsed, as SGLang would have accepted it). `SGLANG_SHIM_EXIT=N`: print a line and exit N
instead of serving (a server that dies while starting).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sglang.server_args import parse
from slimish.engine.config import EngineConfig


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The built-in engine's settings for SGLang's: what it serves and how it is reached. The
    engine is one rank, fp32 on CPU; `--dtype`, `--dp-size` and `--pp-size` are reported by
    /server_info only."""
    lora = {
        "enable_lora": bool(args.enable_lora or args.lora_paths),
        "lora_paths": list(args.lora_paths or []),
        "max_lora_rank": args.max_lora_rank,
        "lora_target_modules": list(args.lora_target_modules or []),
        "max_loras_per_batch": args.max_loras_per_batch,
        "max_loaded_loras": args.max_loaded_loras,
    }
    return EngineConfig(
        model=args.model_path,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        served_model_name=args.served_model_name,
        context_length=args.context_length,
        disable_radix_cache=args.disable_radix_cache,
        enable_return_routed_experts=args.enable_return_routed_experts,
        seed=args.random_seed or 0,
        **({"max_running_requests": args.max_running_requests} if args.max_running_requests else {}),
        **lora,
    )


def main(argv: list[str]) -> int:
    args = parse(argv)
    if os.environ.get("SGLANG_SHIM_RECORD"):
        with open(os.environ["SGLANG_SHIM_RECORD"], "a") as f:
            f.write(json.dumps({"argv": argv, "pid": os.getpid()}) + "\n")
    if os.environ.get("SGLANG_SHIM_EXIT"):
        print("stand-in sglang: refusing to start", flush=True)
        return int(os.environ["SGLANG_SHIM_EXIT"])
    if args.tp_size != 1:  # a weight-update group would wait for tp_size engine ranks that never join
        print(
            f"stand-in sglang: the built-in engine is one rank; --tp-size {args.tp_size} cannot be served", flush=True
        )
        return 2

    import uvicorn

    from sglang.strict import StrictSGLang
    from slimish.engine.server import create_app

    cfg = engine_config(args)
    app = StrictSGLang(create_app(cfg), vars(args), os.environ)  # the engine loads before listening
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
