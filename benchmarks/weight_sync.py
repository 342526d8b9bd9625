"""Weight push bandwidth: `WeightSync` into real engines vs a raw gloo broadcast of the same bytes.

Two parameter sets: the `small` model (llama, ~30M parameters, fp32) and a synthetic llama of
~500M parameters in bf16 (1 GB; bf16 on both sides halves the memory, the engines load it with
`--dtype bfloat16`). Both go into real built-in engine processes, 1 and 2 of them. The baseline
is, in the same run and with the same group size (1 + engines), a raw `torch.distributed`
broadcast of exactly the same buckets (the same tensors, the same split, per-tensor broadcasts
or one flattened buffer per bucket) from this process to plain receiver processes that only
receive into preallocated buffers: no HTTP, no pause, no session, no load into a model.

Rounds alternate push and raw, after one warm-up of each (the engines allocate their receive
buffers on the first push), so drifting load hits both alike; medians are printed. Ratios are
raw time / push time (= push bandwidth / raw bandwidth): `whole` for the whole push (pause,
begin, buckets, end, continue), `buckets` for the bucket loop alone. Target: whole >= 0.9x.

The colocated side (`launch.colocate`, `--colocated`): the same set in a shared weight store
(slimish/colocate.py) that engines started with `--shared-weights` map, pushed by `ColocatedSync`
(KV release, then version flip and cache flush; no bytes). Its median push time is set against
the default-format broadcast push of the same engines count measured just before. Target: under
5% of it.

    .venv/bin/python benchmarks/weight_sync.py                          # both sets, 1 and 2 engines (~5-8 min)
    .venv/bin/python benchmarks/weight_sync.py --sets small --engines 1 --rounds 2   # smoke run

Models are built once into `runs/bench-models/` (`--model-cache`). All processes share this
machine's cores; bandwidth is per engine (each engine receives the full set).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from slimish.colocate import create_store  # noqa: E402
from slimish.distributed import (  # noqa: E402
    destroy_custom_process_group,
    init_custom_process_group,
    master_store,
)
from slimish.launch.local import engine_process  # noqa: E402
from slimish.processes import start_all  # noqa: E402
from slimish.tiny_model import make_tiny_model  # noqa: E402
from slimish.trainer.backend import WeightExport  # noqa: E402
from slimish.trainer.colocated import ColocatedSync  # noqa: E402
from slimish.trainer.config import WeightSyncConfig  # noqa: E402
from slimish.trainer.weight_sync import WeightSync, plan_buckets  # noqa: E402

TARGET = 0.9
COLOCATED_TARGET = 0.05
TIMEOUT = timedelta(minutes=30)
CTX = mp.get_context("spawn")
# ~504M parameters: 31 x 15.7M per layer + two 8192 x 1024 embeddings.
SYNTHETIC = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=31, num_attention_heads=16, num_key_value_heads=8
)


def small_model(cache: Path) -> Path:
    path = cache / "llama-small-seed0"
    if not any(path.glob("*.safetensors")):
        make_tiny_model(path, arch="llama", size="small", seed=0)
    return path


def synthetic_model(cache: Path) -> Path:
    """The small model's tokenizer with a ~500M-parameter random llama body, saved in bf16."""
    path = cache / "llama-500m-bf16"
    if any(path.glob("*.safetensors")):
        return path
    from transformers import AutoConfig, AutoModelForCausalLM

    small = small_model(cache)
    config = AutoConfig.from_pretrained(small)
    for key, value in SYNTHETIC.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in small.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, tmp / f.name)
    tmp.rename(path)
    return path


# -- the raw baseline ----------------------------------------------------------------------------


def raw_receiver(
    rank: int, world: int, port: int, layout: list[list[tuple[list[int], torch.dtype]]], rounds: int
) -> None:
    """Receive `rounds` pushes of `layout` (per bucket: the payload tensors' shapes and dtypes)."""
    torch.set_num_threads(1)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world, rank, "raw", TIMEOUT)
    buffers = [[torch.empty(shape, dtype=dtype) for shape, dtype in bucket] for bucket in layout]
    for _ in range(rounds):
        for bucket in buffers:
            for work in [dist.broadcast(b, src=0, group=group, async_op=True) for b in bucket]:
                work.wait()
    destroy_custom_process_group(group)


class RawBroadcast:
    """This process as rank 0 of a plain gloo group with `engines` receiver processes."""

    def __init__(self, payloads: list[list[torch.Tensor]], engines: int, rounds: int) -> None:
        self.payloads = payloads
        layout = [[(list(t.shape), t.dtype) for t in bucket] for bucket in payloads]
        world = 1 + engines
        store = master_store("127.0.0.1", world, TIMEOUT)  # listening already: the receivers are told its port
        self.procs = [
            CTX.Process(target=raw_receiver, args=(r, world, store.port, layout, rounds), daemon=True)
            for r in range(1, world)
        ]
        for p in self.procs:
            p.start()
        self.group = init_custom_process_group("gloo", store, world, 0, "raw", TIMEOUT)

    def push(self) -> float:
        started = time.perf_counter()
        for bucket in self.payloads:
            for work in [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in bucket]:
                work.wait()
        return time.perf_counter() - started

    def close(self) -> None:
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        destroy_custom_process_group(self.group)


def raw_payloads(named: list[tuple[str, torch.Tensor]], cfg: WeightSyncConfig) -> list[list[torch.Tensor]]:
    """What WeightSync broadcasts, bucket by bucket, prepared ahead (no packing in the timing)."""
    out = []
    for bucket in plan_buckets(named, cfg.bucket_mb, None, cfg.flattened):
        tensors = [t.contiguous() for t in bucket.tensors]
        out.append([torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])] if cfg.flattened else tensors)
    return out


