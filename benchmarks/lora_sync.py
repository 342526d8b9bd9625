"""Adapter-only weight push (trainer.lora) against a full push of the same model, in one run.

The `small` model (llama, ~30M parameters, fp32) under a rank-8 PEFT adapter on q/k/v/o
(`trainer.lora` defaults but the rank) is pushed into one real built-in engine started with
`--enable-lora`, two ways, by the same `WeightSync` code the trainer runs: the full push
(every base parameter, `/update_weights_from_distributed`) and the adapter push (an adapter `WeightExport`:
the adapter's tensors alone, `lora_name` set; its first push also saves and loads the adapter
directory, and is the warm-up; an adapter always travels as one flattened buffer, the full push
as `weight_sync.flattened` says: per tensor by default, flattened with `--flattened`). Rounds
alternate full and adapter after one warm-up of each; medians are printed, then the adapter's
share of the full push's bytes and seconds. Target: bytes <= 2% of the full push's.

    .venv/bin/python benchmarks/lora_sync.py               # ~1 min
    .venv/bin/python benchmarks/lora_sync.py --rounds 2    # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from weight_sync import small_model  # noqa: E402

from slimish.launch.config import LaunchConfig  # noqa: E402
from slimish.launch.local import engine_process, router_process  # noqa: E402
from slimish.processes import start_all  # noqa: E402
from slimish.trainer.backend import WeightExport  # noqa: E402
from slimish.trainer.config import LoraConfig, WeightSyncConfig  # noqa: E402
from slimish.trainer.lora import adapter_config, adapter_tensors, add_adapter  # noqa: E402
from slimish.trainer.weight_sync import WeightSync  # noqa: E402

TARGET = 0.02
ADAPTER = "bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each push (after a warm-up)")
    parser.add_argument("--flattened", action="store_true", help="weight_sync.flattened for the full push too")
    parser.add_argument("--model-cache", type=Path, default=Path("runs/bench-models"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model_dir = small_model(args.model_cache)
    lora = LoraConfig(enabled=True, rank=args.rank, name=ADAPTER)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    full = [(name, p.detach()) for name, p in base.named_parameters()]  # before the adapter wraps the layers
    model = add_adapter(base, lora)
    with torch.no_grad():  # B starts at 0: give the adapter real values, as after training
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)
    tensors, config = adapter_tensors(model), adapter_config(model)
    logs = args.model_cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engine = engine_process(
        model_dir,
        log_path=logs / "lora-engine.log",
        enable_lora=True,
        max_lora_rank=args.rank,
        lora_target_modules=list(lora.target_modules),
    )
    router = None
    try:
        start_all([engine], 300)
        router = router_process(LaunchConfig(), [engine.url], logs).start(60)
        cfg = WeightSyncConfig(timeout_s=600, flattened=args.flattened)
        with (
            WeightSync(cfg, [engine.url]) as full_sync,
            WeightSync(cfg, [engine.url], adapter=ADAPTER, router_url=router.url) as lora_sync,
        ):
            fulls, adapters = [], []
            for r in range(args.rounds + 1):  # round 0 is the warm-up (and the adapter's load)
                fulls.append(full_sync.push(WeightExport(full), r))
                adapters.append(lora_sync.push(WeightExport(tensors.items(), config), r))
    finally:
        for proc in (router, engine):
            if proc is not None:
                proc.stop()
    fulls, adapters = fulls[1:], adapters[1:]
    rows = []
    for name, pushes in (("full", fulls), (f"adapter r={args.rank}", adapters)):
        rows.append(
            (
                name,
                pushes[0]["bytes"],
                statistics.median(p["seconds"] for p in pushes),
                statistics.median(p["seconds_transfer"] for p in pushes),
            )
        )
    print(
        f"\n{sum(t.numel() for _, t in full) / 1e6:.1f}M base parameters, {sum(t.numel() for t in tensors.values()) / 1e6:.3f}M "
        f"adapter parameters ({len(tensors)} tensors), fp32, 1 engine, full push {'flattened' if args.flattened else 'per tensor'}, "
        f"medians of {args.rounds} rounds\n"
    )
    print("| push | MB | push s | buckets s |")
    print("|---|---|---|---|")
    for name, nbytes, whole, transfer in rows:
        print(f"| {name} | {nbytes / 1e6:.2f} | {whole:.3f} | {transfer:.3f} |")
    (_, full_bytes, full_s, _), (_, lora_bytes, lora_s, _) = rows
    print(f"\nadapter / full: bytes {lora_bytes / full_bytes:.4f} (target <= {TARGET}), seconds {lora_s / full_s:.3f}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if lora_bytes / full_bytes > TARGET:
        raise SystemExit(f"adapter push is {lora_bytes / full_bytes:.2%} of the full push's bytes, above {TARGET:.0%}")


if __name__ == "__main__":
    main()
