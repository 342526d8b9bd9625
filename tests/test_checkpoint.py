"""Checkpoints: exact training continuation, atomic writes (a writer killed between writing and
renaming leaves nothing visible), pruning, `--resume auto`, and the HF export."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer_torch import config, make_groups, params, with_rollout_logprobs

from slimish.trainer import checkpoint
from slimish.trainer.torch_backend import TorchTrainer

WAIT_S = 60.0


def test_round_trip_continues_training_exactly(tiny_model_dir, tmp_path):
    """Trained 2 steps straight, or 1 step, saved, loaded into a fresh trainer, 1 more step:
    the same weights, bit for bit (optimizer moments, schedule, reference model included)."""
    overrides = ("trainer.lr=1e-3", "trainer.lr_schedule=cosine", "trainer.warmup_steps=1", "algorithm.kl_coef=0.1")
    straight = TorchTrainer(config(tiny_model_dir, *overrides))
    batches = [with_rollout_logprobs(straight, make_groups(seed), 0.2, seed) for seed in (10, 11)]
    straight.train_step(batches[0], 1)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    checkpoint.save(
        tmp_path,
        1,
        {"step": 1, "trainer": straight.state_dict(), "rng": checkpoint.rng_state(), "rollout": {"cursor": 12}},
        keep=2,
    )
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    straight.train_step(batches[1], 2)

    resumed = TorchTrainer(config(tiny_model_dir, *overrides))
    state = checkpoint.load(checkpoint.resolve(tmp_path, "auto"))
    assert state["step"] == 1 and state["rollout"] == {"cursor": 12}
    resumed.load_state_dict(state["trainer"])
    checkpoint.set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws
    resumed.train_step(batches[1], 2)
    mine, theirs = params(straight), params(resumed)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]


def test_keep_latest_resolve(tmp_path):
    assert checkpoint.latest(tmp_path) is None and checkpoint.resolve(tmp_path, "auto") is None
    assert checkpoint.resolve(tmp_path, None) is None
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, {"step": step}, keep=2)
    assert sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir()) == ["step_00000002", "step_00000003"]
    assert checkpoint.latest(tmp_path).name == "step_00000003"
    checkpoint.save(tmp_path, 3, {"step": 3, "redone": True}, keep=2)  # a step redone after a resume
    assert checkpoint.load(checkpoint.latest(tmp_path))["redone"] is True
    assert checkpoint.load(checkpoint.resolve(tmp_path, str(checkpoint.latest(tmp_path))))["step"] == 3
    with pytest.raises(ValueError, match="checkpoint.resume: .* is not a checkpoint directory"):
        checkpoint.resolve(tmp_path, str(tmp_path / "nowhere"))


def test_failure_before_the_rename_leaves_nothing(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, {"step": 1}, keep=0)
    real_replace = os.replace

    def failing(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", failing)
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.save(tmp_path, 1, {"step": 1, "new": True}, keep=0)  # replacing step 1
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.save(tmp_path, 2, {"step": 2}, keep=0)
    assert [p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir()] == ["step_00000001"]
    assert checkpoint.load(checkpoint.latest(tmp_path)) == {"step": 1}  # the old one is back


KILLED_WRITER = """
import os, sys, time
from slimish.trainer import checkpoint
run_dir, flag = sys.argv[1], sys.argv[2]
checkpoint.save(run_dir, 1, {"step": 1}, keep=0)
real = os.replace
def stall(src, dst):  # everything is written and fsynced; the rename is next
    open(flag, "w").close()
    time.sleep(600)
checkpoint.os.replace = stall
checkpoint.save(run_dir, 2, {"step": 2, "blob": bytes(1 << 20)}, keep=0)
"""


def test_writer_killed_mid_save(tmp_path):
    flag = tmp_path / "about-to-rename"
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path), str(flag)])
    try:
        deadline = time.monotonic() + WAIT_S
        while not flag.exists():
            assert child.poll() is None, f"writer exited with {child.returncode}"
            assert time.monotonic() < deadline, "the writer did not reach the rename"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=10)
    root = checkpoint.checkpoint_dir(tmp_path)
    assert any(p.name.startswith(".tmp-") for p in root.iterdir())  # the complete-but-unrenamed copy
    assert checkpoint.latest(tmp_path).name == "step_00000001"
    assert checkpoint.load(checkpoint.resolve(tmp_path, "auto")) == {"step": 1}
    checkpoint.save(tmp_path, 2, {"step": 2}, keep=0)  # the next save clears the leftover
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]


def test_save_hf_loads_with_from_pretrained(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = TorchTrainer(config(tiny_model_dir, "sft.lr=1e-2"))
    trainer.sft_step([s for g in make_groups(8) for s in g])
    trainer.save_hf(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert all(torch.equal(p, dict(loaded.named_parameters())[n]) for n, p in params(trainer).items())
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("12 + 3").input_ids == trainer.tokenizer("12 + 3").input_ids
