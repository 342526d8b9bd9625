"""The Tinker losses (slimish/tinker/losses.py) on hand-built datums: each loss's value and its
gradient with respect to the trained log-probs equal an independent computation of the formula
in Tinker's loss documentation, written out here, within 1e-6; bad inputs are refused by name."""

from __future__ import annotations

import pytest
import torch

from slimish.tinker.losses import check_inputs, check_loss, datum_loss

N = 12


def rl_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Sampler logprobs 0.7 nats around the trained ones: ratios from ~0.5 to ~2, so both PPO clip
    bounds bind on some tokens; advantages of both signs, zero on two 'prompt' positions."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(N, generator=g, dtype=torch.float64) * 3
    old = lp + (torch.rand(N, generator=g, dtype=torch.float64) - 0.5) * 1.4
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    adv[:2] = 0.0
    mask = torch.ones(N, dtype=torch.float64)
    mask[:2] = 0.0
    return {
        "lp": lp,
        "target_tokens": torch.arange(N),
        "logprobs": old,
        "advantages": adv,
        "sequence_ratio_mask": mask,
    }


def value_and_grad(fn, lp: torch.Tensor) -> tuple[float, torch.Tensor]:
    leaf = lp.clone().requires_grad_(True)
    loss = fn(leaf)
    loss.backward()
    return loss.item(), leaf.grad


def ppo_reference(ratio, adv, lo, hi):
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()


# Tinker's documented formulas, independent of slimish's code: (loss_fn, config, reference(lp, inputs)).
CASES = {
    "importance_sampling": ({}, lambda lp, x: -(torch.exp(lp - x["logprobs"]) * x["advantages"]).sum()),
    "ppo_default": ({}, lambda lp, x: ppo_reference(torch.exp(lp - x["logprobs"]), x["advantages"], 0.8, 1.2)),
    "ppo": (
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05},
        lambda lp, x: ppo_reference(torch.exp(lp - x["logprobs"]), x["advantages"], 0.9, 1.05),
    ),
    "cispo": (
        {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
        lambda lp, x: -(torch.clamp(torch.exp(lp - x["logprobs"]), 0.7, 1.3).detach() * lp * x["advantages"]).sum(),
    ),
    "dro": (
        {"beta": 0.05},
        lambda lp, x: -(lp * x["advantages"] - 0.5 * 0.05 * (lp - x["logprobs"]) ** 2).sum(),
    ),
    "gspo": ({}, None),  # below: the sequence ratio needs a few lines
}


def gspo_reference(lp: torch.Tensor, x: dict[str, torch.Tensor], lo: float = 0.8, hi: float = 1.2) -> torch.Tensor:
    keep = x["sequence_ratio_mask"] != 0
    log_ratio = (lp.detach() - x["logprobs"])[keep].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())
    return ppo_reference(ratio, x["advantages"], lo, hi)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rl_loss_value_and_gradient_equal_the_documented_formula(case):
    config, reference = CASES[case]
    reference = reference or gspo_reference
    loss_fn = case.removesuffix("_default")
    x = rl_inputs()
    inputs = {k: v for k, v in x.items() if k != "lp" and (k != "sequence_ratio_mask" or loss_fn == "gspo")}
    check_loss(loss_fn, config)
    check_inputs(loss_fn, N, inputs)
    got, got_grad = value_and_grad(lambda lp: datum_loss(loss_fn, lp, inputs, config), x["lp"])
    want, want_grad = value_and_grad(lambda lp: reference(lp, x), x["lp"])
    assert got == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=0)
    assert got_grad.abs().max() > 0.01  # the gradient is not trivially zero


