"""`slimish rollout`'s steps: K rollout steps against a router, every finished sample written as
one JSON line (`Sample.to_dict`, so `Sample.from_dict` reads it back): the groups that survived,
and the dropped ones with `metadata.dropped` saying why (filter reason, or the failure). For
debugging a rollout plugin and for generating data.

The command's start-up (its flags, the config, the checks, the servers) is in slimish/cli.py: it
reads the run config and starts servers, which sit on floors above the rollout package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from slimish.buffer import Buffer, Staleness
from slimish.rollout.api import RolloutRuntime
from slimish.rollout.data import PromptData
from slimish.rollout.functions import RolloutFunctions
from slimish.rollout.manager import RolloutManager
from slimish.types import Sample

if TYPE_CHECKING:
    from slimish.config import RunConfig


async def rollout_to_jsonl(
    cfg: RunConfig, router_url: str, fns: RolloutFunctions, data: PromptData, steps: int, out_path: Path
) -> None:
    """`steps` rollout steps through the router at `router_url`, every sample into `out_path`; a
    progress bar and each step's summary on stderr."""
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
            manager = RolloutManager(runtime, data, buffer, fns, on_group=on_group)
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
