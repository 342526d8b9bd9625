"""`launch.cpu_placement` (slimish/launch/cpus.py): in async mode the trainer and the engines a
run starts get disjoint CPUs of this machine and matching torch threads; sync is unchanged; an
explicit thread setting wins; a placement the rule cannot make is refused by name. Then one real
async run: its engine and router children and every thread of the trainer have the CPUs the
rule gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TRAINER_THREADS, quickstart_argv

from slimish.config import load_run_config
from slimish.launch.cpus import CpuPlacement, Place, cpu_placement
from slimish.launch.local import engine_server
from slimish.processes import usable_cpus

ASYNC = ["async_training=true", "buffer.max_staleness=1"]


def placement(cpus: range | set[int], *overrides: str) -> CpuPlacement:
    return cpu_placement(load_run_config(None, ["model=m", "data.source=x", *overrides]), cpus)


def test_async_on_two_cpus_gives_the_trainer_one_and_the_engine_the_other() -> None:
    p = placement(range(2), *ASYNC)
    assert (p.mode, p.trainer, p.engines) == ("split", Place((0,), 1), (Place((1,), 1),))


def test_async_on_sixteen_cpus_splits_them_in_halves_and_the_engines_share_theirs() -> None:
    assert placement(range(16), *ASYNC).trainer == Place(tuple(range(8)), 8)
    assert placement(range(16), *ASYNC).engines == (Place(tuple(range(8, 16)), 8),)
    three = placement(range(16), *ASYNC, "launch.engines=3")
    assert three.engines == (Place((8, 9), 2), Place((10, 11, 12), 3), Place((13, 14, 15), 3))
    assert placement(range(16), *ASYNC, "trainer.nproc=2").trainer == Place(tuple(range(8)), 4)  # per rank


def test_the_usable_cpus_are_split_not_the_first_n() -> None:
    p = placement({9, 3, 7, 5, 11}, *ASYNC)  # an affinity mask with holes, in any order
    assert (p.trainer, p.engines) == (Place((3, 5), 2), (Place((7, 9, 11), 3),))  # the odd CPU to the engines


def test_more_engines_than_their_cpus_take_them_in_turn_on_one_thread() -> None:
    assert placement(range(3), *ASYNC, "launch.engines=3").engines == (
        Place((1,), 1),
        Place((2,), 1),
        Place((1,), 1),
    )


def test_one_cpu_is_shared_on_one_thread_each() -> None:
    p = placement({4}, *ASYNC, "launch.engines=2")
    assert (p.mode, p.trainer, p.engines) == ("shared", Place((4,), 1), (Place((4,), 1),) * 2)
    assert "1 usable CPU" in p.why


def test_explicit_thread_counts_win_and_the_cpus_stay_split() -> None:
    p = placement(range(16), *ASYNC, "trainer.cpu_threads=3", "launch.engine_flag=[cpu_threads=2]")
    assert (p.trainer, p.engines) == (Place(tuple(range(8)), 3), (Place(tuple(range(8, 16)), 2),))


def test_sync_is_unchanged_unless_split_is_asked_for() -> None:
    sync = placement(range(16))
    assert (sync.mode, sync.trainer, sync.engines) == ("shared", Place(), (Place(),))  # nobody pinned, defaults
    assert "sync" in sync.why
    assert placement(range(16), "launch.cpu_placement=split").trainer == Place(tuple(range(8)), 8)
    shared = placement(range(16), *ASYNC, "launch.cpu_placement=shared", "trainer.cpu_threads=2")
    assert (shared.mode, shared.trainer, shared.engines) == ("shared", Place((), 2), (Place(),))


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["launch.engine_kind=external", "launch.engine_urls=[http://127.0.0.1:1]"], "engine_kind=external"),
        (["launch.router_url=http://127.0.0.1:1"], "launch.router_url"),
        (["launch.engine_flag=[device=cuda]"], "device=cuda"),
        (["launch.teacher.model=t"], "launch.teacher.model"),
    ],
)
def test_engines_the_rule_does_not_place_stay_shared_and_split_is_refused_for_them(
    overrides: list[str], why: str
) -> None:
    p = placement(range(16), *ASYNC, *overrides)
    assert (p.mode, p.trainer.cpus, p.engines) == ("shared", (), ()) and why in p.why
    with pytest.raises(SystemExit, match=rf"launch\.cpu_placement=split .*{why}"):
        placement(range(16), *ASYNC, *overrides, "launch.cpu_placement=split")


def test_a_placement_that_is_no_choice_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match=r"launch\.cpu_placement must be one of auto, split, shared, got 'half'"):
        placement(range(2), "launch.cpu_placement=half")


def test_the_launcher_starts_an_engine_on_its_place_and_the_users_threads_win() -> None:
    from slimish.launch.config import LaunchConfig

    engine = engine_server(LaunchConfig(), "/m", None, place=Place((1,), 1))
    assert engine.cpus == (1,) and engine.argv[-2:] == ["--cpu-threads", "1"]
    mine = engine_server(LaunchConfig(engine_flag=["cpu_threads=3"]), "/m", None, place=Place((1,), 1)).argv
    assert mine.count("--cpu-threads") == 1 and mine[mine.index("--cpu-threads") + 1] == "3"


def test_the_dry_run_prints_the_placement_and_the_engines_threads(tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = [sys.executable, "-m", "slimish.train", "--dry-run", f"model={tiny_model_dir}", "data.source=x", *ASYNC]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    p = placement(usable_cpus(), *ASYNC)
    assert "\n".join(p.lines()) in out.stdout
    assert f"--cpu-threads {p.engines[0].threads}" in out.stdout.split("command lines")[1]


PROBE = """
import json, os, torch
from rollout_plugins import math

