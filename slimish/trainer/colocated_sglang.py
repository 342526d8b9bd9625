"""Weight sync of a colocated run on GPU (`launch.colocate` with `launch.engine_kind: sglang`,
docs/colocate.md): SGLang engines on the trainer's GPU, started with `--enable-memory-saver`, hand
their memory back while the trainer trains, and a push passes the trainer's tensors to them as
CUDA IPC handles, so no bytes cross a wire or a process group. One sync step, as slime's colocated
mode runs it (its train.py: offload, train, onload weights, update, onload the KV cache):

    rollout -> /flush_cache -> /release_memory_occupation (every tag: weights, kv_cache, cuda_graph)
    -> train -> /resume_memory_occupation ["weights"] -> /begin_weight_update
    -> /update_weights_from_tensor (per bucket) -> /end_weight_update
    -> /resume_memory_occupation ["kv_cache", "cuda_graph"] -> /update_weight_version

SGLang 0.5.23 loads tensors only inside a weight-update session (begin .. end). The engines are
idle between the rollout and the push (sync mode), so no pause is needed. Their weights are
written while their KV cache is still released: the trainer's memory, not the engine's, is what
the optimiser state took.

The payload (`ipc_payload`): `serialized_named_tensors` holds one entry per tensor-parallel rank
of the engine, each the base64 of a `multiprocessing.reduction.ForkingPickler` pickle of the
bucket's `[(name, tensor), ...]`. For a CUDA tensor such a pickle holds an IPC handle to the
trainer's memory, not the bytes; the device is written as its UUID, which SGLang's patched
`rebuild_cuda_tensor` maps to its own device index (sglang/srt/utils/patch_torch.py), so engines
with other `CUDA_VISIBLE_DEVICES` find it. The engine loads it with its own restricted unpickler
(SafeUnpickler); slimish builds such pickles, it never unpickles bytes from the network. A bucket's
tensors stay referenced until its call returned; torch keeps memory an engine still maps alive
past that (CUDA IPC reference counts) and `torch.cuda.ipc_collect` frees it once released.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions

from slimish.protocol import wire_version
from slimish.trainer.backend import WeightExport
from slimish.trainer.engine_control import WeightSyncError
from slimish.trainer.weight_sync import WeightSync, plan_buckets, timings

DEVICE_ARG = 6  # the device index in torch's rebuild_cuda_tensor arguments
ALL_TAGS = None  # SGLang: every memory tag (weights, kv_cache, cuda_graph)
RESUMED_FIRST, RESUMED_AFTER = ["weights"], ["kv_cache", "cuda_graph"]


class _IpcPickler(ForkingPickler):
    """ForkingPickler whose CUDA tensors name their device by UUID (module docstring)."""


def _reduce_by_uuid(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[DEVICE_ARG]).uuid)
        args = (*args[:DEVICE_ARG], uuid, *args[DEVICE_ARG + 1 :])
    return rebuild, args


_IpcPickler.register(torch.Tensor, _reduce_by_uuid)
_IpcPickler.register(torch.nn.Parameter, _reduce_by_uuid)


def ipc_payload(named: list[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """`serialized_named_tensors` for an engine of `tp_size` ranks: each rank its own pickle
    of the same tensors (SGLang has each rank read only its own entry, and CUDA IPC counts
    references per pickle)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")

    def one() -> str:
        buf = io.BytesIO()
        _IpcPickler(buf).dump([(name, t.detach()) for name, t in named])
        return base64.b64encode(buf.getvalue()).decode("ascii")

    return [one() for _ in range(tp_size)]


