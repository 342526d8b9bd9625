"""LoRA RL end to end against real engines: the adapter-only push (broadcast and disk), rollout
calls that name the adapter, the LoRA quickstart, and two runs sharing one engine pool."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import ROOT, assert_run_survives_an_engine_kill, quickstart_argv, running_engines, running_router
from safetensors.torch import load_file
from test_train_faults import SIGKILL_A_CHILD_ENGINE
from test_trainer_torch import config, make_groups, with_rollout_logprobs

from slimish.client import Client
from slimish.metrics import read_metrics
from slimish.rollout.api import RolloutContext, RolloutRuntime
from slimish.trainer.backend import WeightExport
from slimish.trainer.config import WeightSyncConfig
from slimish.trainer.torch_backend import TorchTrainer
from slimish.trainer.weight_sync import WeightSync
from slimish.types import Sample

MODULES = ["q_proj", "v_proj"]
LORA = (
    "trainer.lora.enabled=true",
    "trainer.lora.rank=4",
    "trainer.lora.alpha=8",
    f"trainer.lora.target_modules=[{','.join(MODULES)}]",
    "trainer.lr=1e-2",
    "rollout.temperature=0",
)


@contextmanager
def lora_pool(model: Path, factory, rank: int = 4, modules: list[str] = MODULES) -> Iterator[tuple[str, str]]:
    """One engine serving LoRA adapters (up to `rank`, on `modules`) and the router in front of
    it: (engine URL, router URL)."""
    flags = {"enable_lora": True, "max_lora_rank": rank, "lora_target_modules": modules}
    with running_engines(model, factory, n=1, **flags) as (engine,), running_router(worker_urls=[engine.url]) as router:
        yield engine.url, router


def served(url: str, tensors: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    """The engine's copy of each of the adapter's tensors (read back by PEFT name)."""

    async def read() -> dict[str, torch.Tensor]:
        async with Client(url) as c:
            return {
                k: torch.tensor(await c.get_weights_by_name(k, truncate_size=1 << 20, lora_name=adapter))
                for k in tensors
            }

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
    torch.manual_seed(cfg.seed)  # the adapter's init (how far one step moves it), not what earlier tests left
    trainer = TorchTrainer(cfg)
    with lora_pool(tiny_model_dir, tmp_path_factory) as (engine, router):
        base_version = version(engine)
        with WeightSync(WeightSyncConfig(timeout_s=60), [engine], adapter="a", router_url=router) as sync:
            first = sync.push(trainer.export(), 0)
            trainer.train_step(with_rollout_logprobs(trainer, make_groups(0), noise=0.1, seed=0), 1)
            tensors = trainer.adapter_tensors()
            second = sync.push(WeightExport(tensors.items(), trainer.adapter_config()), 1)
        assert second["bytes"] == first["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
        got = served(engine, tensors, "a")
        assert all(torch.equal(got[k], tensors[k]) for k in tensors)
        assert version(engine, "a") == "1" and version(engine) == base_version
        sample, sampled_version = rollout_logprobs(cfg, router, list(range(5, 17)))
        assert sampled_version == 1 and sample.response_length == 8
        (policy,) = trainer.logprobs([sample])
        (base,) = trainer.logprobs([sample], trainer.ref)
        torch.testing.assert_close(torch.tensor(sample.rollout_logprobs), policy, atol=1e-4, rtol=0)
        assert (policy - base).abs().max() > 1e-2  # the adapter, not the base, was sampled


def test_disk_fallback_reloads_the_saved_adapter_versioned(tiny_model_dir: Path, tmp_path_factory, tmp_path) -> None:
    """weight_sync.transport=disk: a push saves the adapter directory and reloads it on every
    engine (unload + load through the router), no process group formed. The load carries the
    push's version (`weight_version` on /load_lora_adapter, a slimish extension), so samples
    report it and the buffer does not drop them as stale."""
    trainer = TorchTrainer(config(tiny_model_dir, *LORA))
    with lora_pool(tiny_model_dir, tmp_path_factory) as (engine, router):
        with WeightSync(
            WeightSyncConfig(transport="disk", disk_dir=str(tmp_path), timeout_s=60),
            [engine],
            adapter="d",
            router_url=router,
        ) as sync:
            trainer.train_step(with_rollout_logprobs(trainer, make_groups(1), noise=0.1, seed=1), 1)
            sync.push(trainer.export(), 1)
            assert sync.group is None and [p.name for p in tmp_path.iterdir()] == ["d-1"]
        tensors = trainer.adapter_tensors()
        got = served(engine, tensors, "d")
        assert all(torch.equal(got[k], tensors[k]) for k in tensors)
        assert (version(engine, "d"), version(engine)) == ("1", "default")


def test_an_engine_killed_mid_rollout_comes_back_and_gets_the_adapter(tmp_path: Path) -> None:
    """A LoRA run's engine killed mid-rollout: the router retries its adapter requests on the
    other engine, the run restarts it (serving its own base, which a LoRA run never pushes, so
    without --await-weights) and the next push loads the adapter there: step 4 samples the
    adapter pushed after step 3 on both engines, every prompt trained once."""
    assert_run_survives_an_engine_kill(tmp_path, SIGKILL_A_CHILD_ENGINE, *LORA[:4])


ALL_LINEAR = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]  # configs/quickstart_lora.yaml's


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.timeout(1500)
def test_two_runs_share_one_engine_pool(tmp_path: Path, quickstart_sft: Path, tmp_path_factory) -> None:
    """Two LoRA quickstart runs (configs/quickstart_lora.yaml, adapters `a` and `b`, other seeds)
    at once on one engine behind one router (launch.router_url). Each samples only its own
    adapter: the engine's log-probs of every trained token are its own trainer's (mismatch ~0;
    the other's adapter or the base would differ by far more), its samples carry its own versions
    (step k trains on version k - 1 only), and the engine ends holding each run's final adapter.
    Run `a` learns from the quickstart's warm start (near chance): the short LoRA quickstart. 30 steps
    and 256 held-out prompts: after 20 steps the rises measured +0.44, +0.23 and +0.14 (seed 1, a
    CI failure at the 0.15 bar), and 64 prompts alone move an eval by about 0.05. Run `b` only has to
    overlap it (6 steps, all while `a` trains): isolation needs both adapters live, learning needs one
    run, and the second learning run was 50 s of the suite."""
    steps = {"a": 30, "b": 6}
    with lora_pool(quickstart_sft, tmp_path_factory, rank=16, modules=ALL_LINEAR) as (engine, router):
        runs = {name: tmp_path / name for name in ("a", "b")}
        procs = {
            name: subprocess.Popen(
                quickstart_argv(
                    d,
                    f"steps={steps[name]}",
                    f"eval.every={steps[name]}",
                    f"eval.n_prompts={256 if name == 'a' else 32}",
                    f"launch.router_url={router}",
                    f"trainer.lora.name={name}",
                    f"seed={seed}",
                    model=quickstart_sft,
                    config="configs/quickstart_lora.yaml",
                ),
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.DEVNULL,
                stderr=open(d.with_suffix(".log"), "w"),
            )
            for seed, (name, d) in enumerate(runs.items())
        }
        try:
            for name, proc in procs.items():
                assert proc.wait(timeout=1200) == 0, runs[name].with_suffix(".log").read_text()[-3000:]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        finals = {name: load_file(d / "run" / "hf" / "adapter_model.safetensors") for name, d in runs.items()}
        for name, tensors in finals.items():
            got = served(engine, tensors, name)
            assert all(torch.equal(got[k], tensors[k]) for k in tensors), name
            assert version(engine, name) == str(steps[name])
    assert any(not torch.equal(finals["a"][k], finals["b"][k]) for k in finals["a"])
    for name, d in runs.items():
        rows = read_metrics(d / "run")
        mismatch = [r["train/mismatch"] for r in rows if "train/mismatch" in r]
        assert len(mismatch) == steps[name] and max(mismatch) < 1e-4, (name, max(mismatch))
        trained = [json.loads(line) for line in (d / "run" / "trained_prompts.jsonl").read_text().splitlines()]
        assert [sorted({v for vs in t["versions"] for v in vs}) for t in trained] == [[k] for k in range(steps[name])]
        assert (d / "run" / "hf" / "adapter_model.safetensors").is_file()
    curve = [r["eval/accuracy"] for r in read_metrics(runs["a"] / "run") if "eval/accuracy" in r]
    print(f"run a: held-out accuracy {curve}")
    assert curve[0] < 0.3, f"SFT alone should leave accuracy near chance, got {curve[0]}"
    assert curve[-1] >= curve[0] + 0.15, curve  # measured at 30 steps: 0.133 -> 0.621, 0.109 -> 0.508
