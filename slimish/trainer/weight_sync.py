"""Send side of weight sync (docs/protocol.md 4): trainer rank 0 pushes the policy into every engine.

`transport: distributed` forms one process group with all engines (the trainer is rank 0,
engine e's TP ranks follow) and, per bucket of HF-named tensors, posts
`/update_weights_from_distributed` to every engine while it broadcasts the bucket. One push is

    pause -> begin (when the engines have weight-update sessions) -> buckets -> end -> continue

each step on every engine at once, and on each engine in that order: SGLang runs begin and end
at once only while paused, and otherwise under a writer lock that waits for every running
generation, including those a retract or in_place pause parks (a begin arriving before its pause
would wait forever). `drain` opens the session before it pauses instead: that wait is the drain,
and the retract pause after it holds generation until continue, so no request runs between
buckets on half-updated weights (a disk push is one call, which waits the same way). Only the
last bucket carries the weight version and flushes the engines' cache, and never under `in_place`
(SGLang refuses a flush, and so the update, while the parked batch runs). The tensors are bucketed
as the iterator yields them, never all held at once. `transport: disk` writes the tensors as a
safetensors file and posts `/update_weights_from_disk` instead (no group; the engines must see the
directory).

With `trainer.lora` (an adapter `WeightExport`) only the run's adapter travels, never the base
weights. The first push saves it as a PEFT adapter directory and creates it on every engine with
`/load_lora_adapter` through the router (which fans out, and so learns where it is; an adapter of
that name left loaded by an earlier incarnation of the run is unloaded first), then broadcasts it
with `lora_name`, which versions that adapter alone; later pushes only broadcast (always as
flattened buckets). `transport: disk` saves the directory and unloads and loads it every push.
Runs that share engines each push their own adapter over their own group (`group_name` gets the
adapter's name), and adapter pushes open no weight-update session: an engine has one, and
another run's push may hold it. SGLang 0.5.23 versions no single adapter (it has no
`/get_weight_version`, drops `lora_name` from a broadcast, ignores `weight_version` on a load):
there an adapter push is a disk reload under an abort pause (SGLang's unload waits for the
adapter's requests, which a retract pause would park forever, and a request arriving between
unload and load would reload the old directory), and `/update_weight_version` versions the engine.

The trainer hands a push one `WeightExport` (backend.py: what to send, decided there) and the
version as an int; the calls to the engines around the tensors are engine_control.py's.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from slimish.distributed import (
    ProcessGroup,
    destroy_custom_process_group,
    dtype_name,
    flattened_layout,
    parse_dtype,
)
from slimish.protocol import UpdateWeightsFromDiskReq, UpdateWeightsFromDistributedReq, wire_version
from slimish.trainer.backend import WeightExport
from slimish.trainer.config import SGLANG_LORA, WeightSyncConfig
from slimish.trainer.engine_control import EngineControl, WeightSyncError, in_thread
from slimish.trainer.lora import ADAPTER_WEIGHTS, write_adapter_dir

T = TypeVar("T")


@dataclass
class Bucket:
    """One /update_weights_from_distributed call."""

    names: list[str]
    tensors: list[torch.Tensor]  # the sender's tensors, any dtype
    dtypes: list[torch.dtype]  # on the wire
    nbytes: int  # on the wire


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_mb: float, wire_dtype: torch.dtype | None, flattened: bool
) -> Iterator[Bucket]:
    """Consecutive tensors up to `bucket_mb` of wire bytes each (a bigger tensor goes alone),
    each bucket yielded once the next tensor does not fit: a lazy `named` is never held whole.
    Floating tensors travel as `wire_dtype` when given. In a flattened bucket larger itemsizes
    go first, which keeps every tensor's view of the bytes aligned."""
    limit = bucket_mb * (1 << 20)

    def bucket(g: list[tuple[str, torch.Tensor, torch.dtype]]) -> Bucket:
        if flattened:
            g = sorted(g, key=lambda x: -x[2].itemsize)
        nbytes = sum(t.numel() * dtype.itemsize for _, t, dtype in g)
        return Bucket([x[0] for x in g], [x[1] for x in g], [x[2] for x in g], nbytes)

    group: list[tuple[str, torch.Tensor, torch.dtype]] = []
    size = 0
    for name, t in named:
        dtype = wire_dtype if wire_dtype is not None and t.is_floating_point() else t.dtype
        n = t.numel() * dtype.itemsize
        if group and size + n > limit:
            yield bucket(group)
            group, size = [], 0
        group.append((name, t, dtype))
        size += n
    if group:
        yield bucket(group)


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """(item, whether it is the last), reading one item ahead."""
    it = iter(items)
    try:
        item = next(it)
    except StopIteration:
        return
    for following in it:
        yield item, False
        item = following
    yield item, True


