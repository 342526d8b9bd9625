"""LoRA in the torch trainer (trainer.lora): only the adapter trains, the KL reference is the base
with the adapter off, checkpoints and exports hold the adapter, config errors name the field."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from test_trainer_torch import config, make_groups, with_rollout_logprobs
from transformers import AutoModelForCausalLM

from slimish.engine.config import EngineConfig
from slimish.engine.lora import LoraManager
from slimish.trainer import checkpoint
from slimish.trainer.config import LoraConfig
from slimish.trainer.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FUSED,
    add_adapter,
    expert_wrappers,
    load_adapter_tensors,
)
from slimish.trainer.torch_backend import TorchTrainer

LORA = ("trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.lr=1e-2")


def test_config_errors_name_the_field(tiny_model_dir):
    for override, message in [
        ("trainer.backend=megatron", "trainer.lora needs trainer.backend=torch"),
        ("algorithm.advantage=gae", "algorithm.advantage=gae with trainer.lora"),
        ("trainer.lora.rank=0", "trainer.lora.rank must be >= 1"),
        ("trainer.lora.dropout=1.0", "trainer.lora.alpha must be > 0 and dropout in"),
        ("trainer.lora.target_modules=[]", "trainer.lora.target_modules must name"),
        ("trainer.lora.name=a/b", "trainer.lora.name must be"),
    ]:
        with pytest.raises(SystemExit, match=message):
            config(tiny_model_dir, "trainer.lora.enabled=true", override)


def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model_dir):
    """Two RL steps with KL on: the base weights stay bit-equal, the adapter moves, the optimiser
    holds the adapter's parameters alone, and the reference log-probs are those of the plain HF
    model (no second copy of it: the reference has no parameters of its own)."""
    trainer = TorchTrainer(config(tiny_model_dir, *LORA, "algorithm.kl_coef=0.1"))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimised = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in optimised} == {id(p) for n, p in trainer.model.named_parameters() if n in trainable}
    assert list(trainer.ref.parameters()) == []  # the base under the adapter, switched off
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n not in trainable}
    adapter = {n: t.clone() for n, t in trainer.adapter_tensors().items()}
    for step, seed in ((1, 0), (2, 1)):
        metrics = trainer.train_step(with_rollout_logprobs(trainer, make_groups(seed), noise=0.1, seed=seed), step)
    assert metrics["train/kl"] > 0  # the adapter moved the policy away from the base
    assert all(torch.equal(base[n], p) for n, p in trainer.model.named_parameters() if n in base)
    after = trainer.adapter_tensors()
    assert after.keys() == adapter.keys() and all(k.startswith("base_model.model.") for k in after)
    assert max((after[k] - adapter[k]).abs().max().item() for k in after) > 1e-3
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    groups = make_groups(2)
    samples = [s for g in groups for s in g]
    for ref, hf in zip(trainer.logprobs(samples, trainer.ref), trainer.logprobs(samples, plain)):
        torch.testing.assert_close(ref, hf, atol=1e-5, rtol=0)
    policy = trainer.logprobs(samples)
    assert max((p - r).abs().max().item() for p, r in zip(policy, trainer.logprobs(samples, plain))) > 1e-3


def test_the_trainer_decides_what_a_push_carries(tiny_model_dir):
    """`export`, the one place that decides it: with trainer.lora the adapter alone (its PEFT
    tensors and adapter_config.json, never a base weight); without, every HF parameter."""
    lora = TorchTrainer(config(tiny_model_dir, *LORA))
    export = lora.export()
    tensors = dict(export.tensors)
    assert export.adapter_config == lora.adapter_config() and export.adapter_config["r"] == 4
    assert tensors.keys() == lora.adapter_tensors().keys() and all(".lora_" in k for k in tensors)
    full = TorchTrainer(config(tiny_model_dir))
    export = full.export()
    assert export.adapter_config is None
    assert [n for n, _ in export.tensors] == [n for n, _ in full.model.named_parameters()]


def test_checkpoint_round_trip_and_exports(tiny_model_dir, tmp_path):
    """The checkpoint holds the adapter (not the base) and its optimiser state: a trainer resumed
    from it takes a bit-identical next step. The export is a PEFT adapter directory that PEFT
    loads to the same log-probs, and with export_merged a plain HF model that gives them too."""
    overrides = (*LORA, "trainer.lora.export_merged=true")
    trainer = TorchTrainer(config(tiny_model_dir, *overrides))
    batches = [with_rollout_logprobs(trainer, make_groups(seed), noise=0.1, seed=seed) for seed in (0, 1)]
    trainer.train_step(batches[0], 1)
    state = trainer.state_dict()
    assert "model" not in state and state["adapter"].keys() == trainer.adapter_tensors().keys()
    saved_at = checkpoint.save(tmp_path / "run", 1, {"trainer": state}, keep=0)
    resumed = TorchTrainer(config(tiny_model_dir, *overrides))
    resumed.load_state_dict(checkpoint.load(saved_at)["trainer"])
    saved, loaded = trainer.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() and all(
        torch.equal(saved[k]["exp_avg_sq"], loaded[k]["exp_avg_sq"]) for k in saved
    )
    m, mr = trainer.train_step(batches[1], 2), resumed.train_step(batches[1], 2)
    assert m["train/loss"] == mr["train/loss"]
    a, b = trainer.adapter_tensors(), resumed.adapter_tensors()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="trainer.lora.enabled=False, but the checkpoint was saved by a run with LoRA"):
        TorchTrainer(config(tiny_model_dir)).load_state_dict(state)

    out = tmp_path / "hf"
    trainer.save_hf(str(out))
    assert json.loads((out / ADAPTER_CONFIG).read_text())["r"] == 4
    assert load_file(out / ADAPTER_WEIGHTS).keys() == a.keys()
    samples = [s for g in make_groups(3) for s in g]
    expected = trainer.logprobs(samples)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    for model in (peft_model, merged):
        for got, want in zip(trainer.logprobs(samples, model), expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


MOE_LORA = (*LORA, "trainer.lora.target_modules=[q_proj,gate_proj,up_proj,down_proj]")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_adapter_leaves_per_expert_and_the_engine_serves_it_equal(arch, request, tmp_path):
    """On a MoE model the experts train through PEFT's ParamWrapper (one A shared by gate and up);
    what leaves the trainer is per expert, SGLang's form: each expert's slice of PEFT's own delta,
    loaded by the engine's LoRA modules to the training model's log-probs (1e-5), resumed exactly,
    and (Qwen3-MoE, which PEFT's v4 converter knows) read back by PEFT to the same log-probs."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    trainer = TorchTrainer(config(model_dir, *MOE_LORA))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at 0: random A and B, so every delta shows
        for name, p in trainer.model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    tensors = trainer.adapter_tensors()
    wrappers = expert_wrappers(trainer.model)
    assert {w.parameter_name for _, w in wrappers.values()} == {"gate_up_proj", "down_proj"}
    for experts, w in wrappers.values():
        delta = w.get_delta_weight("default")  # [E, out, in], PEFT's own reading of its A and B
        for e in range(w.num_experts):
            pair = [tensors[f"{experts}.{e}.{p}.lora_{x}.weight"] for p in FUSED[w.parameter_name] for x in "AB"]
            per_expert = torch.cat([b @ a for a, b in zip(pair[::2], pair[1::2])]) * w.scaling["default"]
            torch.testing.assert_close(per_expert, delta[e], atol=1e-6, rtol=0)
            assert torch.equal(pair[0], pair[-2])  # gate's A is up's (and down's own A is down's)
    trainer.save_hf(str(tmp_path / "hf"))
    assert load_file(tmp_path / "hf" / ADAPTER_WEIGHTS).keys() == tensors.keys()

    served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lora = LoraManager(served, EngineConfig(model=str(model_dir), max_lora_rank=4, lora_paths=[f"t={tmp_path / 'hf'}"]))
    assert lora.acquire("t", set())
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 1, 4, 8, 8]])
    with torch.no_grad():
        want = torch.log_softmax(trainer.model(ids).logits, -1)
        with lora.rows(["t"]):
            torch.testing.assert_close(torch.log_softmax(served(ids).logits, -1), want, atol=1e-5, rtol=0)
        if arch == "qwen3_moe":
            peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "hf").eval()
            torch.testing.assert_close(torch.log_softmax(peft(ids).logits, -1), want, atol=1e-5, rtol=0)

    resumed = TorchTrainer(config(model_dir, *MOE_LORA))
    load_adapter_tensors(resumed.model, tensors)
    again = resumed.adapter_tensors()
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)
    up_a = next(k for k in tensors if ".experts.3.up_proj.lora_A" in k)
    with pytest.raises(ValueError, match="have different lora_A; the trainer's expert adapter shares one A"):
        load_adapter_tensors(resumed.model, {**tensors, up_a: tensors[up_a] + 1})


def test_moe_targets_refused_by_name(tiny_qwen3_moe_dir):
    """The router, half of the fused gate/up pair, and dropout on the experts (ParamWrapper has none)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir)
    for targets, dropout, message in [
        (["q_proj", "gate"], 0.0, r"trainer.lora.target_modules: \['gate'\] is the MoE router"),
        (["gate_proj", "down_proj"], 0.0, "gate_proj and up_proj are one fused parameter"),
        (["gate_proj", "up_proj"], 0.1, "trainer.lora.dropout=0.1: the experts' adapters"),
    ]:
        with pytest.raises(ValueError, match=message):
            add_adapter(model, LoraConfig(enabled=True, target_modules=targets, dropout=dropout))
