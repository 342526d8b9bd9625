"""Faults a run survives beyond an engine's death (tests/test_train_faults.py) and a trainer
killed between steps (tests/test_train_resume.py): its router SIGKILLed mid-rollout, its disk
filling up during a checkpoint, and the trainer SIGKILLed in the middle of a LoRA adapter push.
Each run ends with every prompt trained exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import assert_run_survives_an_engine_kill, process_exited, wait_for
from test_lora_train import LORA
from test_train_resume import GROUPS, _argv, _prompts, _trained

from slimish.trainer import checkpoint
from slimish.trainer.checkpoint import CheckpointError, checkpoint_dir

# The router is this trainer process's child: `python -m slimish.cli router ...`.
SIGKILL_THE_ROUTER = """
children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
router = [p for p in children if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\\0")[3] == b"router"]
os.kill(int(router[0]), signal.SIGKILL)
"""


@pytest.mark.slow
def test_the_router_killed_mid_rollout_is_restarted_on_its_port(tmp_path: Path) -> None:
    """Requests in flight through the dead router, and those sent while it is down, are sent again
    once its watch has restarted it on the same port: no group fails, none is trained twice."""
    assert_run_survives_an_engine_kill(tmp_path, SIGKILL_THE_ROUTER, restarted="launch/router_restarted")


def _assert_every_prompt_once(run_dir: Path, steps: int) -> None:
    lineage = {row["step"]: row["group_ids"] for row in _trained(run_dir)}  # a re-run step replaces the killed one's
    assert sorted(lineage) == list(range(1, steps + 1))
    assert sorted(gid for ids in lineage.values() for gid in ids) == list(range(steps * GROUPS))


@contextmanager
def small_disk(path: Path, size: int) -> Iterator[Path]:
    """A real file system of `size` bytes at `path` (a tmpfs: needs root and CAP_SYS_ADMIN)."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-bounded tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_fails_the_save_naming_the_path_and_the_space(tmp_path: Path) -> None:
    """Two 2 MiB checkpoints on a 3 MiB disk, keep=1: the second cannot be written beside the first."""
    run_dir, state = tmp_path / "run", {"w": torch.zeros(1 << 19)}
    with small_disk(checkpoint_dir(run_dir), 3 << 20) as disk:
        checkpoint.save(run_dir, 1, state, keep=1)
        with pytest.raises(CheckpointError) as failed:
            checkpoint.save(run_dir, 2, state, keep=1)
        assert str(failed.value).startswith(f"checkpoint of step 2: No space left on device in {disk} after writing")
        assert "MiB free of 3.0 MiB there now" in str(failed.value)
        assert [p.name for p in disk.iterdir()] == ["step_00000001"]  # the partial one removed
        assert checkpoint.latest(run_dir) == disk / "step_00000001"
        assert torch.equal(checkpoint.load(disk / "step_00000001")["w"], state["w"])


@pytest.mark.slow
def test_a_disk_full_during_a_checkpoint_keeps_the_last_complete_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The checkpoints on a tmpfs with room for one and a half: step 1's fits, step 2's fills the
    disk while step 1's is still there (keep=1 removes it only after). The run stops on an error
    that names the directory and the space; step 1's checkpoint is whole and nothing half-written
    is left. With the disk grown, `--resume auto` continues from step 1 and trains step 2 again,
    every prompt once."""
    steps, data, run_dir = 2, _prompts(tmp_path / "prompts.jsonl", 50), tmp_path / "run"
    one = 3.05 * (tiny_model_dir / "model.safetensors").stat().st_size  # the weights and Adam's two moments
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = _argv(tiny_model_dir, run_dir, data, f"steps={steps}", "checkpoint.keep=1")
    with small_disk(checkpoint_dir(run_dir), int(1.5 * one)) as disk:
        first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert first.returncode == 1, first.stderr[-3000:]
        error = first.stderr.strip().splitlines()[-1]
        assert error.startswith(f"slimish train: checkpoint of step 2: No space left on device in {disk} after writing")
        assert "MiB free of" in error and "step_00000001, is intact" in error and "checkpoint.keep (now 1" in error
        assert sorted(p.name for p in disk.iterdir()) == ["step_00000001"]  # no partial directory left
        subprocess.run(["mount", "-o", f"remount,size={int(3 * one)}", str(disk)], check=True)
        second = subprocess.run([*argv, "--resume", "auto"], env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-3000:]
        assert f"resumed from {disk / 'step_00000001'} at step 1" in second.stderr.replace("\n", "")  # wrapped
        assert sorted(p.name for p in disk.iterdir()) == [f"step_{steps:08d}"]
    _assert_every_prompt_once(run_dir, steps)


# The trainer SIGKILLed in the middle of the adapter push after step AT: the engines have been
# sent the bucket's `/update_weights_from_distributed` and wait in its broadcast, which never comes.
# Before dying it writes its children's pids (the engines and the router) to the file named.
PUSH_KILLER = """
import os, signal, sys
from pathlib import Path
import torch.distributed as dist
from slimish.trainer.weight_sync import WeightSync
at, children_file = int(sys.argv.pop(1)), Path(sys.argv.pop(1))
armed, push_buckets, broadcast = [], WeightSync._push_buckets, dist.broadcast
def push(self, named, version, lora_name=None):
    if lora_name is not None and version == at:
        armed.append(version)
    return push_buckets(self, named, version, lora_name=lora_name)
def dying_broadcast(*args, **kwargs):
    if armed:
        children_file.write_text(Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text())
        os.kill(os.getpid(), signal.SIGKILL)
    return broadcast(*args, **kwargs)
WeightSync._push_buckets, dist.broadcast = push, dying_broadcast
from slimish.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_killed_during_a_lora_push_resumes_training_every_prompt_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Killed mid-push of step 2's adapter, the run's engine (blocked in the broadcast) and router
    die with it; `--resume auto` starts new ones from step 1's checkpoint, whose first push loads
    the adapter again, and trains step 2 again, every prompt once. The adapter directory the
    killed run wrote for its first load is in the run's own directory, which the resumed run
    empties, then removes at its end (it was a temporary directory nothing removed)."""
    steps, data, run_dir, children = 3, _prompts(tmp_path / "prompts.jsonl", 50), tmp_path / "run", tmp_path / "pids"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = _argv(tiny_model_dir, run_dir, data, f"steps={steps}", *LORA[:4])
    first = subprocess.run(
        [sys.executable, "-c", PUSH_KILLER, "2", str(children), *argv[3:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == -9, first.stderr[-3000:]
    pids = [int(p) for p in children.read_text().split()]
    assert len(pids) == 2  # the engine and the router
    # The parent-death signal reaches them at once.
    wait_for(lambda: all(process_exited(p) for p in pids), f"the run's engine and router {pids} to die with it", 30)
    assert sorted(p.name for p in checkpoint_dir(run_dir).iterdir()) == ["step_00000001"]
    assert [p.name for p in (run_dir / "weights").iterdir()] == ["policy-0"]  # the killed run's
    second = subprocess.run([*argv, "--resume", "auto"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    _assert_every_prompt_once(run_dir, steps)
    assert not (run_dir / "weights").exists()
