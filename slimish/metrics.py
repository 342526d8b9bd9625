"""Per-step metrics of a run: one live console line, `metrics.jsonl`, and TensorBoard.

Keys are slash-grouped (`reward/mean`, `time/rollout`), the same names in all three sinks, so
`slimish plot RUN_DIR` and TensorBoard draw the same curves the console showed.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# What the console line shows, in order, when present: (key, label, format). Short enough that
# a step is one line in an 80-column terminal or CI log.
CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/accuracy", "acc", "{:.3f}"),
    ("response/length", "len", "{:.0f}"),
    ("train/kl", "kl", "{:.0e}"),
    ("train/mismatch", "mism", "{:.0e}"),
    ("time/step", "t", "{:.1f}s"),
    ("time/weight_push", "push", "{:.1f}s"),
)


class RunLog:
    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, console: bool = True) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "a")
        from torch.utils.tensorboard import SummaryWriter  # imported late: it pulls in tensorboard

        self.tb = SummaryWriter(str(self.dir / "tb"))
        self.console = Console(stderr=True) if console else None
        self.progress = Progress(
            TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
            TextColumn("{task.description}"), console=self.console, disable=not (console and self.console.is_terminal), transient=True,
        )  # fmt: skip
        self.task = self.progress.add_task("", total=total_steps, completed=start_step)
        self.progress.start()
        self.last_eval: dict[str, float] = {}
        self.seen: dict[str, list[float]] = {}  # first and last value of each console key, for the summary

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record `metrics` for `step` (finite numbers only go to TensorBoard)."""
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self.jsonl.flush()
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(key, value, step)
        self.last_eval.update({k: v for k, v in metrics.items() if k.startswith("eval/")})
        shown = {**self.last_eval, **metrics}
        line = " ".join(f"{label} {fmt.format(shown[key])}" for key, label, fmt in CONSOLE_KEYS if key in shown)
        self.progress.update(self.task, completed=step, description=line)
        for key, _, _ in CONSOLE_KEYS:
            if isinstance(metrics.get(key), (int, float)):
                self.seen.setdefault(key, [metrics[key]] * 2)[1] = metrics[key]
        if self.console is not None:
            self.console.print(f"step {step}: {line}", highlight=False, overflow="ellipsis", no_wrap=True)

    def summary(self) -> str:
        """One line for the end of a run: each console metric's first and last value."""
        return ", ".join(f"{label} {fmt.format(self.seen[key][0])} -> {fmt.format(self.seen[key][1])}"
                         for key, label, fmt in CONSOLE_KEYS[:3] if key in self.seen)  # fmt: skip

    def message(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        self.progress.stop()
        self.tb.close()
        self.jsonl.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of `metrics.jsonl`; a resumed run's repeated steps keep the latest row."""
    rows: dict[int, dict[str, Any]] = {}
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.setdefault(row["step"], {}).update(row)
    return [rows[s] for s in sorted(rows)]
