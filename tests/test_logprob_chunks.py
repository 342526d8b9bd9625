"""Chunked log-probs (`trainer.logprob_chunk_tokens`): the same log-probs, entropies, losses and
gradients as the full-logits path, without the micro-batch's full-vocabulary logits.

Tolerances: log-probs and entropies come out bit-identical on these models (the same functions
on the same logits rows); gradients differ by float32 summation order only (the LM head's
weight gradient is summed chunk by chunk), so they are compared relative to each tensor's scale.
"""

from __future__ import annotations

import pytest
import torch
from test_trainer_torch import FEATURES, config, make_groups, with_rollout_logprobs

import slimish.trainer.logprobs as logprobs_module
from slimish.trainer.logprobs import chunked_logprobs, entropy_from_logits, logprobs_from_logits
from slimish.trainer.torch_backend import TorchTrainer

TOL = 1e-6
F32 = "trainer.dtype=float32"  # bf16 is the default on a GPU, where these tolerances mean nothing


def close(a: torch.Tensor, b: torch.Tensor, rel: float = TOL) -> bool:
    """Within `rel` of the larger tensor's largest magnitude (at least 1)."""
    return (a - b).abs().max().item() <= rel * max(1.0, a.abs().max().item(), b.abs().max().item())


# -- the pure function ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 11, 100])
def test_chunked_logprobs_match_the_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    n, h, v, temperature = 11, 8, 50, 0.7
    leaves = [torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.randn(v, generator=g)]
    labels = torch.randint(0, v, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    results = []
    for chunked in (False, True):
        hidden, weight, bias = (t.clone().requires_grad_() for t in leaves)
        if chunked:
            lp, ent = chunked_logprobs(hidden, weight, labels, temperature, chunk, entropy=True, bias=bias)
        else:
            logits = torch.nn.functional.linear(hidden, weight, bias)
            lp, ent = logprobs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        results.append((lp.detach(), ent.detach(), hidden.grad, weight.grad, bias.grad))
    for full, chunked in zip(*results):
        assert close(full, chunked), (full - chunked).abs().max()


def test_chunked_logprobs_entropy_modes_and_bad_chunk():
    hidden, weight = torch.randn(5, 4, requires_grad=True), torch.randn(9, 4)
    labels = torch.zeros(5, dtype=torch.long)
    lp, ent = chunked_logprobs(hidden, weight, labels, chunk_tokens=2, entropy=False)
    assert ent is None and lp.requires_grad and lp.shape == (5,)
    lp, ent = chunked_logprobs(hidden, weight, labels, chunk_tokens=2, entropy=None)  # measured, no gradient
    assert not ent.requires_grad and ent.shape == (5,)
    with torch.no_grad():
        assert not chunked_logprobs(hidden, weight, labels, chunk_tokens=2)[0].requires_grad
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_logprobs(hidden, weight, labels, chunk_tokens=0)


# -- the torch trainer --------------------------------------------------------------------------


def _forward_and_grads(trainer: TorchTrainer, batch, entropy: bool | None):
    """`_forward`'s outputs (padding zeroed) and the parameter gradients of a loss that weighs
    every response token's log-prob and entropy differently."""
    mask = trainer._pad([torch.ones(s.response_length) for s in batch])
    lp, ent = trainer._forward(trainer.model, batch, entropy)
    lp, ent = lp.cpu(), None if ent is None else ent.cpu()
    g = torch.Generator().manual_seed(1)
    loss = (lp * torch.randn(lp.shape, generator=g) * mask).sum() / mask.sum()
    if entropy:
        loss = loss + (ent * torch.randn(ent.shape, generator=g) * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.cpu().clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)
    return lp.detach(), None if ent is None else ent.detach(), mask, grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied LM head
def test_chunked_forward_equals_the_full_path(arch, tiny_model_dir, tiny_qwen2_dir):
    """Samples of different lengths in one micro-batch (padding), chunks that split samples,
    one chunk for all, temperature scaling; with and without entropy gradients."""
    model_dir = tiny_model_dir if arch == "llama" else tiny_qwen2_dir
    batch = [s for g in make_groups(0) for s in g]
    lengths = [s.response_length for s in batch]
    assert len(set(lengths)) > 3 and max(lengths) > 5  # ragged, and chunk 5 splits samples
    trainers = {
        c: TorchTrainer(config(model_dir, f"trainer.logprob_chunk_tokens={c}", "rollout.temperature=0.7", F32))
        for c in (0, 1, 5, 1024)
    }
    for entropy in (True, None):
        full_lp, full_ent, mask, full_grads = _forward_and_grads(trainers[0], batch, entropy)
        for chunk in (1, 5, 1024):
            lp, ent, _, grads = _forward_and_grads(trainers[chunk], batch, entropy)
            assert close(full_lp * mask, lp) and (lp[mask == 0] == 0).all(), chunk
            assert close(full_ent * mask, ent) and (ent[mask == 0] == 0).all(), chunk
            for name, grad in full_grads.items():
                assert close(grad, grads[name]), (chunk, name, (grad - grads[name]).abs().max())
    full = trainers[0].logprobs(batch)  # no-grad path (old and reference log-probs)
    for chunk in (1, 5):
        for a, b in zip(full, trainers[chunk].logprobs(batch)):
            assert a.shape == b.shape and close(a.cpu(), b.cpu())


def test_train_step_metrics_equal_the_full_path(tiny_model_dir):
    """The whole RL step (KL, entropy bonus, clip-higher, TIS, dual clip, two updates, several
    micro-batches): loss, grad norm and the other metrics as with the full logits."""
    metrics = []
    for chunk in (0, 7):
        trainer = TorchTrainer(
            config(
                tiny_model_dir,
                f"trainer.logprob_chunk_tokens={chunk}",
                "trainer.micro_batch_tokens=60",
                "rollout.temperature=0.8",
                F32,
                *FEATURES,
            )
        )
        groups = with_rollout_logprobs(trainer, make_groups(2), noise=0.3, seed=2)
        metrics.append(trainer.train_step(groups, 1))
    for key in (
        "train/loss",
        "train/policy_loss",
        "train/grad_norm",
        "train/kl",
        "train/entropy",
        "train/clip_frac",
        "train/tis",
    ):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=TOL, abs=1e-7), key


def test_no_full_vocabulary_logits(tiny_model_dir, monkeypatch):
    """The HF LM head computes no logits, and no logits block has more rows than the chunk,
    in forward or in the recompute of backward."""
    rows: list[int] = []
    original = logprobs_module.logprobs_from_logits

    def recording(logits, labels, temperature=1.0):
        rows.append(logits.shape[0] if logits.dim() == 2 else -1)
        return original(logits, labels, temperature)

    monkeypatch.setattr(logprobs_module, "logprobs_from_logits", recording)
    trainer = TorchTrainer(config(tiny_model_dir, "trainer.logprob_chunk_tokens=4", F32))
    head_rows: list[int] = []
    trainer.model.get_output_embeddings().register_forward_hook(lambda m, a, out: head_rows.append(out.shape[-2]))
    batch = [s for g in make_groups(3) for s in g]
    lp, ent = trainer._forward(trainer.model, batch, entropy=True)
    forward_chunks = len(rows)
    assert forward_chunks == -(-sum(s.response_length for s in batch) // 4)
    (lp.sum() + ent.sum()).backward()
    assert len(rows) == 2 * forward_chunks  # each chunk recomputed once in backward
    assert max(rows) == 4 and min(rows) >= 1 and head_rows == [0]
