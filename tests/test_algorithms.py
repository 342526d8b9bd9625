"""slimish.trainer.advantages and .losses: hand-computed values, invariants, and TRL's own GRPO / RLOO code
run on identical inputs (TRL is the reference implementation most users know)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from slimish.trainer.advantages import compute_advantages
from slimish.trainer.config import AlgorithmConfig
from slimish.trainer.logprobs import entropy_from_logits, logprobs_from_logits
from slimish.trainer.losses import (
    importance_ratio,
    kl_penalty,
    loss_normalizer,
    mis_weights,
    ppo_clip_loss,
    reduce_loss,
    rl_loss,
    sequence_kl,
    sft_loss,
    tis_weights,
)

LN2, LN3 = math.log(2), math.log(3)


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def exact(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- Advantages ----------------------------------------------------------------------------------


def test_grpo_hand_computed():
    # group 0: mean 0.5, sample std sqrt(1/3); group 1: all equal -> exactly 0 (not NaN)
    adv = compute_advantages("grpo", t([[1, 0, 0, 1], [2, 2, 2, 2]]), eps=0.0)
    s = 0.5 / math.sqrt(1 / 3)
    exact(adv, [[s, -s, -s, s], [0, 0, 0, 0]])
    # flat input + group size: same values, flat shape back; eps enters the denominator
    flat = compute_advantages("grpo", t([1, 0, 0, 1, 2, 2, 2, 2]), group_size=4, eps=0.1)
    s = 0.5 / (math.sqrt(1 / 3) + 0.1)
    exact(flat, [s, -s, -s, s, 0, 0, 0, 0])
    assert compute_advantages("gspo", t([[1, 0, 0, 1]]), eps=0.0).tolist() == adv[:1].tolist()


def test_dr_grpo_rloo_reinforce_pp_hand_computed():
    exact(compute_advantages("dr_grpo", t([[1, 0, 0, 1], [3, 1, 2, 2]])), [[0.5, -0.5, -0.5, 0.5], [1, -1, 0, 0]])
    # leave-one-out: 3 - mean(1, 2) = 1.5, 1 - mean(3, 2) = -1.5, 2 - mean(3, 1) = 0
    exact(compute_advantages("rloo", t([[3, 1, 2], [1, 0, 0]])), [[1.5, -1.5, 0], [1, -0.5, -0.5]])
    # REINFORCE++: batch mean 5/8, batch sample std sqrt(1.875 / 7)
    r = t([1, 0, 0, 1, 1, 1, 1, 0])
    std = math.sqrt(1.875 / 7)
    hi, lo = 0.375 / std, -0.625 / std
    exact(compute_advantages("reinforce_pp", r, group_size=4, eps=0.0), [hi, lo, lo, hi, hi, hi, hi, lo])
    # -baseline: group-centred [.5 -.5 -.5 .5 | .25 .25 .25 -.75], batch mean 0, sample std 0.5
    exact(
        compute_advantages("reinforce_pp_baseline", r, group_size=4, eps=0.0),
        [1, -1, -1, 1, 0.5, 0.5, 0.5, -1.5],
    )


def test_advantage_invariants():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(16, 8, generator=g).round()  # 0/1 rewards: some groups all-equal
    rewards[3] = 1.0
    rewards[5] = 0.1  # float rounding must not turn "all equal" into a tiny nonzero std
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        adv = compute_advantages(name, rewards, eps=0.0)
        assert torch.isfinite(adv).all(), name
        exact(adv.mean(-1), torch.zeros(16), atol=1e-6)  # zero mean per group
        assert adv[3].abs().max() == 0 and adv[5].abs().max() == 0, name
    grpo = compute_advantages("grpo", rewards, eps=0.0)
    varied = rewards.std(-1) > 0
    exact(grpo[varied].std(-1), torch.ones(int(varied.sum())), atol=1e-5)
    # RLOO is GRPO-without-std scaled by K/(K-1)
    exact(compute_advantages("rloo", rewards), compute_advantages("dr_grpo", rewards) * 8 / 7)
    # one sample per group: no baseline to compare against -> 0, never NaN
    assert compute_advantages("grpo", t([[1.0], [0.0]])).tolist() == [[0.0], [0.0]]
    assert compute_advantages("reinforce_pp", t([[1.0]])).tolist() == [[0.0]]


def test_advantage_bad_input_names_the_field():
    with pytest.raises(ValueError, match="advantage: expected one of"):
        compute_advantages("ppo", t([[1, 0]]))
    with pytest.raises(ValueError, match="group_size: 3 does not divide"):
        compute_advantages("grpo", t([1, 0, 1, 0]), group_size=3)
    with pytest.raises(ValueError, match=r"rewards: expected \[n_groups, group_size\]"):
        compute_advantages("grpo", t([1, 0, 1, 0]))
    with pytest.raises(ValueError, match="rewards: must be finite"):
        compute_advantages("grpo", t([[1, float("nan")]]))
    with pytest.raises(TypeError, match="rewards: expected a floating-point tensor"):
        compute_advantages("grpo", torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="group_size: RLOO needs at least 2"):
        compute_advantages("rloo", t([[1.0], [0.0]]))


# --- Policy loss ---------------------------------------------------------------------------------

RATIOS = [0.5, 0.9, 1.0, 1.5, 4.0]


def _clip_case(adv: float, **kw):
    logprobs = torch.zeros(1, len(RATIOS), requires_grad=True)
    old = -t([RATIOS]).log()  # ratio = exp(logp - old) = RATIOS
    ratio = importance_ratio(logprobs, old, torch.ones(1, len(RATIOS)))
    loss, stats = ppo_clip_loss(ratio, t([adv]), eps_clip=0.2, eps_clip_high=0.28, **kw)
    loss.sum().backward()
    stats["ratio"] = ratio.detach()
    return loss.detach()[0], logprobs.grad[0], {k: v[0].tolist() for k, v in stats.items()}


def test_ppo_clip_positive_advantage_clips_high_only():
    loss, grad, stats = _clip_case(1.0)
    exact(loss, [-0.5, -0.9, -1.0, -1.28, -1.28])  # -min(r, clip(r, 0.8, 1.28))
    exact(grad, [-0.5, -0.9, -1.0, 0, 0])  # d(-r)/dlogp = -r; clipped tokens get no gradient
    assert stats["clip_high"] == [0, 0, 0, 1, 1] and stats["clip_low"] == [0] * 5
    exact(t(stats["ratio"]), RATIOS)


def test_ppo_clip_negative_advantage_clips_low_and_dual():
    loss, grad, stats = _clip_case(-1.0)
    exact(loss, [0.8, 0.9, 1.0, 1.5, 4.0])  # max(r, clip(r)): below 0.8 clipped, above never
    exact(grad, [0, 0.9, 1.0, 1.5, 4.0])
    assert stats["clip_low"] == [1, 0, 0, 0, 0] and stats["clip_high"] == [0] * 5
    assert stats["dual_clip"] == [0] * 5
    loss, grad, stats = _clip_case(-1.0, dual_clip_c=3.0)
    exact(loss, [0.8, 0.9, 1.0, 1.5, 3.0])  # bounded by -c A = 3
    exact(grad, [0, 0.9, 1.0, 1.5, 0])
    assert stats["dual_clip"] == [0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="dual_clip_c: must be > 1"):
        _clip_case(-1.0, dual_clip_c=0.5)


def test_gspo_sequence_ratio_value_and_gradient():
    # sample 0: log-ratios (ln 2, 0) -> s = sqrt 2, clipped at 1.2 for A > 0; sample 1: s = sqrt(1.1 * 0.9)
    old = t([[-LN2, 0.0, 0.0], [-math.log(1.1), -math.log(0.9), 5.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    logprobs = torch.zeros(2, 3, requires_grad=True)
    adv = t([1.0, -1.0])
    ratio = importance_ratio(logprobs, old, mask, level="sequence")
    loss, _ = ppo_clip_loss(ratio, adv)
    s1 = math.sqrt(1.1 * 0.9)
    exact(ratio.detach() * mask, [[math.sqrt(2), math.sqrt(2), 0], [s1, s1, 0]])
    exact(loss.detach() * mask, [[-1.2, -1.2, 0], [s1, s1, 0]])
    reduce_loss(loss, mask, "sample").backward()
    # sequence-level GSPO: mean over samples of -A * exp(mean log-ratio); sample 0 is clipped
    ref = torch.zeros(2, 3, requires_grad=True)
    seq = ((ref - old) * mask).sum(-1).div(2).exp()
    (-(adv[1] * seq[1]) / 2).backward()
    exact(logprobs.grad, ref.grad)
    exact(logprobs.grad, [[0, 0, 0], [s1 / 4, s1 / 4, 0]])


def test_padding_garbage_does_not_leak():
    logprobs = t([[-1.0, 0.0]])
    old = t([[-1.0, -1e4]])  # the padded position would overflow exp if it were used
    mask = t([[1, 0]])
    for level in ("token", "sequence"):
        loss, _ = ppo_clip_loss(importance_ratio(logprobs, old, mask, level), t([1.0]))
        assert torch.isfinite(loss).all() and reduce_loss(loss, mask, "token").item() == -1.0


# --- Reductions ----------------------------------------------------------------------------------


def test_reduction_hand_computed():
    values = t([[1, 2, 3], [4, 9, 9]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    exact(reduce_loss(values, mask, "token"), 2.5)  # (1+2+3+4)/4
    exact(reduce_loss(values, mask, "sample"), 3.0)  # (2 + 4)/2
    exact(reduce_loss(values, mask, "dr_grpo"), 10 / 6)  # / (B * T)
    exact(reduce_loss(values, mask, "token", normalizer=loss_normalizer("dr_grpo", 4, 2, 8)), 10 / 16)
    assert loss_normalizer("token", 4, 2) == 4 and loss_normalizer("sample", 4, 2) == 2
    with pytest.raises(ValueError, match="max_response_len"):
        loss_normalizer("dr_grpo", 4, 2)
    with pytest.raises(ValueError, match="loss_reduction: expected one of"):
        reduce_loss(values, mask, "mean")


@pytest.mark.parametrize("mode", ["token", "sample", "dr_grpo"])
def test_micro_batches_sum_to_the_full_batch(mode):
    """Split 7 samples into micro-batches of 3, 1 and 3 rows, each padded to its own length: with
    the global normaliser the shares (and their gradients) add up to the full-batch loss."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 3, 8, 2, 8, 4]
    T = max(lengths)
    mask = (torch.arange(T)[None] < t(lengths)[:, None]).float()
    logprobs = torch.randn(7, T, generator=g) * 0.3 - 1
    old = logprobs + torch.randn(7, T, generator=g) * 0.3
    ref = logprobs + torch.randn(7, T, generator=g) * 0.3
    entropy = torch.rand(7, T, generator=g)
    adv = torch.randn(7, generator=g)
    cfg = AlgorithmConfig(loss_reduction=mode, eps_clip_high=0.28, dual_clip_c=3.0, kl_coef=0.1, entropy_coef=0.01)
    norm = loss_normalizer(mode, int(mask.sum()), 7, max_response_len=10)

    def run(rows: slice):
        lp = logprobs[rows, : max(lengths[rows])].clone().requires_grad_(True)
        cut = lambda x: x[rows, : lp.shape[1]]  # noqa: E731
        loss, stats = rl_loss(
            cfg, lp, cut(old), adv[rows], cut(mask), norm, ref_logprobs=cut(ref), entropy=cut(entropy)
        )
        loss.backward()
        grad = torch.zeros(lp.shape[0], T)
        grad[:, : lp.shape[1]] = lp.grad
        return loss.detach(), stats, grad

    full, full_stats, full_grad = run(slice(0, 7))
    parts = [run(slice(a, b)) for a, b in ((0, 3), (3, 4), (4, 7))]
    exact(sum(p[0] for p in parts), full)
    exact(torch.cat([p[2] for p in parts]), full_grad)
    for key, value in full_stats.items():
        exact(sum(p[1][key] for p in parts), value, atol=1e-5)
    assert full_stats["tokens"] == sum(lengths)


