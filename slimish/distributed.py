"""Weight-update process groups and the wire format of a weight broadcast (docs/protocol.md 2.2, 4).

The trainer (rank 0) and every engine build the group with `init_custom_process_group`, the same
way SGLang does, so a trainer written for SGLang meets our engine at the rendezvous and our
trainer meets SGLang. Sender and receiver share `flattened_layout`, so the byte layout of a
`flattened_bucket` broadcast is defined once.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

ProcessGroup = dist.ProcessGroup


def master_store(host: str, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's TCP store, listening from now on a port the OS picks (`.port`), for the other
    ranks to be told: a port only picked free and bound later can be taken meanwhile by another
    process, whose server the other ranks would then meet."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def init_custom_process_group(
    backend: str,
    init_method: str | dist.TCPStore,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta | None = None,
) -> ProcessGroup:
    """Join a standalone group named `group_name`; blocks until all `world_size` ranks joined.

    It needs no default process group. The store keys are `group_name`-prefixed exactly as in
    SGLang, which is what makes the two sides' rendezvous meet: a plain `init_process_group`
    prefixes them differently and waits forever. Rank 0 hosts the TCP store: it passes the one
    `master_store` made, or `tcp://HOST:PORT` for a store hosted there.
    """
    if not dist.is_backend_available(backend):
        raise ValueError(f"backend {backend!r} is not available in this torch build (on CPU use 'gloo')")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = timeout or c10d.default_pg_timeout
    if isinstance(init_method, dist.TCPStore):
        store = init_method
    else:
        url = urlparse(init_method)
        if url.scheme != "tcp" or url.hostname is None or url.port is None:
            raise ValueError(f"init_method must be tcp://HOST:PORT, got {init_method!r}")
        # The store built here, not by `dist.rendezvous`: under torchrun (TORCHELASTIC_USE_AGENT_STORE)
        # that would make rank 0 a client of a store nobody hosts, and the group would never form.
        store = dist.TCPStore(
            url.hostname, url.port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True
        )
    store = dist.PrefixStore(group_name, store)
    # An empty rank list makes torch build it like a default group: this process is a member
    # with the given rank, whether or not a default group exists.
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    # Collectives translate `src` through this map; the helper leaves it unset for a
    # default-style group.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg: ProcessGroup) -> None:
    """Shut the group down and forget it, so its name can be used again."""
    dist.destroy_process_group(pg)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype: `torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The dtype for a wire name, resolved like SGLang does (`getattr(torch, name)`)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (expected e.g. 'float32', 'bfloat16')")
    return dtype


def flattened_layout(
    names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[tuple[int, int]]:
    """Byte range `(start, end)` of each tensor in a `flattened_bucket`: packed in order, no padding.

    A tensor is read back as a view of the byte buffer, which torch allows only at an offset
    that is a multiple of its itemsize; the sender must order (or pad) tensors to keep it so.
    """
    ranges, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        itemsize = dtype.itemsize
        if offset % itemsize:
            raise ValueError(
                f"flattened_bucket: {name!r} ({dtype_name(dtype)}) would start at byte {offset}, "
                f"not a multiple of its itemsize {itemsize}; put larger dtypes first or pad"
            )
        numel = 1
        for size in shape:
            numel *= size
        ranges.append((offset, offset + numel * itemsize))
        offset += numel * itemsize
    return ranges


def broadcast_tensors(tensors: list[torch.Tensor], group: ProcessGroup, flattened: bool) -> None:
    """Rank 0's side of one `/update_weights_from_distributed` call, in the order of `names`.

    Default format: one broadcast per tensor. `flattened`: all tensors' bytes in one broadcast.
    """
    if not tensors:
        raise ValueError("broadcast_tensors: no tensors to send")
    if flattened:
        flattened_layout(
            [f"tensors[{i}]" for i in range(len(tensors))], [t.dtype for t in tensors], [t.shape for t in tensors]
        )
        payloads = [torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])]
    else:
        payloads = [t.contiguous() for t in tensors]
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in payloads]
    for work in works:
        work.wait()
