"""TinkerModels (slimish/tinker/training.py): the Tinker server's training state, without HTTP.

What is shown: the log-probs and gradients of a forward_backward equal a plain full-logits PEFT
computation (LoRA on the LM head included); several models on one base are isolated (trained
interleaved, each equals itself trained alone); gradients accumulate until optim_step; a state
saved with its optimizer resumes exactly; an exported adapter is the model PEFT loads; bad calls
are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from slimish.tinker.training import AdamParams, Datum, TinkerModels

ADAM = AdamParams(learning_rate=0.05, weight_decay=0.01, grad_clip_norm=5.0)


def sft_datums(seed: int, n: int = 3, vocab: int = 200) -> list[Datum]:
    """`n` datums of different lengths (so rows pad in one forward) with arbitrary-sign weights."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        seq = rng.integers(0, vocab, 6 + 3 * i).tolist()
        weights = rng.normal(size=len(seq) - 1).astype(np.float32)
        out.append(Datum(seq[:-1], {"target_tokens": np.array(seq[1:]), "weights": weights}))
    return out


def rl_datums(seed: int, models: TinkerModels, model_id: str) -> list[Datum]:
    """Datums for importance sampling whose sampler logprobs are the model's own, shifted a little."""
    rng = np.random.default_rng(seed)
    data = sft_datums(seed)
    outputs, _ = models.forward_backward(model_id, data, "cross_entropy", forward_only=True)
    return [
        Datum(
            d.tokens,
            {
                "target_tokens": d.inputs["target_tokens"],
                "logprobs": (o["logprobs"] + rng.normal(scale=0.1, size=len(d.tokens))).astype(np.float32),
                "advantages": rng.normal(size=len(d.tokens)).astype(np.float32),
            },
        )
        for d, o in zip(data, outputs)
    ]


