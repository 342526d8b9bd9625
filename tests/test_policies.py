"""Several policies in one run (`policies`, docs/policies.md): per-policy masks and rewards on token
level, per-policy adapters, optimisers and pushes, and the two-policy example learning."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
from helpers import ROOT, quickstart_argv
from test_lora_train import lora_pool, version
from test_trainer_torch import config, with_rollout_logprobs

from slimish.client import Client
from slimish.metrics import read_metrics
from slimish.rollout.api import RolloutContext, RolloutRuntime
from slimish.trainer.config import WeightSyncConfig
from slimish.trainer.policies import policy_groups, policy_mask
from slimish.trainer.torch_backend import TorchTrainer
from slimish.trainer.weight_sync import PolicySyncs
from slimish.types import Sample
from slimish.view import read_run

POLICIES = ("trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,v_proj]")
TWO = "policies=[{name: proposer},{name: solver}]"


def game(group_id: int = 0, index: int = 0) -> Sample:
    """A trajectory of both policies: proposer 3 tokens, env 2, solver 2, env 1, proposer 1."""
    s = Sample(prompt="", group_id=group_id, index=index)
    s.set_prompt([1, 2, 3])
    s.append_model([10, 11, 12], [-0.1] * 3, 0, policy="proposer")
    s.append_env([20, 21])
    s.append_model([30, 31], [-0.2] * 2, 0, policy="solver")
    s.append_env([22])
    s.append_model([40], [-0.3], 0, policy="proposer")
    s.reward = {"proposer": 1.0, "solver": 0.0}
    return s


def test_each_policy_sees_mask_one_exactly_on_its_own_turns() -> None:
    """Token level: the record says who made each token (None for the environment's), and each
    policy's mask is 1 on its own tokens only; its share of a group keeps the samples it has a turn
    in, with its own reward; a sample without the record is refused by the field's name."""
    s = game()
    s.check()
    assert s.token_policies == ["proposer"] * 3 + [None] * 2 + ["solver"] * 2 + [None, "proposer"]
    assert policy_mask(s, "proposer") == [1, 1, 1, 0, 0, 0, 0, 0, 1]
    assert policy_mask(s, "solver") == [0, 0, 0, 0, 0, 1, 1, 0, 0]
    assert policy_mask(s, "other") == [0] * 9
    only_proposer = Sample(prompt="", index=1)
    only_proposer.set_prompt([1])
    only_proposer.append_env([5])  # the environment first: the record starts before the first named token
    only_proposer.append_model([6, 7], [0.0, 0.0], 0, policy="proposer")
    only_proposer.reward = 0.5  # a number: every policy's
    assert only_proposer.token_policies == [None, "proposer", "proposer"]
    shares = {name: policy_groups([[s, only_proposer]], name) for name in ("proposer", "solver")}
    assert [[x.loss_mask for x in g] for g in shares["proposer"]] == [[[1, 1, 1, 0, 0, 0, 0, 0, 1], [0, 1, 1]]]
    assert [[x.reward for x in g] for g in shares["proposer"]] == [[1.0, 0.5]]
    assert [[(x.loss_mask, x.reward) for x in g] for g in shares["solver"]] == [[([0, 0, 0, 0, 0, 1, 1, 0, 0], 0.0)]]
    assert s.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 1]  # the sample itself is not edited
    unrecorded = Sample(prompt="", group_id=3)
    unrecorded.set_prompt([1])
    unrecorded.append_model([2], [0.0], 0)
    with pytest.raises(ValueError, match="token_policies has 0 entries"):
        policy_groups([[unrecorded]], "solver")
    assert Sample.from_dict(s.to_dict()) == s


def test_policies_config_is_refused_where_it_cannot_run() -> None:
    from slimish.config import load_run_config

    base = ["model=x", "data.source=unused", TWO]
    with pytest.raises(SystemExit, match="trainer.lora.enabled=true"):
        load_run_config(None, base)
    with pytest.raises(SystemExit, match="async_training=false"):
        load_run_config(None, [*base, *POLICIES, "async_training=true", "buffer.max_staleness=1"])
    with pytest.raises(SystemExit, match="names must differ"):
        load_run_config(None, ["model=x", "data.source=unused", *POLICIES, "policies=[{name: a},{name: a}]"])


def clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in tensors.items()}


