"""Prompt datasets: a JSONL or Parquet file, a local `datasets` directory, a built-in `task:NAME`,
or a function `module:function` (`def fn(cfg: DataConfig, split: str) -> Iterable[dict]`: its
rows are read as a JSONL file's; called once per split, the list it yields is the dataset, so it
must yield the same rows every time for a resumed run to continue where it stopped).

Every row becomes `{"prompt", "label", "metadata"}`: the prompt is text, or chat messages when
`apply_chat_template` is on (a text prompt becomes one user message, after `system_prompt`);
the rollout renders messages with the tokenizer's chat template. `metadata` holds the row's other
columns, its `row_id` (position in the source) and, for built-in tasks, `task` (the verifier).

`PromptData` hands out rows forever, epoch after epoch, each epoch in its own order (shuffled with
`seed + epoch`), so the stream is a pure function of (config, cursor): `state_dict()` is the
cursor, and a resumed run continues with exactly the rows it would have taken.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from slimish.plugins import load_function
from slimish.rollout.config import DataConfig

TASK_PREFIX = "task:"


def is_function_source(source: str) -> bool:
    """A `module:function` (or `path/to/file.py:function`) source: it has a ':', is not
    `task:NAME` and names no existing file or directory."""
    return ":" in source and not source.startswith(TASK_PREFIX) and not Path(source).expanduser().exists()


def load_rows(source: str, cfg: DataConfig, split: str = "train", flag: str | None = None) -> list[dict[str, Any]]:
    """All rows of `source`, normalised; `split` picks a built-in task's split, a DatasetDict's,
    or is passed to a function source. `flag` names the config value in a function source's
    messages (default: eval.source for the test split, else data.source)."""
    if source.startswith(TASK_PREFIX):
        from slimish.rollout.tasks import get_task

        name = source[len(TASK_PREFIX) :]
        raw = get_task(name).make(split, cfg.task_size, cfg.seed)
        return [_row(r, i, f"data source {source}", "prompt", "label", cfg) for i, r in enumerate(raw)]
    if is_function_source(source):
        flag = flag or ("eval.source" if split == "test" else "data.source")
        where = f"{flag} {source!r}"
        raw = _call(source, cfg, split, flag, where)
    else:
        where = f"data source {source}"
        raw = _read(source, split)
    if not raw:
        raise ValueError(f"{where}: no rows")
    return [_row(r, i, where, cfg.prompt_key, cfg.label_key, cfg) for i, r in enumerate(raw)]


def _call(source: str, cfg: DataConfig, split: str, flag: str, where: str) -> list[Any]:
    """The rows a function source yields for `split`, loaded (and its signature checked) now;
    each must be what a JSONL line holds (a JSON object), since rows are saved and logged."""
    out = load_function(source, "data", flag)(cfg, split)
    if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Iterable):
        raise ValueError(
            f"{where}: returned a {type(out).__name__}; it must return (or yield) rows, an iterable of dicts "
            "as a JSONL file's lines hold"
        )
    rows = list(out)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: row {i} is a {type(row).__name__}, expected a dict")
        try:
            json.dumps(row)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{where}: row {i} is not a JSON value (rows are saved and logged as JSON): {exc}"
            ) from None
    return rows


def _read(source: str, split: str) -> list[dict[str, Any]]:
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(
            f"data source {source}: no such file or directory (expected a .jsonl / .parquet file, a local `datasets` directory, "
            "task:NAME, or module:function)"
        )
    if path.is_dir():
        return _read_datasets_dir(path, split)
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise ValueError(f"data source {source}: line {n} is not JSON ({exc})") from None
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(
        f"data source {source}: unknown file type {path.suffix!r}; use .jsonl, .parquet, a `datasets` directory or task:NAME"
    )


def _read_datasets_dir(path: Path, split: str) -> list[dict[str, Any]]:
    """A `save_to_disk` directory, or a directory of data files `load_dataset` understands."""
    import datasets

    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(str(path))
    else:
        ds = datasets.load_dataset(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            if len(ds) != 1:
                raise ValueError(f"data source {path}: no split {split!r} (splits: {', '.join(ds)})")
            split = next(iter(ds))
        ds = ds[split]
    return ds.to_list()


def _row(
    raw: dict[str, Any], i: int, where: str, prompt_key: str, label_key: str | None, cfg: DataConfig
) -> dict[str, Any]:
    """One row normalised; `where` names its source in messages."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: row {i} is a {type(raw).__name__}, expected an object")
    if prompt_key not in raw:
        raise ValueError(f"{where}: row {i} has no {prompt_key!r} (keys: {', '.join(raw)}); set data.prompt_key")
    if label_key is not None and label_key not in raw:
        raise ValueError(
            f"{where}: row {i} has no {label_key!r} (keys: {', '.join(raw)}); set data.label_key (null for none)"
        )
    prompt = _prompt(raw[prompt_key], f"{where}: row {i} {prompt_key!r}", cfg)
    metadata = {k: v for k, v in raw.items() if k not in (prompt_key, label_key)}
    metadata["row_id"] = i
    return {"prompt": prompt, "label": raw[label_key] if label_key is not None else None, "metadata": metadata}


def _prompt(value: Any, where: str, cfg: DataConfig) -> str | list[dict[str, Any]]:
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt is not None else []
    if isinstance(value, str):
        return [*system, {"role": "user", "content": value}] if cfg.apply_chat_template else value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        messages = [dict(m) for m in value]
        return messages if messages[0]["role"] == "system" else [*system, *messages]
    raise ValueError(
        f"{where}: expected text or a non-empty list of chat messages with roles, got {type(value).__name__}"
    )


class PromptData:
    """The training prompt stream: endless epochs, each in its own seeded order."""

    def __init__(self, cfg: DataConfig, rows: list[dict[str, Any]] | None = None) -> None:
        self.cfg = cfg
        self.rows = rows if rows is not None else load_rows(cfg.source, cfg, "train")
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.cfg.shuffle:
            random.Random(self.cfg.seed + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> "PromptData":
        return self

    def __next__(self) -> dict[str, Any]:
        if self.position == len(self.rows):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        row = self.rows[self._order[self.position]]
        self.position += 1
        return {"prompt": row["prompt"], "label": row["label"], "metadata": {**row["metadata"], "epoch": self.epoch}}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "size": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != len(self.rows):
            raise ValueError(
                f"data cursor was saved for {state['size']} rows but the source now has {len(self.rows)}; "
                "resume with the same data.source and data.task_size"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)
