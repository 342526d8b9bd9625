"""The shared weight store of a colocated run (`launch.colocate`, docs/colocate.md): the policy's
parameters in one flat file under /dev/shm, which the trainer and every engine map, each parameter
a view into it. There is one copy of the weights on the machine: the trainer's optimiser step
writes the very memory the engines read, so a push moves no bytes (slimish/trainer/colocated.py).

A store is a directory holding `weights.bin` (the bytes) and `layout.json`: for every parameter
name its dtype, shape and byte offset, and tied names (`lm_head.weight` when it is the embedding)
pointing at one entry. Both sides map the file with `torch.from_file(..., shared=True)`: pages of
a shared file mapping are the same physical pages in every process.

One store per run, named after the launcher's pid and removed when the run ends; a store whose
launcher died without removing it (SIGKILL) is removed by the next colocated run on the machine.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from slimish.distributed import dtype_name, parse_dtype

LAYOUT, DATA = "layout.json", "weights.bin"
PREFIX = "slimish-colocate-"
ALIGN = 64  # bytes: every view starts on a cache line
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def plan_layout(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The layout of `named` (a model's `named_parameters(remove_duplicate=False)`): one entry per
    distinct tensor, in order, each at an `ALIGN`ed offset; a name seen again for the same tensor
    is tied to the first one's entry. Reads shapes and dtypes only."""
    tensors: dict[str, dict[str, Any]] = {}
    tied: dict[str, str] = {}
    first: dict[int, str] = {}
    offset = 0
    for name, t in named:
        if id(t) in first:
            tied[name] = first[id(t)]
            continue
        first[id(t)] = name
        tensors[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset}
        offset += math.ceil(t.numel() * t.element_size() / ALIGN) * ALIGN
    return {"tensors": tensors, "tied": tied, "nbytes": offset}


def entry_bytes(entry: dict[str, Any]) -> int:
    return math.prod(entry["shape"]) * parse_dtype(entry["dtype"]).itemsize


class WeightStore:
    """A store mapped into this process: a view per parameter name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.layout = json.loads((self.path / LAYOUT).read_text())
        except FileNotFoundError:
            raise ValueError(f"{self.path}: not a shared weight store (no {LAYOUT})") from None
        self.nbytes = int(self.layout["nbytes"])
        self.data = torch.from_file(str(self.path / DATA), shared=True, size=self.nbytes, dtype=torch.uint8)

    def names(self) -> set[str]:
        return set(self.layout["tensors"]) | set(self.layout["tied"])

    def view(self, name: str) -> torch.Tensor:
        entry = self.layout["tensors"][self.layout["tied"].get(name, name)]
        start = entry["offset"]
        raw = self.data[start : start + entry_bytes(entry)]
        return raw.view(parse_dtype(entry["dtype"])).view(entry["shape"])

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory lies in this store (a view of it, not a copy)."""
        start = self.data.data_ptr()
        return t.device.type == "cpu" and start <= t.data_ptr() < start + self.nbytes

    def attach(self, model: torch.nn.Module, fill: bool, field: str) -> None:
        """Make every parameter of `model` its view in the store (`p.data = view`: the same
        Parameter, so an optimiser built over it writes the store). `fill`: the model's values are
        written in first (the trainer's); otherwise the store's are kept (an engine's, whose loaded
        copy is dropped). A parameter whose dtype or shape differs fails naming `field`."""
        params = dict(model.named_parameters(remove_duplicate=False))
        if set(params) != self.names():
            odd = sorted(set(params) ^ self.names())
            raise ValueError(f"{field}: the model and the shared weight store {self.path} differ in {odd[:5]}")
        with torch.no_grad():
            for name, p in params.items():
                view = self.view(name)
                if (p.dtype, p.shape) != (view.dtype, view.shape):
                    raise ValueError(
                        f"{field}: {name} is {dtype_name(p.dtype)} {list(p.shape)} here but {dtype_name(view.dtype)} "
                        f"{list(view.shape)} in the shared weight store {self.path}; both sides must hold the same"
                    )
                if p.data_ptr() == view.data_ptr():  # a tied name, attached already
                    continue
                if fill:
                    view.copy_(p)
                p.data = view


def create_store(named: Iterable[tuple[str, torch.Tensor]], root: Path = SHM) -> WeightStore:
    """A new store under `root` holding the values of `named` (`plan_layout`'s input)."""
    named = list(named)
    remove_stale(root)
    path = root / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    layout = plan_layout(named)
    with open(path / DATA, "wb") as f:
        f.truncate(layout["nbytes"])
    (path / LAYOUT).write_text(json.dumps(layout))
    store = WeightStore(path)
    with torch.no_grad():
        for name, t in named:
            if name in layout["tensors"]:
                store.view(name).copy_(t)
    return store


def share_parameters(named: dict[str, torch.Tensor], params: Iterable[torch.nn.Parameter]) -> WeightStore | None:
    """A new store holding `named`, tensors that are each a whole parameter among `params` (a LoRA
    adapter's export), and each such parameter made its view: the adapter of a colocated run
    (slimish/trainer/colocated.py). None, and nothing changed, when one is not a whole parameter
    (a copy or a slice, as a MoE adapter's per-expert tensors are)."""
    whole = {(p.data_ptr(), p.shape, p.dtype): p for p in params if p.is_contiguous()}
    owners = {name: whole.get((t.data_ptr(), t.shape, t.dtype)) for name, t in named.items()}
    if not owners or None in owners.values() or not all(t.is_contiguous() for t in named.values()):
        return None
    store = create_store(named.items())
    for name, p in owners.items():
        p.data = store.view(name)
    return store


def remove_stale(root: Path = SHM) -> None:
    """Remove the stores of launchers that are gone."""
    for path in root.glob(f"{PREFIX}*"):
        pid = path.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


@contextmanager
def shared_store(model_path: str | Path) -> Iterator[WeightStore]:
    """A colocated run's store, filled with the checkpoint at `model_path` in fp32 (the torch
    trainer's dtype), before any engine maps it; removed when the block ends. Mappings outlive the
    files: the memory goes when the last process unmaps it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    store = create_store(model.named_parameters(remove_duplicate=False))
    del model
    try:
        yield store
    finally:
        shutil.rmtree(store.path, ignore_errors=True)