def test_ppo_clips_on_both_sides_in_these_datums():
    """The PPO cases have power: some tokens' ratios leave [0.8, 1.2] on each side where the
    advantage's sign makes the clipped branch the one min() takes, so its gradient is 0 there."""
    x = rl_inputs()
    ratio = torch.exp(x["lp"] - x["logprobs"])
    adv = x["advantages"]
    assert ((ratio > 1.2) & (adv > 0)).any() and ((ratio < 0.8) & (adv < 0)).any()
    inputs = {k: x[k] for k in ("target_tokens", "logprobs", "advantages")}
    _, grad = value_and_grad(lambda lp: datum_loss("ppo", lp, inputs, {}), x["lp"])
    clipped = ((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    assert (grad[clipped] == 0).all() and (grad[~clipped & (adv != 0)] != 0).all()


def test_gspo_ratio_is_the_masked_sequence_mean():
    """Only `sequence_ratio_mask` positions set the sequence ratio: changing the sampler's
    logprobs off the mask changes nothing; on the mask it does."""
    x = rl_inputs()
    inputs = {k: x[k] for k in ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")}
    base = datum_loss("gspo", x["lp"], inputs, {}).item()
    off = dict(inputs, logprobs=inputs["logprobs"].clone())
    off["logprobs"][:2] -= 5.0
    on = dict(inputs, logprobs=inputs["logprobs"].clone())
    on["logprobs"][5] -= 0.3
    assert datum_loss("gspo", x["lp"], off, {}).item() == pytest.approx(base, abs=1e-12)
    assert datum_loss("gspo", x["lp"], on, {}).item() != pytest.approx(base, abs=1e-6)


def test_per_datum_clip_thresholds_override_the_config():
    x = rl_inputs()
    inputs = {k: x[k] for k in ("target_tokens", "logprobs", "advantages")}
    per_datum = dict(inputs, clip_low_threshold=torch.full((N,), 0.9, dtype=torch.float64))
    per_datum["clip_high_threshold"] = torch.tensor([1.05], dtype=torch.float64)  # a scalar broadcasts
    check_inputs("ppo", N, per_datum)
    got = datum_loss("ppo", x["lp"], per_datum, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})
    want = ppo_reference(torch.exp(x["lp"] - x["logprobs"]), x["advantages"], 0.9, 1.05)
    assert got.item() == pytest.approx(want.item(), abs=1e-6)


@pytest.mark.parametrize("top_k", [None, 3])
def test_cross_entropy_with_arbitrary_weights_and_top_k_targets(top_k):
    """Negative and fractional weights (the client-side custom-loss path sends -dC/dlp): the loss
    is -(lp * weights).sum() and its gradient is -weights, for [N] and [N, K] targets."""
    g = torch.Generator().manual_seed(1)
    shape = (N,) if top_k is None else (N, top_k)
    lp = -torch.rand(shape, generator=g, dtype=torch.float64) * 4
    weights = torch.randn(shape, generator=g, dtype=torch.float64)
    inputs = {"target_tokens": torch.zeros(shape, dtype=torch.long), "weights": weights}
    check_inputs("cross_entropy", N, inputs)
    got, grad = value_and_grad(lambda t: datum_loss("cross_entropy", t, inputs, {}), lp)
    assert got == pytest.approx(-(lp * weights).sum().item(), abs=1e-6)
    torch.testing.assert_close(grad, -weights, atol=1e-6, rtol=0)


def test_stable_reinforce_and_custom_are_refused_naming_them():
    with pytest.raises(ValueError, match="'stable_reinforce' is not supported.*record_stability_info"):
        check_loss("stable_reinforce", None)
    with pytest.raises(ValueError, match="'custom' is not supported.*forward_backward_custom"):
        check_loss("custom", None)
    with pytest.raises(ValueError, match="loss_fn: expected one of cross_entropy, .*got 'nll'"):
        check_loss("nll", None)


@pytest.mark.parametrize(
    ("loss_fn", "config", "message"),
    [
        ("ppo", {"clip_low": 0.8}, r"loss_fn_config\['clip_low'\]: loss_fn 'ppo' takes clip_high_threshold, clip_low"),
        ("importance_sampling", {"beta": 1.0}, r"loss_fn_config\['beta'\]: .* takes no keys"),
        ("dro", {}, r"loss_fn_config\['beta'\]: loss_fn 'dro' needs beta"),
        ("dro", {"beta": "high"}, r"loss_fn_config\['beta'\]: expected a number"),
    ],
)
def test_bad_loss_config_is_refused_naming_the_key(loss_fn, config, message):
    with pytest.raises(ValueError, match=message):
        check_loss(loss_fn, config)


def test_bad_inputs_are_refused_naming_the_field():
    x = rl_inputs()
    rl = {k: x[k] for k in ("target_tokens", "logprobs", "advantages")}
    with pytest.raises(ValueError, match=r"datum: loss_fn_inputs\['advantages'\] is required by loss_fn 'ppo'"):
        check_inputs("ppo", N, {k: v for k, v in rl.items() if k != "advantages"})
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['sequence_ratio_mask'\] is required by loss_fn 'gspo'"):
        check_inputs("gspo", N, rl)
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['logprobs'\] has shape \(11,\); expected \(12,\)"):
        check_inputs("importance_sampling", N, dict(rl, logprobs=rl["logprobs"][:-1]))
    with pytest.raises(
        ValueError, match=r"datum 3: loss_fn_inputs\['target_tokens'\] has shape \(12,\); expected \(13,\)"
    ):
        check_inputs("importance_sampling", N + 1, rl, "datum 3")
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['advantage'\] is not an input of any loss"):
        check_inputs("importance_sampling", N, dict(rl, advantage=rl["advantages"]))
    with pytest.raises(ValueError, match=r"target_tokens'\] has shape \(12, 2\); expected \(12,\)"):
        check_inputs("ppo", N, dict(rl, target_tokens=torch.zeros(N, 2, dtype=torch.long)))