def greedy(router: str, adapter: str, prompt: list[int]) -> list[float]:
    """The logprobs of a greedy 6-token continuation of `prompt` under `adapter`."""

    async def go() -> list[float]:
        async with Client(router) as c:
            out = await c.generate(
                input_ids=prompt,
                sampling_params={"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
                return_logprob=True,
                lora_path=adapter,
            )
            return [lp for lp, _, _ in out.meta_info.output_token_logprobs]

    return asyncio.run(go())


@pytest.mark.filterwarnings("error:Detected call of `lr_scheduler")  # a skipped step is meant: not warned of
def test_a_policy_step_moves_and_pushes_only_its_own_adapter(tiny_model_dir: Path, tmp_path_factory) -> None:
    """A batch with the proposer's tokens only: the proposer's adapter moves, the solver's stays
    bit for bit (its schedule still advances, so the next step's check passes), and after the
    pushes the engine's greedy log-probs on a fixed prompt change for the proposer and stay
    exactly the same for the solver. Each policy has its own optimiser with its own lr."""
    cfg = config(
        tiny_model_dir,
        *POLICIES,
        "trainer.lr=1e-2",
        "policies=[{name: proposer},{name: solver, lr: 0.5, advantage: rloo}]",
    )
    torch.manual_seed(0)
    trainer = TorchTrainer(cfg)
    assert [o.param_groups[0]["lr"] for o, _, _ in trainer.per_policy.values()] == [1e-2, 0.5]
    with trainer.use_policy("solver"):  # its own algorithm settings while it trains
        assert trainer.cfg.algorithm.advantage == "rloo"
    assert trainer.cfg.algorithm.advantage == "grpo"
    groups = [[game(g, k) for k in range(4)] for g in range(2)]
    for group in groups:
        for k, s in enumerate(group):
            s.token_policies = ["proposer" if p else None for p in s.token_policies]  # proposer's tokens only
            s.reward = {"proposer": float(k % 2), "solver": 0.0}
    prompt = list(range(5, 17))
    with lora_pool(tiny_model_dir, tmp_path_factory) as (engine, router):
        with PolicySyncs(WeightSyncConfig(timeout_s=60), [engine], None, ["proposer", "solver"], router) as sync:
            sync.push(trainer.export(), 0)
            before = {name: clone(trainer.adapter_tensors(name)) for name in ("proposer", "solver")}
            served = {name: greedy(router, name, prompt) for name in ("proposer", "solver")}
            metrics = trainer.train_step(with_rollout_logprobs(trainer, groups, noise=0.1, seed=0), 1)
            sync.push(trainer.export(), 1)
            after = {name: trainer.adapter_tensors(name) for name in ("proposer", "solver")}
            assert any(not torch.equal(before["proposer"][k], after["proposer"][k]) for k in after["proposer"])
            assert all(torch.equal(before["solver"][k], after["solver"][k]) for k in after["solver"])
            assert metrics["policy/proposer/train/samples"] == 8 and metrics["policy/solver/train/samples"] == 0
            assert "policy/proposer/train/grad_norm" in metrics
            assert greedy(router, "solver", prompt) == served["solver"]
            assert greedy(router, "proposer", prompt) != served["proposer"]
            assert {name: version(engine, name) for name in ("proposer", "solver")} == {"proposer": "1", "solver": "1"}
    both = [game(9, k) for k in range(2)]  # now both policies' turns, rewards spread for each
    for k, s in enumerate(both):
        s.reward = {"proposer": float(k), "solver": 1.0 - k}
    trainer.train_step(with_rollout_logprobs(trainer, [both], noise=0.1, seed=1), 2)
    state = trainer.state_dict()
    assert sorted(state["policies"]) == ["proposer", "solver"]
    resumed = TorchTrainer(cfg)  # each policy's adapter, optimiser and schedule round trip
    resumed.load_state_dict(state)
    for name in ("proposer", "solver"):
        mine, theirs = trainer.adapter_tensors(name), resumed.adapter_tensors(name)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert resumed.per_policy[name][1].last_epoch == trainer.per_policy[name][1].last_epoch == 2
    assert any(not torch.equal(before["solver"][k], resumed.adapter_tensors("solver")[k]) for k in before["solver"])


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_two_policy_game_learns_each_policy_its_own_way(tmp_path: Path, quickstart_sft: Path) -> None:
    """configs/policies_game.yaml (examples/policies_game.py) from the quickstart's warm start: each
    policy's reward rises as the game is designed (the proposer's digit reaches the list's largest
    more often, the solver names the largest more often), each policy's tokens were sampled by its
    own adapter (mismatch ~0: the other's or the base's log-probs differ by far more), the viewer
    shows each policy's reward, and the run ends with one adapter directory per policy. Measured
    (first 2 steps -> last 4 of 16, 4 runs, 2026-12-07): proposer 0.11-0.14 -> 0.49-0.62, solver
    0.09-0.12 -> 0.26-0.33; the solver's rise is the slow one (+0.16 at worst), hence its lower bar
    (about two standard errors of the two means over 128 samples a step)."""
    steps = 16
    proc = subprocess.run(
        quickstart_argv(tmp_path, f"steps={steps}", model=quickstart_sft, config="configs/policies_game.yaml"),
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "run") if "policy/solver/reward/mean" in r]
    assert len(rows) == steps
    shown = read_run(tmp_path / "run")["metrics"]
    for name, bar in (("proposer", 0.25), ("solver", 0.05)):
        curve = [r[f"policy/{name}/reward/mean"] for r in rows]
        print(f"{name}: reward {[round(c, 2) for c in curve]}")
        assert sum(curve[-4:]) / 4 >= sum(curve[:2]) / 2 + bar, (name, curve)
        assert max(r[f"policy/{name}/train/mismatch"] for r in rows) < 1e-4
        assert [m[f"policy/{name}/reward/mean"] for m in shown if m["step"] > 0] == pytest.approx(curve, abs=1e-4)
        assert (tmp_path / "run" / "hf" / name / "adapter_model.safetensors").is_file()


