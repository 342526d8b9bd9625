"""The W&B sink (`metrics.wandb`): real wandb in offline mode, no network. The offline run's
transaction log (`run-ID.wandb`) is read back and its history compared with `metrics.jsonl`:
the same keys at the same steps."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slimish.metrics import RunLog, WandbConfig, read_metrics, wandb_mode
from slimish.types import Sample, SampleStatus

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK, HEADER = 32768, 7  # the .wandb file: a 7-byte header, then LevelDB's log format in 32 KiB blocks
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """Every protobuf `Record` of a `.wandb` transaction log (wandb 0.31 ships no Python reader:
    its writer is wandb-core; the format is LevelDB's log: per chunk crc32c, length, type)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    i, parts = HEADER, b""
    while i + HEADER <= len(data):
        if BLOCK - i % BLOCK < HEADER:  # too little left in the block for a chunk header: padding
            i += BLOCK - i % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[i : i + HEADER])
        if i + HEADER + length > len(data):  # a chunk still being written
            break
        chunk, i = data[i + HEADER : i + HEADER + length], i + HEADER + length
        if kind in (FULL, FIRST):
            parts = chunk
        elif kind in (MIDDLE, LAST):
            parts += chunk
        if kind in (FULL, LAST):
            record = wandb_pb.Record()
            record.ParseFromString(parts)
            yield record


def wandb_history(wandb_dir: Path) -> dict[int, dict[str, object]]:
    """{step: {key: value}} of the one offline run under `wandb_dir`; W&B's own keys (`_step`,
    `_runtime`, `_timestamp`) left out, a nested key (a table's fields) under its first part."""
    (log_file,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while True:  # `run.finish()` may return before wandb-core has written the log: wait for its last record
        records = list(wandb_records(log_file))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{log_file} has no exit record after 60 s"
        time.sleep(0.1)
    rows: dict[int, dict[str, object]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        items: dict[str, object] = {}
        for item in record.history.item:  # wandb-core writes `nested_key`: [key], or [key, field] for a table's fields
            path = [item.key] if item.key else list(item.nested_key)
            items[path[0]] = json.loads(item.value_json) if len(path) == 1 else "nested"
        row = rows.setdefault(int(items["_step"]), {})
        row.update({key: value for key, value in items.items() if not key.startswith("_")})
    return rows


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """wandb kept offline and inside tmp_path: its run, config and cache directories."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
        (tmp_path / "wandb-home" / var.lower()).mkdir(parents=True)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "wandb-home" / "wandb_dir"


def test_mode_offline_without_a_key_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode(WandbConfig()) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(WandbConfig()) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode(WandbConfig()) == "offline"
    assert wandb_mode(WandbConfig(mode="disabled")) == "disabled"


def test_disabled_never_imports_wandb(tmp_path: Path) -> None:
    code = (
        "import sys; from slimish.metrics import RunLog, WandbConfig\n"
        f"for cfg in (None, WandbConfig(), WandbConfig(enabled=True, mode='disabled')):\n"
        f"    log = RunLog({str(tmp_path)!r}, 2, console=False, wandb=cfg); log.log(1, {{'a': 1.0}}); log.close()\n"
        "assert 'wandb' not in sys.modules, 'wandb imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert not (tmp_path / "wandb").exists()


def test_run_log_writes_the_same_keys_at_the_same_steps(tmp_path: Path, offline_wandb: Path) -> None:
    run_dir = tmp_path / "run"
    log = RunLog(
        run_dir, 3, console=False, wandb=WandbConfig(enabled=True, project="t", sample_groups=1), config={"lr": 0.1}
    )
    log.log(0, {"eval/accuracy": 0.1})
    for step in (1, 2, 3):
        group = [
            Sample(
                prompt=[{"role": "user", "content": f"q{step}"}],
                response=f"a{step}.{i}",
                reward=float(i),
                status=SampleStatus.COMPLETED,
                group_id=step,
                index=i,
            )
            for i in range(2)
        ]
        log.log_samples(step, [group, group])  # before the step's metrics, as the training loop does
        log.log(step, {"reward/mean": step / 4, "time/step": 1.5, "response/length": 7, "note": "x"})
    log.log(3, {"eval/accuracy": 0.9})  # a second row for one step merges into it, in both
    log.close()

    jsonl = {row.pop("step"): row for row in read_metrics(run_dir)}
    for row in jsonl.values():
        row.pop("time")
    history = wandb_history(offline_wandb)
    assert sorted(history) == sorted(jsonl) == [0, 1, 2, 3]
    for step, row in jsonl.items():
        assert history[step].pop("samples", None) == ("nested" if step else None)  # the table, steps 1-3
        assert history[step] == row, step  # the same keys and values
    tables = sorted(offline_wandb.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
    rows = [r for t in tables for r in json.loads(t.read_text())["data"]]  # incremental: each holds its step's rows
    assert sorted(rows) == [
        [s, s, i, f"user: q{s}", f"a{s}.{i}", float(i), "completed"] for s in (1, 2, 3) for i in (0, 1)
    ]
    assert (run_dir / "wandb_run_id").read_text().strip() in tables[0].parts[-5]


@pytest.mark.slow
def test_train_logs_to_wandb_offline(tiny_model_dir: Path, tmp_path: Path, offline_wandb: Path) -> None:
    """A short `slimish train` with metrics.wandb.enabled: W&B's history has metrics.jsonl's keys at each step."""
    data, run_dir = tmp_path / "prompts.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(8)))
    argv = [
        sys.executable,
        "-m",
        "slimish.train",
        f"model={tiny_model_dir}",
        f"run_dir={run_dir}",
        f"data.source={data}",
        "steps=2",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=6",
        "rollout.filter_fn=null",
        "eval.every=0",
        "metrics.wandb.enabled=true",
        "metrics.wandb.project=test",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    jsonl = {row["step"]: set(row) - {"step", "time"} for row in read_metrics(run_dir)}
    history = {step: set(row) - {"samples"} for step, row in wandb_history(offline_wandb).items()}
    assert history == jsonl and sorted(jsonl) == [0, 1, 2]
    assert "reward/mean" in history[2] and "time/step" in history[2]
    tables = list(offline_wandb.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 2 and all(json.loads(t.read_text())["data"] for t in tables)
