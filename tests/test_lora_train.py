"""LoRA RL end to end against real engines: the adapter-only push (broadcast and disk), rollout
calls that name the adapter, the LoRA quickstart, and two runs sharing one engine pool."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ROOT, running_engines, running_router
from test_trainer_torch import config, make_groups, with_rollout_logprobs

from slimish.client import Client
from slimish.config import WeightSyncConfig
from slimish.metrics import read_metrics
from slimish.rollout.api import RolloutContext, RolloutRuntime
from slimish.trainer.torch_backend import TorchTrainer
from slimish.trainer.weight_sync import WeightSync
from slimish.types import Sample

MODULES = ["q_proj", "v_proj"]
LORA = ("trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=8", f"trainer.lora.target_modules=[{','.join(MODULES)}]",
        "trainer.lr=1e-2", "rollout.temperature=0")  # fmt: skip
ENGINE_FLAGS = {"enable_lora": "true", "max_lora_rank": 4, "lora_target_modules": MODULES}


def served(url: str, tensors: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    """The engine's copy of each of the adapter's tensors (read back by PEFT name)."""

    async def read() -> dict[str, torch.Tensor]:
        async with Client(url) as c:
            return {k: torch.tensor(await c.get_weights_by_name(k, truncate_size=1 << 20, lora_name=adapter)) for k in tensors}

    return asyncio.run(read())


def version(url: str, adapter: str | None = None) -> str:
    async def read() -> str:
        async with Client(url) as c:
            return await c.get_weight_version(adapter)

    return asyncio.run(read())


def rollout_logprobs(cfg, router: str, prompt: list[int]) -> tuple[Sample, int]:
    """One greedy `ctx.generate_sample` of the run's rollout path: the sample and its version."""

    async def go() -> tuple[Sample, int]:
        runtime = await RolloutRuntime.create(cfg, router)
        try:
            sample = Sample(prompt="", group_id=0, index=0)
            sample.set_prompt(prompt)
            await RolloutContext(runtime, sample, {"max_new_tokens": 8}).generate_sample()
            return sample, sample.weight_versions[-1]
        finally:
            await runtime.close()

    return asyncio.run(go())


def test_adapter_push_lands_versioned_and_rollouts_sample_the_adapter(tiny_model_dir: Path, tmp_path_factory) -> None:
    """Two broadcast pushes of the adapter: the engine then holds the trainer's adapter tensors
    exactly, reports the push's version for the adapter and the base's unchanged, and the
    rollout path (which names the adapter) samples tokens whose engine log-probs are the
    trainer's policy's, not the base's. The push's bytes are the adapter's alone."""
    cfg = config(tiny_model_dir, *LORA, "trainer.lora.name=a")
    trainer = TorchTrainer(cfg)
    with running_engines(tiny_model_dir, tmp_path_factory, n=1, **ENGINE_FLAGS) as (engine,), running_router(worker_urls=[engine.url]) as router:
        base_version = version(engine.url)
        with WeightSync(WeightSyncConfig(timeout_s=60), [engine.url], adapter="a", router_url=router) as sync:
            first = sync.push_adapter(trainer.adapter_tensors(), trainer.adapter_config(), "0")
            trainer.train_step(with_rollout_logprobs(trainer, make_groups(0), noise=0.1, seed=0), 1)
            tensors = trainer.adapter_tensors()
            second = sync.push_adapter(tensors, trainer.adapter_config(), "1")
        assert second["bytes"] == first["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
        got = served(engine.url, tensors, "a")
        assert all(torch.equal(got[k], tensors[k]) for k in tensors)
        assert version(engine.url, "a") == "1" and version(engine.url) == base_version
        sample, sampled_version = rollout_logprobs(cfg, router, list(range(5, 17)))
        assert sampled_version == 1 and sample.response_length == 8
        (policy,) = trainer.logprobs([sample])
        (base,) = trainer.logprobs([sample], trainer.ref)
        torch.testing.assert_close(torch.tensor(sample.rollout_logprobs), policy, atol=1e-4, rtol=0)
        assert (policy - base).abs().max() > 1e-2  # the adapter, not the base, was sampled


def test_disk_fallback_unloads_and_loads_the_saved_adapter(tiny_model_dir: Path, tmp_path_factory, tmp_path) -> None:
    """weight_sync.transport=disk: each push saves the adapter directory and reloads it on every
    engine (unload + load through the router), versioned; no process group is formed."""
    trainer = TorchTrainer(config(tiny_model_dir, *LORA))
    with running_engines(tiny_model_dir, tmp_path_factory, n=1, **ENGINE_FLAGS) as (engine,), running_router(worker_urls=[engine.url]) as router:
        with WeightSync(WeightSyncConfig(transport="disk", disk_dir=str(tmp_path), timeout_s=60), [engine.url], adapter="d",
                        router_url=router) as sync:  # fmt: skip
            for step in (1, 2):
                trainer.train_step(with_rollout_logprobs(trainer, make_groups(step), noise=0.1, seed=step), step)
                sync.push_adapter(trainer.adapter_tensors(), trainer.adapter_config(), str(step))
                assert sync.group is None and sorted(p.name for p in tmp_path.iterdir()) == [f"d-{step}"]  # the previous one removed
        tensors = trainer.adapter_tensors()
        got = served(engine.url, tensors, "d")
        assert all(torch.equal(got[k], tensors[k]) for k in tensors) and version(engine.url, "d") == "2"