# -- one configuration ---------------------------------------------------------------------------


def measure(
    named: list[tuple[str, torch.Tensor]], urls: list[str], cfg: WeightSyncConfig, rounds: int
) -> dict[str, float]:
    sync = WeightSync(cfg, urls)
    raw = RawBroadcast(raw_payloads(named, cfg), len(urls), rounds + 1)
    try:
        sync.connect()
        pushes, raws = [], []
        for r in range(rounds + 1):  # round 0 is the warm-up
            pushes.append(sync.push(WeightExport(named), r))
            raws.append(raw.push())
        pushes, raws = pushes[1:], raws[1:]
    finally:
        sync.close()
        raw.close()
    nbytes = pushes[0]["bytes"]
    whole = statistics.median(p["seconds"] for p in pushes)
    buckets = statistics.median(p["seconds_transfer"] for p in pushes)
    base = statistics.median(raws)
    return {"bytes": nbytes, "buckets_n": pushes[0]["buckets"], "whole": whole, "buckets": buckets, "raw": base}


def measure_colocated(model_dir: Path, dtype: str, engines: int, rounds: int, logs: Path) -> dict[str, float]:
    """Colocated pushes into `engines` engines mapping one store of `model_dir` in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    store = create_store(model.named_parameters(remove_duplicate=False))
    store.attach(model, fill=False, field="model")  # the model's parameters are the store's views from here on
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, store.path, True)
        procs = [
            engine_process(
                model_dir,
                log_path=logs / f"coloc{i}.log",
                dtype=dtype,
                shared_weights=store.path,
                cpu_packed_linear=False,
            )
            for i in range(engines)
        ]
        for p in procs:
            stack.callback(p.stop)
        start_all(procs, 600)
        sync = ColocatedSync(store, WeightSync(WeightSyncConfig(timeout_s=600), [p.url for p in procs]))
        stack.callback(sync.close)
        sync.connect()
        pushes = []
        for r in range(rounds + 1):  # round 0 is the warm-up
            sync.release()  # as a training step does
            pushes.append(sync.push(WeightExport(model.named_parameters()), r))
    return {"bytes": pushes[1]["bytes"], "whole": statistics.median(p["seconds"] for p in pushes[1:])}


def report_row(name: str, engines: int, fmt: str, m: dict[str, float]) -> str:
    gb = m["bytes"] / 1e9
    return (
        f"| {name} | {engines} | {fmt} | {gb:.3f} | {int(m['buckets_n'])} | {m['whole']:.3f} | {m['buckets']:.3f} | "
        f"{m['raw']:.3f} | {gb / m['whole']:.2f} | {gb / m['raw']:.2f} | {m['raw'] / m['whole']:.2f}x | "
        f"{m['raw'] / m['buckets']:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="small,500m", help="comma-separated: small, 500m")
    parser.add_argument("--engines", default="1,2", help="comma-separated engine counts")
    parser.add_argument("--formats", default="default,flattened", help="comma-separated: default, flattened")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration (after a warm-up)")
    parser.add_argument("--bucket-mb", type=float, default=WeightSyncConfig.bucket_mb)
    parser.add_argument("--model-cache", type=Path, default=Path("runs/bench-models"))
    parser.add_argument("--colocated", default="500m", help="comma-separated sets also pushed colocated ('' for none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    builders = {"small": (small_model, "float32"), "500m": (synthetic_model, "bfloat16")}
    rows, colocated = [], []
    for name in args.sets.split(","):
        build, dtype = builders[name]
        model_dir = build(args.model_cache)
        named = []
        for f in sorted(model_dir.glob("*.safetensors")):
            named += list(load_file(f).items())
        print(
            f"{name}: {sum(t.numel() for _, t in named) / 1e6:.0f}M parameters in {dtype} from {model_dir}", flush=True
        )
        for n in (int(x) for x in args.engines.split(",")):
            with ExitStack() as stack:
                logs = args.model_cache / "logs"
                logs.mkdir(parents=True, exist_ok=True)
                procs = [
                    engine_process(model_dir, log_path=logs / f"engine{i}.log", dtype=dtype, weight_sync_timeout_s=1800)
                    for i in range(n)
                ]
                for p in procs:
                    stack.callback(p.stop)
                start_all(procs, 600)
                broadcast = float("nan")  # the default format's whole push: the colocated side's yardstick
                for fmt in args.formats.split(","):
                    cfg = WeightSyncConfig(
                        bucket_mb=args.bucket_mb,
                        flattened=fmt == "flattened",
                        group_name=f"bench-{fmt}",
                        timeout_s=1800,
                    )
                    m = measure(named, [p.url for p in procs], cfg, args.rounds)
                    rows.append(report_row(name, n, fmt, m))
                    print(rows[-1], flush=True)
                    if fmt == "default":
                        broadcast = m["whole"]
            if name in args.colocated.split(","):
                c = measure_colocated(model_dir, dtype, n, args.rounds, args.model_cache / "logs")
                colocated.append(
                    f"| {name} | {n} | {int(c['bytes'])} | {c['whole']:.4f} | {broadcast:.3f} | "
                    f"{c['whole'] / broadcast:.2%} |"
                )
                print(colocated[-1], flush=True)
    print()
    print(
        "| set | engines | format | GB | buckets | push s | buckets s | raw s | push GB/s | raw GB/s | whole / raw | buckets / raw |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    print(f"\ntarget: whole >= {TARGET}x raw")
    if colocated:
        print("\n| set | engines | colocated bytes | colocated push s | broadcast push s | colocated / broadcast |")
        print("|---|---|---|---|---|---|")
        print("\n".join(colocated))
        print(f"\ntarget: colocated < {COLOCATED_TARGET:.0%} of the broadcast push")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
