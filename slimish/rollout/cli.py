"""`slimish rollout --config C --rollout-fn F --steps K --out FILE.jsonl [key=value ...]`: rollout only.

For debugging a rollout plugin and for generating data. Runs K rollout steps against engines and
a router started here (or `launch.router_url`), and writes every finished sample as one JSON line
(`Sample.to_dict`, so `Sample.from_dict` reads it back): the groups that survived, and the
dropped ones with `metadata.dropped` saying why (filter reason, or the failure). The functions
and the data are checked before any server starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from slimish.buffer import Buffer, Staleness
from slimish.config import RunConfig, document_run_config, load_run_config
from slimish.launch import start_servers
from slimish.rollout.data import PromptData
from slimish.rollout.loader import LoadError, load_functions
from slimish.types import Sample


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    named = {
        "rollout.rollout_fn": args.rollout_fn,
        "rollout.reward_fn": args.reward_fn,
        "rollout.filter_fn": args.filter_fn,
    }
    cfg = load_run_config(args.config, args.overrides, **named)
    try:
        fns = load_functions(cfg.rollout)
        data = PromptData(cfg.data)
    except (LoadError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    steps = cfg.steps if args.steps is None else args.steps
    from slimish.rollout.manager import (
        RolloutFailing,
        RolloutStalled,
    )  # torch and transformers: only once the checks passed

    with start_servers(cfg.launch, cfg.model, Path(cfg.run_dir) / "logs") as servers:
        try:
            asyncio.run(_rollout(cfg, servers.router_url, fns, data, steps, Path(args.out)))
        except (RolloutStalled, RolloutFailing) as exc:
            raise SystemExit(f"slimish rollout: {exc}") from None
    return 0


async def _rollout(cfg: RunConfig, router_url: str, fns: tuple, data: PromptData, steps: int, out_path: Path) -> None:
    from slimish.rollout.api import RolloutRuntime
    from slimish.rollout.manager import RolloutManager

    console = Console(stderr=True)
    runtime = await RolloutRuntime.create(cfg, router_url)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with out_path.open("w") as out, Progress(*columns, console=console) as progress:
            bar = progress.add_task("groups", total=steps * cfg.rollout.rollout_batch_size)

            def on_group(group: list[Sample], dropped: str | None) -> None:
                if dropped is None:
                    progress.advance(bar)
                else:
                    _write(out, group)

            buffer = Buffer(Staleness.of(cfg.buffer))
            manager = RolloutManager(runtime, data, buffer, *fns, on_group=on_group)
            for step in range(steps):
                progress.update(bar, description=f"step {step + 1}/{steps}")
                stats = await manager.run_step(current_version=0)
                for group in buffer.get_batch(len(buffer)):
                    _write(out, group)
                progress.console.print(_summary(step, stats))
    finally:
        await runtime.close()
    console.print(f"wrote {out_path}")


def _write(out: IO[str], group: list[Sample]) -> None:
    for s in group:
        out.write(json.dumps(s.to_dict()) + "\n")
    out.flush()


def _summary(step: int, stats: dict[str, Any]) -> str:
    counts = ", ".join(
        f"{k} {stats[k]}" for k in ("completed", "truncated", "aborted", "failed", "filtered") if stats[k]
    )
    line = (
        f"step {step + 1}: {stats['groups_kept']} groups kept, {counts or 'no samples'}; reward {stats['reward_mean']:.3f}, "
        f"response {stats['response_length_mean']:.1f} tokens, {stats['samples_per_s']:.1f} samples/s"
    )
    if stats["filter_reasons"]:
        line += f"\n  filtered: {stats['filter_reasons']}"
    for error in stats["errors"][:3]:
        line += f"\n  failed {error}"
    return line
