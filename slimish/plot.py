"""`slimish plot RUN_DIR`: the run's curves from `metrics.jsonl` to `RUN_DIR/curves.png`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from slimish.metrics import read_metrics

DEFAULT_KEYS = (
    "reward/mean",
    "eval/accuracy",
    "eval/reward",
    "response/length",
    "train/kl",
    "train/entropy",
    "train/grad_norm",
    "train/mismatch",
    "train/mismatch_seq_max",
    "train/route_agreement",
    "train/expert_load_max",
    "time/step",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument(
        "--keys", nargs="*", default=None, help=f"metrics to draw (default: those of {DEFAULT_KEYS} present)"
    )
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")


def plot(run_dir: str | Path, keys: list[str] | None = None, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    present = {k for row in rows for k in row}
    keys = keys or [k for k in DEFAULT_KEYS if k in present]
    missing = [k for k in keys if k not in present]
    if missing or not keys:
        raise SystemExit(
            f"slimish plot: no metric {missing or 'to draw'} in {run_dir}/metrics.jsonl; present: {sorted(present)}"
        )
    cols = min(3, len(keys))
    fig, axes = plt.subplots(
        math.ceil(len(keys) / cols), cols, figsize=(4.5 * cols, 3 * math.ceil(len(keys) / cols)), squeeze=False
    )
    for ax, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out or Path(run_dir) / "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> int:
    print(plot(args.run_dir, args.keys, args.out))
    return 0