def timings(seconds: float, transfer: float, nbytes: int, buckets: int) -> dict[str, float]:
    """What a push returns (`WeightSync.push`)."""
    return {
        "seconds": seconds,
        "seconds_transfer": transfer,
        "bytes": float(nbytes),
        "gb_per_s": nbytes / transfer / 1e9 if transfer > 0 else 0.0,
        "buckets": float(buckets),
    }


class WeightSync:
    def __init__(
        self,
        cfg: WeightSyncConfig,
        engine_urls: list[str],
        api_key: str | None = None,
        adapter: str | None = None,
        router_url: str | None = None,
        scratch: Path | None = None,
    ) -> None:
        """`adapter`: the name the engines serve the run's adapter under (`trainer.lora`), which
        its pushes need (an adapter `WeightExport`), created through `router_url`. `scratch`:
        where pushes are written when `weight_sync.disk_dir` is unset (a run's own directory,
        so that a killed run's files are found and removed by the next run there: emptied before
        the first write); None: a temporary directory. Either is removed at close."""
        if not engine_urls:
            raise ValueError("engine_urls: weight sync needs at least one engine")
        if adapter is not None and router_url is None:
            raise ValueError(f"adapter {adapter!r}: an adapter push needs the router_url that loads it on every engine")
        self.cfg = cfg
        self.adapter = adapter
        self.group_name = cfg.group_name if adapter is None else f"{cfg.group_name}-{adapter}"
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.wire_dtype = parse_dtype(cfg.dtype) if cfg.dtype else None
        self.backend = cfg.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.engines = EngineControl(self.urls, api_key, cfg.timeout_s, router_url)
        self.scratch = scratch
        self.group: ProcessGroup | None = None  # the weight-update group, once connected
        self._buffers: dict[str, torch.Tensor] = {}  # per-name wire-dtype copies, reused across pushes
        self._flat: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * 2  # double buffer
        self._disk_root: Path | None = None
        self._disk_last: Path | None = None
        self._adapter_loaded = False  # by this run's first adapter push
        self._closed = False
        self.broken: str | None = None  # why the group became unusable

    # -- setup and teardown ------------------------------------------------------------------

    def connect(self) -> None:
        """Form the group with every engine (distributed transport); blocks until all joined."""
        if self.cfg.transport == "disk" or self.group is not None:
            return
        self.group = self.engines.form_group(self.cfg.master_address, self.group_name, self.backend)

    def close(self) -> None:
        """Destroy the group on the engines and here; idempotent. Engines gone already are fine."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.group is not None:
                self.engines.destroy_group(self.group_name)
                group, self.group = [self.group], None
                if self.broken:
                    # A send that no engine will receive is still pending in the group, and its
                    # destructor waits for it until the timeout: let a daemon thread do that (the
                    # list hands it the last reference, so the destructor runs there).
                    in_thread(lambda: destroy_custom_process_group(group.pop()))
                else:
                    destroy_custom_process_group(group.pop())
        finally:
            try:
                self.engines.close()
            finally:
                if self._disk_root is not None and self.cfg.disk_dir is None:
                    shutil.rmtree(self._disk_root, ignore_errors=True)

    # -- a push ------------------------------------------------------------------------------

    def push(self, export: WeightExport, version: int) -> dict[str, float]:
        """Every engine serves `export` and reports `version` once this returns: the policy's
        weights, or with an adapter export the run's adapter (the base and other adapters
        untouched).

        Returns timings: `seconds` (the whole push), `seconds_transfer` (the buckets or the
        disk write and load), `bytes` (one engine's share), `gb_per_s` (bytes / seconds_transfer)
        and `buckets`."""
        wire_version(version)  # an int, refused here before anything is sent
        if (export.adapter_config is not None) != (self.adapter is not None):
            raise WeightSyncError(
                f"push: an {'adapter' if export.adapter_config is not None else 'HF weights'} export, but this "
                f"WeightSync was made {f'for adapter {self.adapter!r}' if self.adapter else 'without an adapter name'}"
            )
        if export.adapter_config is not None:
            return self._push_adapter(dict(export.tensors), export.adapter_config, version)
        return self._push_weights(export.tensors, version)

    def _push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        named = ((name, t.detach()) for name, t in named_tensors)
        try:
            first = next(named, None)
            if first is None:
                raise ValueError("push: no tensors")
            stream = itertools.chain([first], named)
            disk = self.cfg.transport == "disk"
            return self._push(
                lambda: (self._push_disk(stream, version), 1) if disk else self._push_buckets(stream, version)
            )
        except BaseException:
            # A Megatron export is collective: the other ranks wait in it until rank 0 has
            # iterated it all, failed push or not.
            with contextlib.suppress(Exception):
                deque(named, maxlen=0)
            raise

    def _push_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int) -> dict[str, float]:
        """The run's adapter as `tensors` (its PEFT state-dict names), `config` its
        `adapter_config.json`; `push`'s timings."""
        if not tensors:
            raise ValueError("push: no adapter tensors")
        named = [(name, t.detach()) for name, t in tensors.items()]
        disk = self.cfg.transport == "disk"
        self._check_group()  # before the adapter is loaded for a broadcast that could not follow
        if not self.engines.versions_each_adapter():
            return self._push_sglang_adapter(tensors, config, version)
        if disk or not self._adapter_loaded:
            # Not paused: the unload waits for the adapter's running requests, which a pause would
            # hold forever; it refuses new ones meanwhile, so none sees a half-loaded adapter.
            started = time.perf_counter()
            path = write_adapter_dir(self._disk_dir() / f"{self.adapter}-{version}", config, tensors)
            nbytes = self._load_adapter(path, version if disk else None)
            if disk:
                seconds = time.perf_counter() - started
                return timings(seconds, seconds, nbytes, 1)
        return self._push(lambda: self._push_buckets(named, version, lora_name=self.adapter))

    def _push_sglang_adapter(
        self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int
    ) -> dict[str, float]:
        """SGLang 0.5.23 (module docstring): under the push's abort pause, the adapter directory
        is unloaded and loaded through the router, then every engine takes `version`."""
        if (self.cfg.transport, self.cfg.pause_mode) != ("disk", "abort"):
            raise WeightSyncError(f"adapter {self.adapter!r}: the engines are SGLang's ({SGLANG_LORA})")

        def reload() -> tuple[int, int]:
            path = write_adapter_dir(self._disk_dir() / f"{self.adapter}-{version}", config, tensors)
            nbytes = self._load_adapter(path, None)
            self.engines.set_version(version)
            return nbytes, 1

        return self._push(reload)

    def _push(self, send: Callable[[], tuple[int, int]]) -> dict[str, float]:
        """A push by `send` (its wire bytes and buckets) between pause and continue."""
        self._check_group()
        started = time.perf_counter()
        sending = False
        try:
            self.engines.pause(self.cfg.pause_mode, begin=self._session_push())
            t0, sending = time.perf_counter(), True
            nbytes, buckets = send()
            transfer = time.perf_counter() - t0
        except BaseException as exc:
            if sending and self.cfg.transport == "distributed":
                # Engines that refused a bucket never received it: what this rank sent is still
                # queued in the group and would be read as the next push's data.
                self.broken = str(exc) or type(exc).__name__
            raise
        finally:
            # under `drain` generation was paused only once a session drained it
            self.engines.resume(
                end=self._session_push() and bool(self.engines.sessions),
                resume=self.cfg.pause_mode != "drain" or self._session_push(),
            )
        return timings(time.perf_counter() - started, transfer, nbytes, buckets)

    def _check_group(self) -> None:
        if self.cfg.transport == "distributed" and self.group is None:
            raise WeightSyncError("push before connect(): the weight-update group does not exist")
        if self.broken:
            raise WeightSyncError(
                f"an earlier push failed mid-broadcast ({self.broken}); the group is unusable, reconnect"
            )

    def _session_push(self) -> bool:
        """Whether a push opens a weight-update session: a broadcast of the base weights, to
        engines that have sessions (older SGLang has none; None until the first push)."""
        return self.cfg.transport == "distributed" and self.engines.sessions is not False and self.adapter is None

    # -- the transports ------------------------------------------------------------------------

    def _push_buckets(
        self, named: Iterable[tuple[str, torch.Tensor]], version: int, lora_name: str | None = None
    ) -> tuple[int, int]:
        """The buckets of `named` as it yields them (the next packed while this one is on the
        wire). An adapter always goes flattened: it is many small tensors (4 per adapted module),
        and one broadcast each costs about a millisecond whatever its size (benchmarks/lora_sync.py)."""
        flattened = self.cfg.flattened or lora_name is not None
        buckets = with_last(plan_buckets(named, self.cfg.bucket_mb, self.wire_dtype, flattened))
        flush = self.cfg.pause_mode != "in_place"  # with the last bucket (module docstring)
        bucket, last = next(buckets)
        payload = self._pack(bucket, 0, flattened)
        nbytes, k = 0, 0
        while True:
            req = UpdateWeightsFromDistributedReq(
                names=bucket.names,
                dtypes=[dtype_name(d) for d in bucket.dtypes],
                shapes=[list(t.shape) for t in bucket.tensors],
                group_name=self.group_name,
                load_format="flattened_bucket" if flattened else None,
                flush_cache=last and flush,
                weight_version=wire_version(version) if last else None,
                lora_name=lora_name,
            )
            replies = self.engines.start(lambda c, r: c.update_weights_from_distributed(r), [req] * len(self.urls))
            works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in payload]
            if not last:  # overlaps the engines' receive and load of this bucket
                following = next(buckets)
                payload = self._pack(following[0], (k + 1) % 2, flattened)
            # Replies come after the engines received everything, so waiting on them first
            # turns an engine's refusal into an error here instead of a broadcast that hangs.
            self.engines.check(
                self.engines.wait(replies),
                f"/update_weights_from_distributed (bucket {k + 1}{', the last' if last else ''})",
            )
            for work in works:
                work.wait()
            nbytes += bucket.nbytes
            if last:
                return nbytes, k + 1
            bucket, last = following
            k += 1

    def _pack(self, bucket: Bucket, slot: int, flattened: bool) -> list[torch.Tensor]:
        """The tensors to broadcast for `bucket`, from reused buffers where a copy is needed."""
        if flattened:
            shapes = [t.shape for t in bucket.tensors]
            ranges = flattened_layout(bucket.names, bucket.dtypes, shapes)
            device = bucket.tensors[0].device
            if self._flat[slot].numel() < bucket.nbytes or self._flat[slot].device != device:
                self._flat[slot] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
            flat = self._flat[slot][: bucket.nbytes]
            for (start, end), t, dtype in zip(ranges, bucket.tensors, bucket.dtypes):
                flat[start:end].view(dtype).view(t.shape).copy_(t)
            return [flat]
        payload = []
        for name, t, dtype in zip(bucket.names, bucket.tensors, bucket.dtypes):
            if t.dtype == dtype and t.is_contiguous():
                payload.append(t)
                continue
            buf = self._buffers.get(name)
            if buf is None or buf.dtype != dtype or buf.shape != t.shape or buf.device != t.device:
                buf = self._buffers[name] = torch.empty(t.shape, dtype=dtype, device=t.device)
            payload.append(buf.copy_(t))
        return payload

    def _disk_dir(self) -> Path:
        """Where pushes are written: `weight_sync.disk_dir`, else `scratch` (emptied first), else
        a temporary directory."""
        if self._disk_root is None:
            if self.cfg.disk_dir is not None:
                self._disk_root = Path(self.cfg.disk_dir)
            elif self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)  # a killed run's pushes
                self._disk_root = self.scratch
            else:
                self._disk_root = Path(tempfile.mkdtemp(prefix="slimish-weights-"))
            self._disk_root.mkdir(parents=True, exist_ok=True)
        return self._disk_root

    def _push_disk(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        target = self._disk_dir() / f"weights-{version}"
        target.mkdir(exist_ok=True)
        state = {}
        for name, t in named:
            dtype = self.wire_dtype if self.wire_dtype is not None and t.is_floating_point() else t.dtype
            state[name] = t.to("cpu", dtype).contiguous()
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
        req = UpdateWeightsFromDiskReq(
            model_path=str(target), weight_version=wire_version(version), flush_cache=self.cfg.pause_mode != "in_place"
        )
        self.engines.check(self.engines.all(lambda c: c.update_weights_from_disk(req)), "/update_weights_from_disk")
        self._written(target)
        return sum(t.numel() * t.element_size() for t in state.values())

    def _load_adapter(self, path: Path, version: int | None) -> int:
        """Create the run's adapter from the directory `path` on every engine (versioned with the
        load when `version` is given: a disk push); the bytes of its weights file."""
        assert self.adapter is not None
        self.engines.load_adapter(self.adapter, path, version)
        self._adapter_loaded = True
        self._written(path)
        return (path / ADAPTER_WEIGHTS).stat().st_size

    def _written(self, target: Path) -> None:
        """`target` is what the engines load from now on: the previous push's files go."""
        if self._disk_last is not None and self._disk_last != target:
            shutil.rmtree(self._disk_last, ignore_errors=True)
        self._disk_last = target

    def __enter__(self) -> WeightSync:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PolicySyncs:
    """A run's `policies` (docs/policies.md): one `WeightSync` per policy, each pushing its own
    adapter over its own group (the group name gets the adapter's, as for runs that share engines),
    so a push of one never touches another's weights. The loop sees one sync: `push` takes the
    trainer's export, one `WeightExport` per policy, and pushes them one after the other."""

    def __init__(
        self,
        cfg: WeightSyncConfig,
        engine_urls: list[str],
        api_key: str | None,
        policies: list[str],
        router_url: str,
        scratch: Path | None = None,
    ) -> None:
        """`scratch`: each policy writes in its own subdirectory of it (`WeightSync`)."""
        self.syncs = {
            name: WeightSync(cfg, engine_urls, api_key, name, router_url, scratch and scratch / name)
            for name in policies
        }
        self.urls = next(iter(self.syncs.values())).urls

    def connect(self) -> None:
        for sync in self.syncs.values():
            sync.connect()

    def close(self) -> None:
        with contextlib.ExitStack() as stack:  # every one closed, whichever fails
            for sync in self.syncs.values():
                stack.callback(sync.close)

    def push(self, exports: dict[str, WeightExport], version: int) -> dict[str, float]:
        """Each policy's adapter, versioned `version`; `seconds` and `bytes` in all."""
        if not isinstance(exports, dict) or set(exports) != set(self.syncs):
            raise WeightSyncError(
                f"push: one adapter export per policy {sorted(self.syncs)} expected, got "
                f"{sorted(exports) if isinstance(exports, dict) else type(exports).__name__}"
            )
        timings = [self.syncs[name].push(exports[name], version) for name in self.syncs]
        return {key: sum(t[key] for t in timings) for key in ("seconds", "bytes")}

    def __enter__(self) -> PolicySyncs:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