class SGLangColocatedSync:
    """`WeightSync`'s interface (connect, push, close, urls) plus `release`, for SGLang engines
    on the trainer's GPU; `sync`, the run's `WeightSync` to them, carries its calls and settings
    (`bucket_mb`, `dtype`)."""

    def __init__(self, sync: WeightSync) -> None:
        if sync.adapter is not None:
            raise WeightSyncError("launch.colocate with SGLang engines pushes the whole policy, not an adapter")
        self.sync, self.urls, self.engines = sync, sync.urls, sync.engines
        self.tp: list[int] = []
        self.released = False

    def connect(self) -> None:
        """Reads every engine's tensor-parallel size; refuses engines that cannot release memory
        (no `--enable-memory-saver`) or that are data- or pipeline-parallel."""
        infos = self.engines.all(lambda c: c.server_info())
        for url, info in zip(self.urls, infos):
            if not info.get("enable_memory_saver"):
                raise WeightSyncError(
                    f"launch.colocate: {url} was started without --enable-memory-saver, so it cannot release "
                    "its GPU memory to the trainer"
                )
            if int(info.get("dp_size") or 1) != 1 or int(info.get("pp_size") or 1) != 1:
                raise WeightSyncError(f"launch.colocate: {url} must run with dp_size=1 and pp_size=1")
        self.tp = [int(info.get("tp_size") or 1) for info in infos]

    def close(self) -> None:
        self.sync.close()

    def release(self) -> None:
        """Every engine's weights, KV cache and CUDA graphs freed while the trainer trains; the
        prefix cache flushed first (as slime does), so that no update has to flush a cache whose
        memory is gone."""
        self.engines.all(lambda c: c.flush_cache())
        self._memory("/release_memory_occupation", ALL_TAGS)
        self.released = True

    def push(self, export: WeightExport, version: int) -> dict[str, float]:
        """Every engine serves the trainer's current parameters as `version` (module docstring);
        `WeightSync.push`'s timings, `bytes` those the engines copied from the handles."""
        wire_version(version)
        if export.adapter_config is not None:
            raise WeightSyncError("launch.colocate with SGLang engines pushes the whole policy, not an adapter")
        if not self.tp:
            raise WeightSyncError("push before connect(): the engines' tensor-parallel sizes are not known")
        started, released = time.perf_counter(), self.released
        if released:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the step's activations, cached by torch: the engine's again
            self._memory("/resume_memory_occupation", RESUMED_FIRST)
        if not all(self.engines.all(lambda c: c.begin_weight_update())):  # idle engines: no pause needed
            raise WeightSyncError("launch.colocate: the engines have no /begin_weight_update (SGLang before 0.5.23)")
        try:
            nbytes, buckets = self._send(export.tensors, flush=not released)
        finally:
            self.engines.check(self.engines.all(lambda c: c.end_weight_update()), "/end_weight_update")
        if released:
            self._memory("/resume_memory_occupation", RESUMED_AFTER)
            self.released = False
        self.engines.set_version(version)
        seconds = time.perf_counter() - started
        return timings(seconds, seconds, nbytes, buckets)

    def _send(self, named: Iterable[tuple[str, torch.Tensor]], flush: bool) -> tuple[int, int]:
        """The tensors as `bucket_mb` buckets of handles, in the wire dtype when one is set; the
        bytes and buckets sent. `flush`: each update flushes the prefix cache (SGLang's default),
        not wanted while the KV cache is released (it was flushed before)."""
        cfg, nbytes, buckets = self.sync.cfg, 0, 0
        for bucket in plan_buckets(((n, t.detach()) for n, t in named), cfg.bucket_mb, self.sync.wire_dtype, False):
            tensors = [t.to(d) for t, d in zip(bucket.tensors, bucket.dtypes)]  # a copy only where the dtype differs
            named_bucket = list(zip(bucket.names, tensors))
            reqs = [{"serialized_named_tensors": ipc_payload(named_bucket, tp), "flush_cache": flush} for tp in self.tp]
            results = self.engines.wait(
                self.engines.start(lambda c, r: c.request("POST", "/update_weights_from_tensor", r), reqs)
            )
            bad = [(url, r) for url, r in zip(self.urls, results) if not (isinstance(r, dict) and r.get("success"))]
            if bad:
                raise WeightSyncError(f"/update_weights_from_tensor failed: {bad}")
            nbytes, buckets = nbytes + bucket.nbytes, buckets + 1
            del tensors, named_bucket, reqs
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # handles the engines have closed
        return nbytes, buckets

    def _memory(self, route: str, tags: list[str] | None) -> None:
        """`route` for `tags` on every engine; SGLang replies null (a refusal is an error)."""
        self.engines.all(lambda c: c.request("POST", route, {"tags": tags}))