def cpus(path):
    return next(line.split()[1] for line in open(path) if line.startswith("Cpus_allowed_list"))

async def rollout(ctx, sample):
    out = os.environ["PLACEMENT_PROBE"]
    if not os.path.exists(out):  # the first sample: the run's processes are all up
        me = os.getpid()
        children = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = open(f"/proc/{pid}/status").read()
                if f"PPid:\\t{me}\\n" in status:
                    children[pid] = (cpus(f"/proc/{pid}/status"), open(f"/proc/{pid}/cmdline").read().split("\\0"))
            except OSError:
                pass
        threads = sorted({cpus(f"/proc/self/task/{t}/status") for t in os.listdir("/proc/self/task")})
        json.dump({"threads": threads, "torch": torch.get_num_threads(), "children": children}, open(out, "w"))
    return await math.rollout(ctx, sample)
"""


@pytest.mark.timeout(300)
def test_an_async_run_pins_its_engine_router_and_trainer_as_the_rule_says(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The default placement of a real async run (1 step of the quickstart): the engine child's
    CPUs and --cpu-threads, the router child's CPUs and every trainer thread's CPUs (read from
    /proc by the run's own rollout function), and the torch threads the trainer runs, as
    `cpu_placement` gives them for this machine's usable CPUs; the run says so at start."""
    plugin, probe = tmp_path / "probe_plugin.py", tmp_path / "probe.json"
    plugin.write_text(PROBE)
    overrides = [
        *ASYNC,
        "steps=1",
        "sft.steps=0",
        "eval.every=0",
        "algorithm.ptx_coef=0",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.filter_fn=null",
        f"rollout.rollout_fn={plugin}:rollout",
    ]
    argv = quickstart_argv(tmp_path, *overrides, model=tiny_model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLACEMENT_PROBE": str(probe)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(probe.read_text())
    p = placement(usable_cpus(), *ASYNC, TRAINER_THREADS)  # as quickstart_argv runs it

    def listed(place: Place) -> str:  # as /proc's Cpus_allowed_list writes it (contiguous here)
        return f"{place.cpus[0]}-{place.cpus[-1]}" if len(place.cpus) > 1 else str(place.cpus[0])

    if len(usable_cpus()) >= 2:
        assert p.mode == "split" and not set(p.trainer.cpus) & set(p.engines[0].cpus)
    assert seen["threads"] == [listed(p.trainer)] and seen["torch"] == p.trainer.threads
    kinds = {cmd[3]: (cpus, cmd) for cpus, cmd in seen["children"].values()}  # python -m slimish.cli KIND ...
    engine_cpus, engine_argv = kinds["engine"]
    assert engine_cpus == listed(p.engines[0])
    assert engine_argv[engine_argv.index("--cpu-threads") + 1] == str(p.engines[0].threads)
    assert kinds["router"][0] == listed(p.trainer)
    assert "\n".join(p.lines()) in done.stdout + done.stderr
