"""The `slimish` console command. Each subcommand lives in the module that does the work.

A module listed here (or a `module:object`) provides `add_arguments(parser)` and
`run(args) -> int | None`; it is imported only when its subcommand runs, so `slimish --help` stays
fast and CPU-only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from pathlib import Path
from typing import Any

COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny-model": ("slimish.tiny_model", "write a random-init HF causal LM and a locally trained tokenizer"),
    "engine": ("slimish.engine.server", "run the built-in engine (SGLang native protocol)"),
    "router": ("slimish.router.cli", "run the router in front of SGLang-protocol engines"),
    "serve": ("slimish.launch.serve", "serve a model: N built-in engines behind a router"),
    "rollout": (
        "slimish.cli:Rollout",
        "run rollout steps only and write the samples as JSONL (debug a rollout fn, make data)",
    ),
    "train": ("slimish.train", "RL training: rollouts, trainer steps, weight pushes (torchrun when trainer.nproc > 1)"),
    "plot": ("slimish.plot", "draw a run's metric curves to PNG"),
    "view": (
        "slimish.view",
        "a run in the browser: samples token by token, steps, a timeline (one HTML file; --serve)",
    ),
    "tinker": ("slimish.tinker.server", "serve the Tinker API (SDK tinker 0.38): LoRA training and sampling here"),
    "convert": ("megatron_bridge.convert", "convert an HF checkpoint to per-rank Megatron-Core shards and back"),
}


class Rollout:
    """`slimish rollout --config C --rollout-fn F --steps K --out FILE.jsonl [key=value ...]`: rollout
    steps only (slimish/rollout/cli.py), against engines and a router started here (or
    `launch.router_url`). Its start-up is here, not in the rollout package, because it reads the
    run config and starts servers; the functions and the data are checked before any server starts."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        from slimish.config import document_run_config

        parser.add_argument("--config", help="run config YAML (configs/quickstart.yaml)")
        parser.add_argument("--rollout-fn", help="module:function or path/to/file.py:function (rollout.rollout_fn)")
        parser.add_argument("--reward-fn", help="rollout.reward_fn")
        parser.add_argument("--filter-fn", help="rollout.filter_fn")
        parser.add_argument("--steps", type=int, help="rollout steps (default: the config's steps)")
        parser.add_argument("--out", required=True, help="JSONL file, one sample per line")
        parser.add_argument(
            "overrides",
            nargs="*",
            metavar="key=value",
            help="config overrides, dotted keys (rollout.n_samples_per_prompt=4)",
        )
        document_run_config(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from slimish.compat import load_function
        from slimish.config import load_run_config
        from slimish.plugins import LoadError
        from slimish.rollout.data import PromptData
        from slimish.rollout.functions import RolloutFunctions

        named = {
            "rollout.rollout_fn": args.rollout_fn,
            "rollout.reward_fn": args.reward_fn,
            "rollout.filter_fn": args.filter_fn,
        }
        cfg = load_run_config(args.config, args.overrides, **named)
        try:
            fns = RolloutFunctions.load(cfg.rollout, load_function)
            data = PromptData(cfg.data)
        except (LoadError, ValueError) as exc:
            raise SystemExit(str(exc)) from None
        steps = cfg.steps if args.steps is None else args.steps
        # torch and transformers: only once the checks passed
        from slimish.launch import start_servers
        from slimish.launch.commands import run_launch
        from slimish.rollout.cli import rollout_to_jsonl
        from slimish.rollout.stats import RolloutFailing, RolloutStalled

        with start_servers(run_launch(cfg), cfg.model, Path(cfg.run_dir) / "logs") as servers:
            try:
                asyncio.run(rollout_to_jsonl(cfg, servers.router_url, fns, data, steps, Path(args.out)))
            except RolloutStalled as exc:
                raise SystemExit(f"slimish rollout: {exc}") from None
            except RolloutFailing as exc:  # nothing to resume: what finished is in --out already
                raise SystemExit(f"slimish rollout: {exc}, then run it again") from None
        return 0


def command(name: str) -> Any:
    """What provides `slimish NAME`'s add_arguments and run: a module, or `module:object`."""
    where, _, attr = COMMANDS[name][0].partition(":")
    module = importlib.import_module(where)
    return getattr(module, attr) if attr else module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # As `python -m slimish.cli` does: `--rollout-fn my_pkg.mod:fn` names a module of the working
    # directory (a console script's sys.path starts at its own bin directory instead).
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    parser = argparse.ArgumentParser(prog="slimish", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage / the error for an unknown command
        return 2
    module = command(argv[0])
    cmd_parser = argparse.ArgumentParser(prog=f"slimish {argv[0]}", description=COMMANDS[argv[0]][1])
    module.add_arguments(cmd_parser)
    return module.run(cmd_parser.parse_args(argv[1:])) or 0


if __name__ == "__main__":
    sys.exit(main())