# --- KL, TIS, entropy, logprobs, SFT ------------------------------------------------------------


def test_kl_estimators_hand_computed():
    logprobs, ref = t([[math.log(0.5), 0.0]]), t([[math.log(0.25), 0.0]])  # log ratio ln 2, then 0
    exact(kl_penalty(logprobs, ref, "k1"), [[LN2, 0]])
    exact(kl_penalty(logprobs, ref, "k2"), [[LN2**2 / 2, 0]])
    exact(kl_penalty(logprobs, ref, "k3"), [[0.5 + LN2 - 1, 0]])  # exp(-ln2) + ln2 - 1
    seq = sequence_kl(t([[-1.0, -2.0, -3.0]]).requires_grad_(True), t([[-1.5, -1.0, 0.0]]), t([[1, 1, 0]]))
    exact(seq, [0.5 - 1.0])  # k1 summed over trained tokens, no gradient: it is a reward
    assert not seq.requires_grad
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logprobs, ref, "k4")


def test_tis_weights_truncate_and_detach():
    old = t([[LN3, math.log(0.5), math.log(1.5), 7.0]]).requires_grad_(True)
    w = tis_weights(old, torch.zeros(1, 4), t([[1, 1, 1, 0]]), cap=2.0)
    exact(w, [[2.0, 0.5, 1.5, 1.0]])  # min(ratio, cap); 1 where masked
    assert not w.requires_grad