def test_rollout_calls_and_gateway_sessions_sample_the_named_policy(tiny_model_dir: Path, tmp_path_factory) -> None:
    """Two adapters that differ, pushed: a conversation whose turns name the proposer then the
    solver records each turn as its policy's, and each turn's engine log-probs are the trainer's
    under that policy's adapter (not the other's); an agent's gateway session opened for the
    solver is answered and recorded as the solver's."""
    cfg = config(tiny_model_dir, *POLICIES, TWO, "rollout.max_new_tokens=6", "rollout.temperature=0")
    torch.manual_seed(0)
    trainer = TorchTrainer(cfg)
    with torch.no_grad():  # adapters that differ from the base and from each other
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.3 * torch.randn_like(p))

    async def roll(router: str) -> tuple[Sample, list[Sample]]:
        runtime = await RolloutRuntime.create(cfg, router)
        try:
            sample = Sample(prompt="", group_id=0, index=0)
            ctx = RolloutContext(runtime, sample)
            messages = [{"role": "user", "content": "3 1 4"}]
            first = await ctx.chat(messages, policy="proposer")
            await ctx.chat([*messages, first.message, {"role": "user", "content": "1 5 9"}], policy="solver")
            with pytest.raises(ValueError, match="not one of the run's policies"):
                await ctx.generate([1, 2, 3], policy="judge")
            agent = RolloutContext(runtime, Sample(prompt="", group_id=0, index=1))
            async with httpx.AsyncClient() as http:
                url = await agent.openai_base_url(policy="solver")
                assert await agent.openai_base_url() == url  # naming none: the session's policy
                with pytest.raises(ValueError, match="session is answered by 'solver'"):
                    await agent.anthropic_base_url(policy="proposer")
                reply = await http.post(
                    url + "/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 6}
                )
                assert reply.status_code == 200, reply.text
            return sample, agent.captured_samples()
        finally:
            await runtime.close()

    with lora_pool(tiny_model_dir, tmp_path_factory) as (engine, router):
        with PolicySyncs(WeightSyncConfig(timeout_s=60), [engine], None, ["proposer", "solver"], router) as sync:
            sync.push(trainer.export(), 0)
        sample, (captured,) = asyncio.run(roll(router))
    turns = {name: [i for i, p in enumerate(sample.token_policies) if p == name] for name in ("proposer", "solver")}
    assert turns["proposer"] and turns["solver"] and turns["proposer"][-1] < turns["solver"][0]
    assert [p for p in captured.token_policies if p] == ["solver"] * sum(captured.loss_mask)
    for s, name, other in (
        (sample, "proposer", "solver"),
        (sample, "solver", "proposer"),
        (captured, "solver", "proposer"),
    ):
        mine = torch.tensor([p == name for p in s.token_policies])
        with trainer.use_policy(name):
            (own,) = trainer.logprobs([s])
        with trainer.use_policy(other):
            (theirs,) = trainer.logprobs([s])
        rollout = torch.tensor(s.rollout_logprobs)
        torch.testing.assert_close(rollout[mine], own[mine], atol=1e-4, rtol=0)
        assert (rollout[mine] - theirs[mine]).abs().max() > 1e-3, name
