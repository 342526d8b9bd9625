"""Per-step metrics of a run: one live console line, `metrics.jsonl`, TensorBoard, and Weights &
Biases when `metrics.wandb.enabled` (with a table of sample rows per step).

Keys are slash-grouped (`reward/mean`, `time/rollout`), the same names in every sink, so
`slimish plot RUN_DIR`, TensorBoard and W&B draw the same curves the console showed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from slimish.schema import at_least, doc, one_of

if TYPE_CHECKING:
    from slimish.types import Sample

WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class WandbConfig:
    """Weights & Biases: one more sink beside metrics.jsonl and TensorBoard (slimish/metrics.py),
    the same keys at the same steps; `pip install 'slimish[wandb]'`, imported only when enabled."""

    enabled: bool = doc(False, "log to W&B too (pip install -e '.[wandb]')")
    project: str = doc("slimish", "the W&B project")
    name: str | None = doc(None, "the run's display name; None: run_dir's last folder")
    entity: str | None = doc(None, "team or user; None: the logged-in user's default")
    mode: str | None = doc(
        None,
        "online | offline | disabled (off, as enabled=false). None: $WANDB_MODE when set, else online with "
        "WANDB_API_KEY set, offline without (`wandb sync DIR` uploads an offline run later).",
    )
    dir: str | None = doc(None, "where wandb/ goes; None: $WANDB_DIR when set, else run_dir")
    sample_groups: int = doc(
        2,
        "Groups per step added to the `samples` table (prompt, response, reward, status, one row per sample; an "
        "incremental table: each step uploads only its new rows); 0 = no table.",
    )

    def __post_init__(self) -> None:
        one_of("metrics.wandb.mode", self.mode, (None, *WANDB_MODES))
        at_least(0, self, "metrics.wandb.", "sample_groups")


@dataclass
class MetricsConfig:
    """Where per-step metrics go besides the console, metrics.jsonl and TensorBoard (always on)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    view_groups: int = doc(
        4,
        "Trained groups per step whose samples (every token) go to RUN_DIR/view/samples.jsonl for `slimish view` "
        "(slimish/view.py); 0 = none (view/timeline.jsonl is always written).",
    )

    def __post_init__(self) -> None:
        at_least(0, self, "metrics.", "view_groups")


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


class WandbSink:
    """A W&B run fed the rows RunLog writes to metrics.jsonl, at the same steps, and an incremental
    `samples` table (one row per sample of `cfg.sample_groups` groups a step)."""

    COLUMNS = ["step", "group", "index", "prompt", "response", "reward", "status"]

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: Any = None) -> None:
        import wandb  # imported only when enabled: the optional extra `slimish[wandb]`

        self.cfg = cfg
        id_file = run_dir / "wandb_run_id"  # a resumed run (same run_dir) continues the same W&B run
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        directory = cfg.dir or (None if os.environ.get("WANDB_DIR") else str(run_dir))
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_dir.resolve().name,
            id=run_id,
            resume="allow",
            mode=wandb_mode(cfg),
            dir=directory,
            config=_plain(config),
            reinit="create_new",
        )
        self.table = wandb.Table(columns=self.COLUMNS, log_mode="INCREMENTAL") if cfg.sample_groups else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}
        self.run.log(row, step=step)  # several rows of one step merge, as read_metrics merges them

    def log_samples(self, step: int, groups: list[list[Sample]], reward_key: str | None) -> None:
        if self.table is None or not groups:
            return
        for group in groups[: self.cfg.sample_groups]:
            for s in group:
                self.table.add_data(
                    step,
                    s.group_id,
                    s.index,
                    _prompt_text(s.prompt),
                    s.response,
                    _reward(s, reward_key),
                    str(getattr(s.status, "value", s.status)),
                )
        self.run.log({"samples": self.table}, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_mode(cfg: WandbConfig) -> str:
    """`metrics.wandb.mode`, else $WANDB_MODE, else online with an API key and offline without."""
    return cfg.mode or os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def _plain(config: Any) -> dict[str, Any] | None:
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict))
    return str(prompt)


def _reward(sample: Sample, key: str | None) -> float | None:
    try:
        return None if sample.reward is None else float(sample.reward_value(key))
    except (ValueError, TypeError):
        return None


class RunLog:
    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        start_step: int = 0,
        console: bool = True,
        wandb: WandbConfig | None = None,
        config: Any = None,
    ) -> None:
        """`wandb` (`metrics.wandb`) adds a W&B sink when enabled and not mode `disabled`;
        `config` (the RunConfig) is recorded as the W&B run's config."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "a")
        from torch.utils.tensorboard import SummaryWriter  # imported late: it pulls in tensorboard

        self.tb = SummaryWriter(str(self.dir / "tb"))
        on = wandb is not None and wandb.enabled and wandb_mode(wandb) != "disabled"
        self.wandb = WandbSink(wandb, self.dir, config) if on else None
        self.console = Console(stderr=True) if console else None
        self.progress = Progress(
            TextColumn("[bold]RL"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=self.console,
            disable=not (console and self.console.is_terminal),
            transient=True,
        )
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
        if self.wandb is not None:
            self.wandb.log(step, metrics)
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
        return ", ".join(
            f"{label} {fmt.format(self.seen[key][0])} -> {fmt.format(self.seen[key][1])}"
            for key, label, fmt in CONSOLE_KEYS[:3]
            if key in self.seen
        )

    def log_samples(self, step: int, groups: list[list[Sample]], reward_key: str | None = None) -> None:
        """A few of the step's groups as rows of the W&B `samples` table (nothing without W&B)."""
        if self.wandb is not None:
            self.wandb.log_samples(step, groups, reward_key)

    def message(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        self.progress.stop()
        self.tb.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of `metrics.jsonl`; a resumed run's repeated steps keep the latest row."""
    rows: dict[int, dict[str, Any]] = {}
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.setdefault(row["step"], {}).update(row)
    return [rows[s] for s in sorted(rows)]
