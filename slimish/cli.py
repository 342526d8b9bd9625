"""The `slimish` console command. Each subcommand lives in the module that does the work.

A module listed here provides `add_arguments(parser)` and `run(args) -> int | None`; it is
imported only when its subcommand runs, so `slimish --help` stays fast and CPU-only.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny-model": ("slimish.tiny_model", "write a random-init HF causal LM and a locally trained tokenizer"),
    "engine": ("slimish.engine.server", "run the built-in engine (SGLang native protocol)"),
    "router": ("slimish.router.app", "run the router in front of SGLang-protocol engines"),
    "serve": ("slimish.launch.serve", "serve a model: N built-in engines behind a router"),
    "rollout": (
        "slimish.rollout.cli",
        "run rollout steps only and write the samples as JSONL (debug a rollout fn, make data)",
    ),
    "train": ("slimish.train", "RL training: rollouts, trainer steps, weight pushes (torchrun when trainer.nproc > 1)"),
    "plot": ("slimish.plot", "draw a run's metric curves to PNG"),
    "view": (
        "slimish.view",
        "a run in the browser: samples token by token, steps, a timeline (one HTML file; --serve)",
    ),
    "convert": ("megatron_bridge.convert", "convert an HF checkpoint to per-rank Megatron-Core shards and back"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="slimish", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage / the error for an unknown command
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    cmd_parser = argparse.ArgumentParser(prog=f"slimish {argv[0]}", description=COMMANDS[argv[0]][1])
    module.add_arguments(cmd_parser)
    return module.run(cmd_parser.parse_args(argv[1:])) or 0


if __name__ == "__main__":
    sys.exit(main())