def test_mis_weights_mask_what_tis_would_truncate():
    old = t([[LN3, math.log(0.5), math.log(1.5), 7.0]])
    exact(mis_weights(old, torch.zeros(1, 4), t([[1, 1, 1, 0]]), cap=2.0), [[0.0, 0.5, 1.5, 1.0]])  # 3 > cap: dropped
    cfg = AlgorithmConfig(mis_cap=2.0)
    ones = torch.ones(1, 4)
    _, stats = rl_loss(cfg, old.clone(), old.clone(), ones, t([[1, 1, 1, 0]]), rollout_logprobs=torch.zeros(1, 4))
    exact(stats["tis"], 2.0)  # 0 + 0.5 + 1.5 over the trained tokens
    with pytest.raises(ValueError, match="set one importance-sampling correction"):
        AlgorithmConfig(tis_cap=2.0, mis_cap=2.0)


def test_entropy_logprobs_sft_hand_computed():
    logits = t([[[0.0, 0.0], [0.0, LN3]]])  # p = (.5, .5) and (.25, .75)
    exact(entropy_from_logits(logits), [[LN2, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    exact(entropy_from_logits(logits * 2, temperature=2.0), entropy_from_logits(logits))
    exact(logprobs_from_logits(logits, torch.tensor([[0, 1]])), [[-LN2, math.log(0.75)]])
    exact(logprobs_from_logits(logits * 2, torch.tensor([[0, 1]]), temperature=2.0), [[-LN2, math.log(0.75)]])
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3, 5, 50, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 50, (3, 5), generator=g)
    expected = torch.log_softmax(big.float(), -1).gather(-1, labels[..., None])[..., 0]
    exact(logprobs_from_logits(big, labels), expected)  # computed in fp32 from bf16 logits
    sft = sft_loss(t([[-LN2, -2 * LN2], [-LN2, -9.0]]), t([[1, 1], [1, 0]]))
    exact(sft, 4 * LN2 / 3)


# --- The composed loss ---------------------------------------------------------------------------


def test_rl_loss_composes_and_checks_inputs():
    g = torch.Generator().manual_seed(2)
    logprobs = torch.randn(3, 4, generator=g) - 1
    old, ref, rollout = (logprobs + torch.randn(3, 4, generator=g) * 0.2 for _ in range(3))
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0]])
    entropy = torch.rand(3, 4, generator=g)
    adv = t([1.0, -0.5, 2.0])
    cfg = AlgorithmConfig(loss_reduction="sample", kl_coef=0.2, kl_estimator="k2", entropy_coef=0.05, tis_cap=1.5)
    loss, stats = rl_loss(cfg, logprobs, old, adv, mask, ref_logprobs=ref, rollout_logprobs=rollout, entropy=entropy)
    pg, _ = ppo_clip_loss(importance_ratio(logprobs, old, mask), adv)
    w = tis_weights(old, rollout, mask, 1.5)
    red = lambda x: reduce_loss(x, mask, "sample")  # noqa: E731
    expected = red(pg * w) + 0.2 * red(kl_penalty(logprobs, ref, "k2")) - 0.05 * red(entropy)
    exact(loss, expected)
    exact(stats["loss/policy"] + stats["loss/kl"] + stats["loss/entropy"], loss)
    exact(stats["tis"], (w * mask).sum())
    assert stats["tokens"] == 8
    # kl in the reward: no loss term, but the KL is still reported
    in_reward = replace(cfg, kl_in_reward=True, entropy_coef=0.0, tis_cap=None)
    loss_r, stats_r = rl_loss(in_reward, logprobs, old, adv, mask, ref_logprobs=ref)
    exact(loss_r, red(pg))
    assert "loss/kl" not in stats_r and stats_r["kl"] > 0
    with pytest.raises(ValueError, match="ref_logprobs: needed"):
        rl_loss(cfg, logprobs, old, adv, mask, rollout_logprobs=rollout, entropy=entropy)
    with pytest.raises(ValueError, match="rollout_logprobs: needed"):
        rl_loss(cfg, logprobs, old, adv, mask, ref_logprobs=ref, entropy=entropy)
    with pytest.raises(ValueError, match="entropy: needed"):
        rl_loss(cfg, logprobs, old, adv, mask, ref_logprobs=ref, rollout_logprobs=rollout)


