"""Checkpoints a run resumes from: `run_dir/checkpoints/step_NNNNNNNN/` (`state.pt`, `meta.json`).

A checkpoint becomes visible only complete: it is written into a hidden temporary directory,
fsynced, and renamed into place (a rename is atomic), so a writer killed at any moment leaves
either the previous checkpoints or the new one, never half of one. Leftovers of killed
writers are hidden (dot-prefixed) and removed by the next save. A disk that fills during the
write is the same: the partial directory goes, the previous checkpoints stay, and the error
(`CheckpointError`) names the directory, what was written and the space left.

The state is whatever the training loop passes (trainer, RNG, step, rollout side); it is one
`torch.save` pickle, which only this run's own files are ever loaded from.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

SUBDIR = "checkpoints"
STATE, META = "state.pt", "meta.json"
_NAME = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written for want of space; the earlier ones are intact."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SUBDIR


def save(run_dir: str | Path, step: int, state: dict[str, Any], *, keep: int) -> Path:
    """Write `state` as the checkpoint of `step` (replacing one of the same step), then keep
    only the `keep` newest (0 = all). Returns the checkpoint's directory."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old = None
    try:
        with open(tmp / STATE, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / META, "w") as f:
            json.dump({"step": step, "saved_at": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # a step redone after a resume: os.replace cannot overwrite a directory
            old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException as exc:
        if old is not None and not final.exists():
            os.replace(old, final)  # put the replaced checkpoint back
        written = _size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        full = _disk_full(exc)
        if full is None:
            raise
        raise CheckpointError(_full_message(root, step, written, keep, full)) from exc
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep > 0:
        for _, stale in _complete(root)[:-keep]:
            _remove(stale)
    return final


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run, or None."""
    found = _complete(checkpoint_dir(run_dir))
    return found[-1][1] if found else None


def resolve(run_dir: str | Path, resume: str | None) -> Path | None:
    """`checkpoint.resume`: None (start fresh), `auto` (the newest, or fresh if none) or a path."""
    if resume is None:
        return None
    if resume == "auto":
        return latest(run_dir)
    path = Path(resume)
    if not (path / STATE).is_file():
        raise ValueError(
            f"checkpoint.resume: {resume!r} is not a checkpoint directory (no {STATE}); use 'auto' or a step_* directory"
        )
    return path


def load(path: str | Path) -> dict[str, Any]:
    """The state `save` wrote, on CPU."""
    return torch.load(Path(path) / STATE, map_location="cpu", weights_only=False)


def rng_state() -> dict[str, Any]:
    """Every RNG a training continuation draws from: python, numpy, torch (and CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- internals ------------------------------------------------------------------------------------


def _complete(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the visible checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _NAME.fullmatch(d.name)
        if m and (d / META).is_file() and (d / STATE).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def _disk_full(exc: BaseException | None) -> OSError | None:
    """The out-of-space error behind `exc`, if that is what it is: torch.save reports one as a
    RuntimeError of its own whose context is the OSError."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _full_message(root: Path, step: int, written: int, keep: int, exc: OSError) -> str:
    usage, mib = shutil.disk_usage(root), 1 << 20
    kept = latest(root.parent)
    return (
        f"checkpoint of step {step}: {exc.strerror} in {root} after writing {written / mib:.1f} MiB "
        f"(the partial write removed: {usage.free / mib:.1f} MiB free of {usage.total / mib:.1f} MiB there now). "
        + (f"The last complete checkpoint, {kept.name}, is intact: --resume auto continues from it. " if kept else "")
        + "Free space there or lower checkpoint.keep "
        + f"(now {keep}: while one is written, {keep + 1 if keep else 'all'} must fit)"
    )


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _remove(path: Path) -> None:
    """Hide first, then delete: a half-deleted checkpoint is never visible."""
    hidden = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    for d in root.iterdir():
        if d.name.startswith((".tmp-", ".old-", ".trash-")):
            shutil.rmtree(d, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
