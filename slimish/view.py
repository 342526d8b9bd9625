"""`slimish view RUN_DIR`: a run in the browser, from what the trainer wrote as it ran.

The trainer (`train.Driver`) keeps a `ViewWriter`, which writes two JSONL files under `RUN_DIR/view/`:

- `samples.jsonl`, one line per sample of `metrics.view_groups` trained groups a step (evenly spaced
  over the batch): its step, group, index, trajectory, status, reward, weight versions, error,
  metadata, and the prompt and response as parallel per-token arrays (ids, decoded pieces; for the
  response also the loss mask, rollout logprob and the weight version of each token), so the page
  needs no tokenizer.
- `timeline.jsonl`, one line per step: its phases (`rollout`, `train`, `push`, `eval`,
  `checkpoint`) with wall-clock start and end, the version pushed at the step's end, the versions
  of the tokens the step trained on, and the engines' idle fraction (`rollout/engine_idle_fraction`:
  the share of the interval with no rollout sample in flight, all engines together).

`slimish view` reads them with `metrics.jsonl` and writes one self-contained HTML file (the data
embedded as JSON, plain JS and CSS from `view_page.py`, nothing fetched), and with `--serve`
serves it on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.server
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slimish.types import Sample

PHASES = ("rollout", "train", "push", "eval", "checkpoint")
# Columns of metrics.jsonl the page shows (the step list, the timeline's tooltips); eval/NAME/...
# keys of eval datasets and each policy's reward and mismatch (policy/NAME/..., docs/policies.md) too.
METRIC_KEYS = (
    "reward/mean",
    "eval/accuracy",
    "eval/reward",
    "response/length",
    "rollout/truncated_fraction",
    "rollout/engine_idle_fraction",
    "time/step",
    "time/rollout",
    "time/weight_push",
    "train/kl",
    "train/mismatch",
    "train/mismatch_seq_max",
    "train/route_agreement",
    "train/route_replayed",
    "train/expert_load_max",
)


def chosen_groups(groups: list[list[Sample]], n: int) -> list[list[Sample]]:
    """`n` of the batch's groups, evenly spaced (deterministic: the run's RNG is not touched)."""
    if n <= 0 or not groups:
        return []
    n = min(n, len(groups))
    return [groups[i * len(groups) // n] for i in range(n)]


def _finite(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def sample_record(step: int, sample: Sample, pieces: Any) -> dict[str, Any]:
    """One line of samples.jsonl; `pieces(ids)` decodes each id on its own."""
    prompt_ids, response_ids = sample.tokens[: sample.prompt_length], sample.response_ids
    versions = (
        sample.token_versions if len(sample.token_versions) == sample.response_length else [-1] * sample.response_length
    )
    return {
        "step": step,
        "group_id": sample.group_id,
        "index": sample.index,
        "trajectory_id": sample.trajectory_id,
        "status": sample.status.value,
        "reward": sample.reward,
        "weight_versions": list(sample.weight_versions),
        "exclude_from_loss": sample.exclude_from_loss,
        "error": sample.error,
        "metadata": sample.metadata,
        "prompt": {"ids": prompt_ids, "pieces": pieces(prompt_ids)},
        "response": {
            "ids": response_ids,
            "pieces": pieces(response_ids),
            "mask": list(sample.loss_mask),
            "logprobs": [_finite(x) for x in sample.rollout_logprobs],
            "versions": list(versions),
        },
    }


class ViewWriter:
    """What the trainer writes for `slimish view` as it runs (rank 0 only)."""

    def __init__(self, run_dir: str | Path, view_groups: int, tokenizer_path: str) -> None:
        self.dir = Path(run_dir) / "view"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.view_groups, self.tokenizer_path = view_groups, tokenizer_path
        self._tokenizer: Any = None  # its own copy, loaded on first use: the rollout thread uses the runtime's
        self.samples = open(self.dir / "samples.jsonl", "a")
        self.timeline = open(self.dir / "timeline.jsonl", "a")
        self.phases: list[dict[str, Any]] = []  # of the step being run
        self.trained_versions: list[int] = []
        self.pieces_of: dict[int, str] = {}  # id -> its piece: each id is decoded once
        self.first = True  # the next timeline line is this process's first: the push (and eval) before any step

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times one phase of the current step (wall clock)."""
        start = time.time()
        try:
            yield
        finally:
            self.phases.append({"name": name, "start": start, "end": time.time()})

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own (a piece of a multi-byte character shows as U+FFFD)."""
        new = sorted(set(ids) - self.pieces_of.keys())
        if new:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self.pieces_of.update(zip(new, self._tokenizer.batch_decode([[i] for i in new])))
        return [self.pieces_of[i] for i in ids]

    def write_samples(self, step: int, groups: list[list[Sample]]) -> None:
        self.trained_versions = sorted(set().union(*(s.trained_versions() for g in groups for s in g)))
        for group in chosen_groups(groups, self.view_groups):
            for sample in group:
                self.samples.write(json.dumps(sample_record(step, sample, self.pieces), default=str) + "\n")
        self.samples.flush()

    def end_step(self, step: int, metrics: dict[str, Any]) -> None:
        """The step's timeline line: its phases since the last one, its versions, the engines' idle share."""
        pushed = "time/weight_push" in metrics  # every step ends on a push: the engines serve `step` then
        row = {
            "step": step,
            "time": time.time(),
            "phases": self.phases,
            "version": step if pushed else None,
            "trained_versions": self.trained_versions,
            "engine_idle_fraction": metrics.get("rollout/engine_idle_fraction"),
            "first": self.first,
        }
        self.timeline.write(json.dumps(row) + "\n")
        self.timeline.flush()
        self.phases, self.trained_versions, self.first = [], [], False

    def close(self) -> None:
        self.samples.close()
        self.timeline.close()


# ---- reading a run and building the page --------------------------------------------------------


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut off by a killed run
    return rows


def read_run(run_dir: str | Path, sample_steps: int = 100) -> dict[str, Any]:
    """Everything the page shows. A resumed run's repeated steps keep the latest lines; samples
    of at most `sample_steps` steps (evenly spaced, the first and last included) are kept."""
    run_dir = Path(run_dir)
    metrics: dict[int, dict[str, Any]] = {}
    for row in _jsonl(run_dir / "metrics.jsonl"):
        keep = {
            k: v
            for k, v in row.items()
            if k in METRIC_KEYS
            or k.startswith("moe/")  # per MoE layer (routing.py route_metrics)
            or (k.startswith("eval/") and k.endswith(("/accuracy", "/reward")))
            or (k.startswith("policy/") and k.endswith(("/reward/mean", "/train/mismatch")))  # per policy
        }
        metrics.setdefault(row["step"], {"step": row["step"]}).update(keep)
    timeline: dict[int, dict[str, Any]] = {}
    for row in _jsonl(run_dir / "view" / "timeline.jsonl"):
        if row.get("first") and row["step"] in timeline:  # a resume's first push: after the step it resumed from
            timeline[row["step"]]["phases"] += row["phases"]
        else:
            timeline[row["step"]] = row
    samples: dict[tuple, dict[str, Any]] = {}
    for row in _jsonl(run_dir / "view" / "samples.jsonl"):
        samples[(row["step"], row["group_id"], row["index"], row.get("trajectory_id"))] = row
    steps = sorted({k[0] for k in samples})
    if len(steps) > sample_steps > 0:
        steps = (
            sorted({steps[round(i * (len(steps) - 1) / (sample_steps - 1))] for i in range(sample_steps)})
            if sample_steps > 1
            else steps[-1:]
        )
    kept = set(steps)
    return {
        "run_dir": str(run_dir),
        "metrics": [metrics[s] for s in sorted(metrics)],
        "timeline": [timeline[s] for s in sorted(timeline)],
        "samples": [
            r for k, r in sorted(samples.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])) if k[0] in kept
        ],
        "sample_steps_total": len({k[0] for k in samples}),
    }


def _json_safe(x: Any) -> Any:
    """NaN and infinities as null: the browser's JSON.parse takes no NaN."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def page_html(data: dict[str, Any]) -> str:
    """The page: data as JSON inside a script tag (every `<` written `\\u003c`: no string can end the tag)."""
    from slimish.view_page import PAGE

    blob = json.dumps(_json_safe(data), separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    return PAGE.replace("__TITLE__", data["run_dir"].replace("&", "&amp;").replace("<", "&lt;")).replace(
        "__DATA__", blob
    )


def build(run_dir: str | Path, out: str | Path | None = None, sample_steps: int = 100) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "view").exists():
        raise SystemExit(f"slimish view: {run_dir} has no metrics.jsonl and no view/: not a run directory")
    out = Path(out or run_dir / "view.html")
    out.write_text(page_html(read_run(run_dir, sample_steps)))
    return out


def serve(page: Path, port: int = 0) -> http.server.ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 answering every GET with the page (started by the caller)."""
    body = page.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--out", default=None, help="HTML path (default: RUN_DIR/view.html)")
    parser.add_argument(
        "--sample-steps",
        type=int,
        default=100,
        help="embed the samples of at most this many steps, evenly spaced (0: all)",
    )
    parser.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1 until interrupted")
    parser.add_argument("--port", type=int, default=0, help="with --serve (default: a free port)")


def run(args: argparse.Namespace) -> int:
    out = build(args.run_dir, args.out, args.sample_steps)
    print(out, flush=True)
    if args.serve:
        server = serve(out, args.port)
        print(f"serving {out} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    return 0