def test_algorithm_config_validates_names():
    with pytest.raises(ValueError, match="algorithm.loss_reduction must be one of"):
        AlgorithmConfig(loss_reduction="mean")
    with pytest.raises(ValueError, match="algorithm.advantage must be one of"):
        AlgorithmConfig(advantage="ppo")
    with pytest.raises(ValueError, match="algorithm.dual_clip_c must be > 1"):
        AlgorithmConfig(dual_clip_c=1.0)


# --- Against TRL's own code ---------------------------------------------------------------------
# TRL computes its loss from its fused LM head; we take the same model's ordinary logits through
# `logprobs_from_logits` / `entropy_from_logits`, then `rl_loss`, and compare loss and gradients.

B, P, T, MAX_COMPLETION = 8, 5, 6, 8


def _trl_trainer(kind: str, model_dir, out_dir, reward_fn, **kwargs):
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    config_cls, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    args = config_cls(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=B,
        num_generations=4,
        max_completion_length=MAX_COMPLETION,
        save_strategy="no",
        seed=0,
        **kwargs,
    )
    data = Dataset.from_list([{"prompt": f"p{i}: 1+{i}="} for i in range(B)])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return trainer_cls(
        model=str(model_dir), reward_funcs=reward_fn, args=args, train_dataset=data, processing_class=tokenizer
    )


