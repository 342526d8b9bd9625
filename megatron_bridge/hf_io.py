"""Read and write HF checkpoint directories tensor by tensor (safetensors, single file or sharded).

Why not `from_pretrained`: a pipeline stage needs only its own layers. Reading lazily by name
means no rank builds the whole HF model, and the names are the checkpoint's own. Those are the
names engines load, for example the per-expert names of Qwen3-MoE, not transformers' fused
in-memory layout.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX = "model.safetensors.index.json"


@contextmanager
def hf_tensors(hf_dir: str | Path) -> Iterator[Callable[[str], torch.Tensor]]:
    """A getter `name -> tensor` over `hf_dir`'s safetensors, open for the duration of the block."""
    hf_dir = Path(hf_dir)
    if (hf_dir / INDEX).exists():
        weight_map: dict[str, str] = json.loads((hf_dir / INDEX).read_text())["weight_map"]
    elif (hf_dir / "model.safetensors").exists():
        with safe_open(hf_dir / "model.safetensors", "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise FileNotFoundError(f"{hf_dir}: no model.safetensors or {INDEX} (only safetensors checkpoints are read)")
    with ExitStack() as stack:
        files = {name: stack.enter_context(safe_open(hf_dir / name, "pt")) for name in sorted(set(weight_map.values()))}

        def get(name: str) -> torch.Tensor:
            if name not in weight_map:
                raise KeyError(f"{hf_dir}: checkpoint has no tensor {name!r}")
            return files[weight_map[name]].get_tensor(name)

        yield get


def copy_non_weights(src: str | Path, dst: str | Path) -> None:
    """Copy config, tokenizer and generation files (everything but the weights) from `src` to `dst`."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for path in Path(src).iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name != INDEX:
            shutil.copy2(path, dst / path.name)


def save_hf(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, config_dir: str | Path) -> Path:
    """Write `tensors` as `out_dir/model.safetensors`, next to the non-weight files of `config_dir`."""
    copy_non_weights(config_dir, out_dir)
    state = {name: t.contiguous() for name, t in tensors}
    save_file(state, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})
    return Path(out_dir)
