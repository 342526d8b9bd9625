"""The server's training runs (one per Tinker model id) and their checkpoints on disk.

`tinker://RUN/weights/NAME` (adapter, LoRA spec, optimizer state) and `tinker://RUN/sampler_weights/NAME`
(a PEFT adapter directory) are `ROOT/checkpoints/RUN/{weights,sampler_weights}/NAME/`; beside them,
`run.json` keeps what the REST client's `get_training_run` reports, so a later server finds it too.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slimish.tinker.futures import UserError

KINDS = ("weights", "sampler_weights")  # tinker://RUN/KIND/NAME (tinker 0.38.0: types/checkpoint.py:50-71)
RUN_FILE = "run.json"  # a run's base model, LoRA config and user metadata, beside its checkpoints


class Runs:
    """The training runs (one per model id) and where their checkpoints live."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "checkpoints"
        self.info: dict[str, dict[str, Any]] = {}

    def add(self, model_id: str, info: dict[str, Any]) -> None:
        self.info[model_id] = info
        (self.dir / model_id).mkdir(parents=True, exist_ok=True)
        (self.dir / model_id / RUN_FILE).write_text(json.dumps(info))

    def of(self, model_id: str) -> dict[str, Any]:
        if model_id not in self.info:
            raise UserError(f"model_id: {model_id!r} is not a model of this server (create_model first)")
        self.info[model_id]["last_request_time"] = datetime.now(UTC).isoformat()
        return self.info[model_id]

    def path(self, model_id: str, kind: str, name: str | None) -> tuple[str, Path]:
        """A new checkpoint's tinker:// path and directory; `name` is one path segment."""
        if not name or "/" in name or name in (".", ".."):
            raise UserError(f"path: {name!r} must be a checkpoint name (one path segment)")
        return f"tinker://{model_id}/{kind}/{name}", self.dir / model_id / kind / name

    def find(self, tinker_path: str, kind: str | None = None) -> tuple[str, Path]:
        """The run id and directory of an existing checkpoint `tinker://RUN/KIND/NAME`."""
        parts = tinker_path.removeprefix("tinker://").split("/")
        if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KINDS:
            raise UserError(
                f"path: {tinker_path!r} is not tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME"
            )
        if kind is not None and parts[1] != kind:
            raise UserError(f"path: {tinker_path!r} is a {parts[1]} checkpoint; this call takes {kind}")
        where = self.dir / parts[0] / parts[1] / parts[2]
        if ".." in parts or not where.is_dir():
            raise UserError(f"path: no checkpoint {tinker_path!r} on this server")
        return parts[0], where

    def saved_info(self, run_id: str) -> dict[str, Any]:
        return self.info.get(run_id) or json.loads((self.dir / run_id / RUN_FILE).read_text())

    def training_run(self, run_id: str) -> dict[str, Any]:
        """The REST client's `TrainingRun` (tinker 0.38.0: types/training_run.py); OSError if unknown."""
        info = self.saved_info(run_id)
        return {
            "training_run_id": run_id,
            "base_model": info["base_model"],
            "model_owner": "local",
            "is_lora": True,
            "lora_rank": info["lora"]["rank"],
            "last_request_time": info.get("last_request_time") or datetime.now(UTC).isoformat(),
            "user_metadata": {k: str(v) for k, v in (info["user_metadata"] or {}).items()},
        }