def _our_logprobs(model, inputs, temperature: float = 1.0):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, inputs["prompt_ids"].shape[1] - 1 : -1]
    labels = inputs["completion_ids"]
    return logprobs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _loss_inputs(model, vocab: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded completions of several lengths, old and reference
    logprobs perturbed so that the clip is active on both sides."""
    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(10, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[::3, :2] = 0
    completion_ids = torch.randint(10, vocab, (B, T), generator=g)
    lengths = torch.tensor([6, 2, 5, 6, 1, 4, 6, 3])
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    inputs = dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=completion_mask
    )
    with torch.no_grad():
        logps, _ = _our_logprobs(model, inputs)
    inputs["advantages"] = torch.randn(B, generator=g)
    row_shift = (torch.rand(B, 1, generator=g) - 0.5) * 0.8  # moves GSPO's per-sample ratios too
    inputs["old_per_token_logps"] = logps + (torch.rand(B, T, generator=g) - 0.5) * 0.8 + row_shift
    inputs["ref_per_token_logps"] = logps + (torch.rand(B, T, generator=g) - 0.5) * 0.8
    inputs["num_items_in_batch"] = completion_mask.sum() * 3  # as if this were a third of the global batch
    return inputs


# (TRL GRPOConfig kwargs, our AlgorithmConfig kwargs, our normaliser from the inputs)
LOCAL = lambda x: None  # noqa: E731  (the micro-batch's own normaliser)
TRL_CASES = {
    "grpo": (dict(loss_type="grpo"), dict(loss_reduction="sample"), LOCAL),
    "bnpo+clip_higher": (
        dict(loss_type="bnpo", epsilon_high=0.28),
        dict(loss_reduction="token", eps_clip_high=0.28),
        LOCAL,
    ),
    "dr_grpo": (
        dict(loss_type="dr_grpo"),
        dict(loss_reduction="dr_grpo"),
        lambda x: loss_normalizer("dr_grpo", 0, B, MAX_COMPLETION),  # TRL: B x max_completion_length
    ),
    "dapo_global_tokens": (
        dict(loss_type="dapo"),
        dict(loss_reduction="token"),
        lambda x: float(x["num_items_in_batch"]),
    ),
    "grpo+kl_k3": (
        dict(loss_type="grpo", beta=0.05, use_bias_correction_kl=False),
        dict(loss_reduction="sample", kl_coef=0.05, kl_estimator="k3"),
        LOCAL,
    ),
    "bnpo+weighted_kl+entropy+temperature": (
        dict(loss_type="bnpo", beta=0.1, entropy_coef=0.02, temperature=0.7),  # use_bias_correction_kl: default True
        dict(loss_reduction="token", kl_coef=0.1, kl_importance_weight=True, entropy_coef=0.02),
        LOCAL,
    ),
    "gspo": (
        dict(loss_type="grpo", importance_sampling_level="sequence"),
        dict(loss="gspo", loss_reduction="sample"),
        LOCAL,
    ),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers deprecations inside TRL
@pytest.mark.parametrize("case", list(TRL_CASES))
def test_loss_matches_trl_grpo_trainer(case, tiny_model_dir, tmp_path):
    trl_kwargs, our_kwargs, normalizer = TRL_CASES[case]
    trainer = _trl_trainer(
        "grpo", tiny_model_dir, tmp_path, lambda completions, **_: [0.0] * len(completions), **trl_kwargs
    )
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() for each optimiser step
    inputs = _loss_inputs(model, model.config.vocab_size)
    temperature = trl_kwargs.get("temperature", 1.0)

    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = _grads(model)
    model.zero_grad()

    cfg = AlgorithmConfig(**our_kwargs)
    logprobs, entropy = _our_logprobs(model, inputs, temperature)
    mask = inputs["completion_mask"]
    ours, stats = rl_loss(
        cfg,
        logprobs,
        inputs["old_per_token_logps"],
        inputs["advantages"],
        mask,
        normalizer(inputs),
        ref_logprobs=inputs["ref_per_token_logps"],
        entropy=entropy,
    )
    ours.backward()

    assert abs(ours.item() - trl_loss.item()) <= 1e-6, (ours.item(), trl_loss.item())
    assert_close(_grads(model), trl_grads, atol=1e-6, rtol=1e-5)
    # the case has power: both clip sides are active (GSPO: one ratio per sample)
    assert stats["clip_low"] > 0 and stats["clip_high"] > 0
    # and our logprobs are TRL's (fused, tiled LM head) on the trained tokens
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], mask], 1)
        trl_logps, trl_entropy, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, attention, T, compute_entropy=True
        )
    m = mask.bool()
    assert_close(logprobs.detach()[m], trl_logps[m], atol=1e-6, rtol=0)
    assert_close(entropy.detach()[m], trl_entropy[m], atol=1e-6, rtol=0)


def _recorded_reward():
    """Rewards TRL computes, recorded: prompt p0's group all-equal (zero std), others varied."""
    seen: list[float] = []

    def reward(prompts, completions, **_):
        pairs = enumerate(zip(prompts, completions))
        out = [1.0 if p.startswith("p0:") else float(len(c) % 3) + 0.25 * (i % 2) for i, (p, c) in pairs]
        seen.extend(out)
        return out

    return reward, seen


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("scale, ours", [("group", "grpo"), ("none", "dr_grpo")])
def test_advantages_match_trl_grpo_trainer(scale, ours, tiny_model_dir, tmp_path):
    reward, seen = _recorded_reward()
    trainer = _trl_trainer("grpo", tiny_model_dir, tmp_path, reward, scale_rewards=scale)
    data = trainer.train_dataset
    batch = [data[0]] * 4 + [data[1]] * 4  # as TRL's sampler repeats each prompt num_generations times
    out = trainer._generate_and_score_completions(batch)
    rewards = torch.tensor(seen)
    assert len(set(seen[:4])) == 1 and len(set(seen[4:])) > 1
    assert_close(compute_advantages(ours, rewards, group_size=4, eps=1e-4), out["advantages"], atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_rloo_advantages_with_kl_in_reward_match_trl(tiny_model_dir, tmp_path):
    """TRL's RLOO subtracts beta * sum_t k1(old, ref) from the reward before the leave-one-out
    baseline: our `sequence_kl` + `compute_advantages("rloo")` on our own logprobs."""
    reward, seen = _recorded_reward()
    trainer = _trl_trainer("rloo", tiny_model_dir, tmp_path, reward, beta=0.1)
    with torch.no_grad():  # move the policy away from the reference so the KL is not zero
        g = torch.Generator().manual_seed(4)
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    data = trainer.train_dataset
    out = trainer._generate_and_score_completions([data[0]] * 4 + [data[2]] * 4)
    with torch.no_grad():
        old, _ = _our_logprobs(trainer.model, out)
        ref, _ = _our_logprobs(trainer.ref_model, out)
    kl = sequence_kl(old, ref, out["completion_mask"], "k1")
    assert kl.abs().min() > 1e-3
    shaped = torch.tensor(seen) - 0.1 * kl
    assert_close(compute_advantages("rloo", shaped, group_size=4), out["advantages"], atol=1e-6, rtol=0)
