"""Which CPUs a run's trainer and its local engines use (`launch.cpu_placement`), so that async
training does not oversubscribe the cores of one machine.

In sync training the engines idle while the trainer trains: the trainer takes every core
(`trainer.cpu_threads`' default) and nobody is pinned. In async training both work at once; left
to themselves each takes the cores it sees, together more threads than there are cores, and each
slows the other (async ran at 0.24-0.54x of TRL's speed that way, sync at 0.68-0.91x:
benchmarks/README.md, vs_trl.py). So in async mode, with built-in CPU engines that the run starts
itself, the usable CPUs (this process's affinity, sorted) are split (`split`):

- the trainer takes the first half, rounded down (at least one CPU): every trainer rank, and the
  router (the trainer's child), pinned to them, each rank with their number / `trainer.nproc`
  torch threads (at least 1);
- the engines share the rest: engine i is pinned to the i-th of `launch.engines` consecutive
  blocks of it (sizes differing by at most one) and runs as many torch threads as its block has
  CPUs; with more engines than CPUs, the engines take the CPUs in turn, one thread each;
- with one usable CPU there is nothing to split: all share it, the trainer on one thread.

An explicit `trainer.cpu_threads`, or `cpu_threads` in `launch.engine_flag`, wins over the thread
counts (the pinning stays). `launch.cpu_placement=shared` pins nobody (the sync placement, and
async's before this rule); `split` splits in sync mode too.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slimish.launch.commands import engine_flags
from slimish.processes import usable_cpus

if TYPE_CHECKING:
    from slimish.config import RunConfig
    from slimish.launch.config import LaunchConfig


@dataclass(frozen=True)
class Place:
    """One process's CPUs and torch intra-op threads."""

    cpus: tuple[int, ...] = ()  # pinned to these; (): not pinned (its parent's affinity)
    threads: int = 0  # 0: the process's own default (trainer.cpu_threads', the engine's cpu_threads')


@dataclass(frozen=True)
class CpuPlacement:
    """Where a run's processes go on rank 0's machine: `mode` split or shared, and why."""

    mode: str
    why: str
    trainer: Place
    engines: tuple[Place, ...]  # one per local engine the run starts (none when it starts none)

    def lines(self) -> list[str]:
        """The placement as the dry run prints it and a run logs it at start."""
        return [
            f"CPU placement: {self.mode} ({self.why})",
            f"  trainer (each rank) and router: {_show(self.trainer)}",
            *(f"  engine {i}: {_show(p)}" for i, p in enumerate(self.engines)),
        ]


def _show(place: Place) -> str:
    where = f"CPUs {_ranges(place.cpus)}" if place.cpus else "not pinned"
    return f"{where}, {place.threads or 'default'} thread{'s' * (place.threads != 1)}"


def _ranges(cpus: tuple[int, ...]) -> str:
    """0,1,2,5 -> "0-2,5", as /proc's Cpus_allowed_list writes it."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def split_blocker(launch: "LaunchConfig") -> str | None:
    """Why this launch's engines cannot be split from the trainer by this rule, or None: it places
    only built-in CPU engines that the run starts on this machine."""
    device = str(engine_flags(launch.engine_flag).get("device", "cpu"))
    reasons = [
        (launch.mode != "local", f"launch.mode={launch.mode} places the engines"),
        (bool(launch.router_url), "launch.router_url: the run starts no engines"),
        (launch.engine_kind != "builtin", f"launch.engine_kind={launch.engine_kind}: not built-in CPU engines"),
        (device.startswith("cuda"), f"launch.engine_flag device={device}: the engines are on GPUs"),
        (bool(launch.teacher.model), "launch.teacher.model: the teacher's engines are not placed by this rule"),
    ]
    return next((why for blocked, why in reasons if blocked), None)


def cpu_placement(cfg: "RunConfig", cpus: Collection[int]) -> CpuPlacement:
    """The rule above for `cfg` on the usable CPUs `cpus`: a pure function, which the dry run
    prints and the run applies (`place_this_rank`, `slimish.launch.local.engine_server`)."""
    launch, nproc = cfg.launch, cfg.trainer.nproc
    engine_threads = int(engine_flags(launch.engine_flag).get("cpu_threads", 0))
    blocker = split_blocker(launch)
    count = 0 if blocker else launch.engines  # the engines this rule places
    if why := _not_split(cfg, blocker):
        shared = Place(threads=cfg.trainer.cpu_threads)
        return CpuPlacement("shared", why, shared, (Place(threads=engine_threads),) * count)
    ordered = tuple(sorted(cpus))
    if len(ordered) < 2:
        trainer, engine = Place(ordered, cfg.trainer.cpu_threads or 1), Place(ordered, engine_threads or 1)
        return CpuPlacement("shared", "1 usable CPU: nothing to split", trainer, (engine,) * count)
    mine, theirs = ordered[: len(ordered) // 2], ordered[len(ordered) // 2 :]
    trainer = Place(mine, cfg.trainer.cpu_threads or max(1, len(mine) // nproc))
    if count <= len(theirs):
        blocks = [theirs[i * len(theirs) // count : (i + 1) * len(theirs) // count] for i in range(count)]
    else:
        blocks = [(theirs[i % len(theirs)],) for i in range(count)]
    engines = tuple(Place(b, engine_threads or len(b)) for b in blocks)
    mode = "async" if cfg.async_training else "launch.cpu_placement=split"
    return CpuPlacement("split", f"{mode}, {len(ordered)} usable CPUs", trainer, engines)


def _not_split(cfg: "RunConfig", blocker: str | None) -> str | None:
    """Why `cfg` runs shared, or None: it splits."""
    if cfg.launch.cpu_placement == "shared":
        return "launch.cpu_placement=shared"
    if cfg.launch.cpu_placement == "auto" and not cfg.async_training:
        return "sync: the engines idle while the trainer trains"
    return blocker  # with auto only: `check_split` refuses split where there is one


def check_split(launch: "LaunchConfig") -> None:
    """`launch.cpu_placement=split` only where the rule places engines; refused by name otherwise."""
    if launch.cpu_placement == "split" and (why := split_blocker(launch)):
        raise ValueError(f"launch.cpu_placement=split places built-in CPU engines the run starts: {why}")


def place_this_rank(cfg: "RunConfig") -> CpuPlacement:
    """`cpu_placement` on this process's usable CPUs, with this trainer rank pinned to its CPUs
    (`pin`), before it starts anything: the router it starts inherits them."""
    placement = cpu_placement(cfg, usable_cpus())
    pin(placement.trainer)
    return placement


def pin(place: Place) -> None:
    """This process, every thread of it, on `place.cpus` (children started later inherit them),
    with `place.threads` torch intra-op threads; a place without CPUs (shared) changes nothing."""
    import torch

    if not place.cpus or not hasattr(os, "sched_setaffinity"):
        return
    for tid in os.listdir("/proc/self/task"):  # affinity is per thread: torch's pool may exist already
        try:
            os.sched_setaffinity(int(tid), place.cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    if place.threads:
        torch.set_num_threads(place.threads)
