"""`slimish convert`: HF checkpoint <-> per-rank Megatron-Core shards, in one process.

Why one process: the sharding math (weights.py) is pure, so no torch.distributed and no Megatron
import are needed, and a conversion runs in seconds anywhere.

Shard directory format (version 1):

    OUT_DIR/manifest.json        {"format": "slimish-megatron-shards", "version": 1, "tp": T, "pp": P,
                                  "make_vocab_size_divisible_by": D, "vocab_size": V, "padded_vocab_size": V_pad,
                                  "shards": {"tp0_pp0": "tp0_pp0.pt", ...}}
    OUT_DIR/hf/                  the HF directory minus its weights (config.json, tokenizer, generation config)
    OUT_DIR/tp{t}_pp{p}.pt       torch.save of the GPTModel state_dict of TP rank t, PP stage p: exactly the keys
                                 `GPTModel(...).load_state_dict(strict=True)` wants on that rank, in the
                                 checkpoint's dtype

`megatron-to-hf` merges the shards back into `model.safetensors` plus the files of `hf/`.
Converting HF -> shards -> HF gives back the original tensors bit for bit.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_bridge.config import BridgeConfig, load_hf_config
from megatron_bridge.hf_io import copy_non_weights, hf_tensors, save_hf
from megatron_bridge.weights import hf_to_megatron, megatron_to_hf

FORMAT, VERSION = "slimish-megatron-shards", 1


def _shard_name(tp_rank: int, pp_rank: int) -> str:
    return f"tp{tp_rank}_pp{pp_rank}"


def hf_to_shards(
    hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, make_vocab_size_divisible_by: int = 128
) -> Path:
    """Write `hf_dir` as TP x PP Megatron shards in `out_dir` (format in the module docstring)."""
    cfg = load_hf_config(hf_dir, make_vocab_size_divisible_by)
    cfg.check_parallel(tp, pp)
    out = Path(out_dir)
    copy_non_weights(hf_dir, out / "hf")
    shards = {}
    with hf_tensors(hf_dir) as get:
        for p in range(pp):
            for t in range(tp):
                name = _shard_name(t, p)
                torch.save(hf_to_megatron(get, cfg, t, tp, p, pp), out / f"{name}.pt")
                shards[name] = f"{name}.pt"
    manifest = dict(
        format=FORMAT,
        version=VERSION,
        tp=tp,
        pp=pp,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=cfg.padded_vocab_size(tp),
        shards=shards,
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def _read_manifest(in_dir: Path) -> dict:
    path = in_dir / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: IN_DIR must be written by `slimish convert hf-to-megatron`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        got = f"{manifest.get('format')!r}/{manifest.get('version')!r}"
        raise ValueError(f"{path}: format/version must be {FORMAT!r}/{VERSION}, got {got}")
    return manifest


def _stage_tensors(in_dir: Path, manifest: dict, cfg: BridgeConfig) -> Iterator[tuple[str, torch.Tensor]]:
    tp, pp = manifest["tp"], manifest["pp"]
    for p in range(pp):
        ranks = [
            torch.load(in_dir / manifest["shards"][_shard_name(t, p)], map_location="cpu", weights_only=True, mmap=True)
            for t in range(tp)
        ]
        yield from megatron_to_hf(lambda key: [r[key] for r in ranks], cfg, p, pp)


def shards_to_hf(in_dir: str | Path, out_dir: str | Path) -> Path:
    """Merge the shards of `in_dir` (written by `hf_to_shards`) into an HF directory `out_dir`."""
    in_dir = Path(in_dir)
    manifest = _read_manifest(in_dir)
    cfg = load_hf_config(in_dir / "hf", manifest["make_vocab_size_divisible_by"])
    return save_hf(_stage_tensors(in_dir, manifest, cfg), out_dir, in_dir / "hf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-megatron", help="HF safetensors -> per-rank Megatron shards")
    to_mcore.add_argument("hf_dir")
    to_mcore.add_argument("out_dir")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    to_mcore.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    to_hf = sub.add_parser("megatron-to-hf", help="shards written by hf-to-megatron -> HF safetensors")
    to_hf.add_argument("in_dir")
    to_hf.add_argument("out_dir")


def run(args: argparse.Namespace) -> int:
    if args.direction == "hf-to-megatron":
        out = hf_to_shards(args.hf_dir, args.out_dir, args.tp, args.pp, args.make_vocab_size_divisible_by)
    else:
        out = shards_to_hf(args.in_dir, args.out_dir)
    print(f"{args.direction}: wrote {out}")
    return 0