def adapter(models: TinkerModels, model_id: str) -> dict[str, torch.Tensor]:
    """The model's adapter tensors, by PEFT name (its own names, whatever its PEFT adapter name)."""
    from slimish.trainer.lora import adapter_tensors

    return {k: v.clone() for k, v in adapter_tensors(models.peft, models.models[model_id].adapter).items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k, value in a.items():
        torch.testing.assert_close(value, b[k], atol=atol, rtol=0, msg=k)


def randomize(models: TinkerModels, model_id: str, seed: int) -> None:
    """Nonzero A and B everywhere (a fresh adapter's B is 0), so the adapter shapes every logprob."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in models.models[model_id].params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def models(tiny_model_dir) -> TinkerModels:
    return TinkerModels(tiny_model_dir, chunk_tokens=7)  # chunks that split datums


def test_logprobs_and_gradients_equal_a_full_logits_peft_computation(models, tiny_model_dir):
    """Right-padded rows, chunked LM head with the adapter's head delta: the same numbers as PEFT's
    own forward over the full logits, one row at a time, for cross-entropy with top-K targets."""
    models.create("ref", rank=4, seed=0)
    randomize(models, "ref", 1)
    data = sft_datums(1)
    top_k = Datum(data[0].tokens, {"target_tokens": np.stack([data[0].inputs["target_tokens"]] * 2, axis=1)})
    top_k.inputs["weights"] = np.ones(top_k.inputs["target_tokens"].shape, np.float32) * [1.0, -0.5]
    data.append(top_k)
    outputs, metrics = models.forward_backward("ref", data, "cross_entropy")
    got_grads = [p.grad.clone() for p in models.models["ref"].params]
    models.models["ref"].optimizer.zero_grad(set_to_none=True)

    peft = models.peft  # the same modules, through PEFT's own forward and full logits
    total = 0.0
    for d, out in zip(data, outputs):
        logits = peft(input_ids=torch.tensor([d.tokens])).logits[0]
        targets = torch.as_tensor(d.inputs["target_tokens"])
        flat = targets.reshape(len(d.tokens), -1)
        lp = torch.log_softmax(logits, -1).gather(1, flat).view(targets.shape)
        loss = -(lp * torch.as_tensor(d.inputs["weights"])).sum()
        loss.backward()
        total += loss.item()
        np.testing.assert_allclose(out["logprobs"], lp.detach().numpy(), atol=1e-5)
        assert out["logprobs"].shape == targets.shape and out["logprobs"].dtype == np.float32
    assert metrics["loss:sum"] == pytest.approx(total, abs=1e-4)
    params = models.models["ref"].params
    assert any("lm_head" in n for n, p in peft.named_parameters() if any(p is q for q in params))
    for got, p in zip(got_grads, params):
        torch.testing.assert_close(got, p.grad, atol=1e-5, rtol=1e-4)
    models.release("ref")


def run(models: TinkerModels, model_id: str, step: int) -> None:
    """One step of a model's script: two forward_backward calls (accumulated), then optim_step."""
    if model_id.startswith("rl"):
        models.forward_backward(model_id, rl_datums(step, models, model_id), "importance_sampling")
    else:
        models.forward_backward(model_id, sft_datums(step), "cross_entropy")
    models.forward_backward(model_id, sft_datums(100 + step, n=1), "cross_entropy")
    models.optim_step(model_id, ADAM)


def test_models_trained_interleaved_equal_each_trained_alone(tiny_model_dir):
    """Two models on one base, their calls interleaved (a forward_backward of one between the
    other's forward_backward and optim_step): each ends where it ends when trained alone."""
    specs = {"sl": {"rank": 4, "seed": 1}, "rl": {"rank": 2, "seed": 2, "train_mlp": False, "train_unembed": False}}
    together = TinkerModels(tiny_model_dir)
    for model_id, spec in specs.items():
        together.create(model_id, **spec)
    for step in range(3):
        together.forward_backward("sl", sft_datums(step), "cross_entropy")
        run(together, "rl", step)  # between sl's two forward_backward calls
        together.forward_backward("sl", sft_datums(100 + step, n=1), "cross_entropy")
        together.optim_step("sl", ADAM)
    for model_id, spec in specs.items():
        alone = TinkerModels(tiny_model_dir)
        alone.create(model_id, **spec)
        for step in range(3):
            run(alone, model_id, step)
        trained = adapter(alone, model_id)
        assert_same(adapter(together, model_id), trained)
        assert any(t.abs().max() > 0 for k, t in trained.items() if "lora_B" in k)  # it trained


def test_gradients_accumulate_until_optim_step(models):
    """forward_backward twice then optim_step = one forward_backward of both batches (losses are
    sums); a forward-only call adds no gradient."""
    for model_id in ("split", "whole"):
        models.create(model_id, rank=4, seed=3)
    a, b = sft_datums(5), sft_datums(6)
    models.forward_backward("split", a, "cross_entropy")
    models.forward_backward("split", b, "cross_entropy", forward_only=True)
    models.forward_backward("split", b, "cross_entropy")
    models.forward_backward("whole", a + b, "cross_entropy")
    for model_id in ("split", "whole"):
        models.optim_step(model_id, ADAM)
    assert_same(adapter(models, "split"), adapter(models, "whole"))
    for model_id in ("split", "whole"):
        models.release(model_id)


def test_resume_with_optimizer_continues_like_an_uninterrupted_run(models, tiny_model_dir, tmp_path):
    models.create("run", rank=4, seed=4)
    for step in range(2):
        run(models, "run", step)
    models.save_state("run", tmp_path / "state", optimizer=True)
    models.save_state("run", tmp_path / "weights-only", optimizer=False)
    run(models, "run", 2)
    uninterrupted = adapter(models, "run")

    resumed = TinkerModels(tiny_model_dir, chunk_tokens=7)
    resumed.load_state("session:train:0", tmp_path / "state", optimizer=True)
    assert resumed.spec("session:train:0") == models.spec("run")
    run(resumed, "session:train:0", 2)
    assert_same(adapter(resumed, "session:train:0"), uninterrupted)

    # Without the optimizer state the next step is another one (fresh Adam moments).
    resumed.load_state("session:train:0", tmp_path / "weights-only", optimizer=False)
    run(resumed, "session:train:0", 2)
    fresh = adapter(resumed, "session:train:0")
    assert max((fresh[k] - uninterrupted[k]).abs().max().item() for k in fresh) > 1e-4
    with pytest.raises(ValueError, match="saved without the optimizer state"):
        resumed.load_state("session:train:0", tmp_path / "weights-only", optimizer=True)
    models.save_state("run", tmp_path / "state", optimizer=False)  # over a save with the optimizer: none now
    with pytest.raises(ValueError, match="saved without the optimizer state"):
        models.load_state("run", tmp_path / "state", optimizer=True)
    models.release("run")


def test_exported_adapter_is_the_model_peft_loads(models, tiny_model_dir, tmp_path):
    """export_adapter writes a PEFT adapter directory (A, B, LM head included, no base weights)
    whose PeftModel gives the logprobs forward_backward reports."""
    models.create("export", rank=4, seed=5)
    randomize(models, "export", 6)
    data = sft_datums(7, n=1)
    outputs, _ = models.forward_backward("export", data, "cross_entropy", forward_only=True)
    path = models.export_adapter("export", tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, path).eval()
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor([data[0].tokens])).logits[0]
    lp = torch.log_softmax(logits, -1).gather(1, torch.as_tensor(data[0].inputs["target_tokens"])[:, None])[:, 0]
    np.testing.assert_allclose(outputs[0]["logprobs"], lp.numpy(), atol=1e-5)
    from safetensors.torch import load_file

    names = load_file(str(path / "adapter_model.safetensors")).keys()
    assert any("lm_head.lora_B" in n for n in names) and all("lora_" in n for n in names)
    models.release("export")


def test_bad_calls_are_refused_by_name(models):
    models.create("x", rank=2, seed=0)
    with pytest.raises(ValueError, match="model_id 'x': already exists"):
        models.create("x", rank=2)
    with pytest.raises(KeyError, match="model_id 'nope': no such model"):
        models.optim_step("nope", ADAM)
    with pytest.raises(ValueError, match="train_attn, train_mlp and train_unembed are all false"):
        models.create("y", rank=2, train_attn=False, train_mlp=False, train_unembed=False)
    big = Datum([1, 2], {"target_tokens": np.array([3, models.vocab_size]), "weights": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match=r"datum 1: loss_fn_inputs\['target_tokens'\] has token ids outside"):
        models.forward_backward("x", sft_datums(0, n=1) + [big], "cross_entropy")
    with pytest.raises(ValueError, match="loss_fn 'stable_reinforce' is not supported"):
        models.forward_backward("x", sft_datums(0, n=1), "stable_reinforce")
    with pytest.raises(ValueError, match=r"adam_params.beta2: must be in \[0, 1\)"):
        AdamParams(beta2=1.0)
    assert all(p.grad is None for p in models.models["x"].params)  # refused calls leave no gradient
    models.release("x")
    with pytest.raises(KeyError):
        models.spec("x")
