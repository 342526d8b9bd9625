"""Property-based tests (hypothesis): the `Sample` contract holds whatever sequence of appends
rollout code makes, and the RL losses stay finite, with finite gradients, at extreme inputs
(logprobs far apart, huge advantages and rewards, empty masks)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slimish.trainer.advantages import compute_advantages
from slimish.trainer.config import ADVANTAGES, LOSS_REDUCTIONS, AlgorithmConfig
from slimish.trainer.losses import kl_penalty, loss_normalizer, rl_loss
from slimish.types import Sample, SampleStatus

ids = st.lists(st.integers(0, 2**31 - 1), max_size=8)
logprob = st.floats(-1e5, 0.0, allow_nan=False)
steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("model"),
            ids.flatmap(lambda xs: st.tuples(st.just(xs), st.lists(logprob, min_size=len(xs), max_size=len(xs)))),
        ),
        st.tuples(st.just("env"), ids),
    ),
    max_size=10,
)


@settings(max_examples=300, deadline=None)
@given(prompt=ids.filter(bool), steps=steps, version=st.one_of(st.none(), st.integers(0, 99)))
def test_sample_invariants_hold_after_any_appends(prompt, steps, version):
    s = Sample(prompt="p")
    s.set_prompt(prompt)
    model_ids, env_ids = [], []
    for kind, arg in steps:
        if kind == "model":
            s.append_model(arg[0], arg[1], version)
            model_ids += arg[0]
        else:
            s.append_env(arg)
            env_ids += arg
    s.check()
    assert s.prompt_length == len(prompt) and s.tokens[: s.prompt_length] == prompt
    assert s.response_length == len(model_ids) + len(env_ids) == len(s.response_ids)
    assert sum(s.loss_mask) == len(model_ids)
    assert [t for t, m in zip(s.response_ids, s.loss_mask) if m] == model_ids
    assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if not m)
    assert all(a != b for a, b in zip(s.weight_versions, s.weight_versions[1:]))
    back = Sample.from_dict(s.to_dict())
    assert back == s and back.tokens is not s.tokens
    if s.response_length:
        with pytest.raises(ValueError, match="set_prompt after"):
            s.set_prompt([1])


@given(xs=ids.filter(bool), extra=st.integers(1, 3))
def test_sample_refuses_misaligned_appends(xs, extra):
    s = Sample(prompt="p")
    with pytest.raises(ValueError, match="set the prompt"):
        s.append_env(xs)
    s.set_prompt([1])
    with pytest.raises(ValueError, match="logprobs"):
        s.append_model(xs, [0.0] * (len(xs) + extra))
    s.append_model(xs, [0.0] * len(xs))
    s.loss_mask.append(1)  # hand-edited arrays drift: check() names the field
    with pytest.raises(ValueError, match="loss_mask has"):
        s.check()
    with pytest.raises(ValueError, match="needs an error"):
        Sample(prompt="p", status=SampleStatus.FAILED).check()


# ---- losses --------------------------------------------------------------------------------

B, T = 3, 5
token_values = st.lists(logprob, min_size=B * T, max_size=B * T)
masks = st.lists(st.integers(0, 1), min_size=B * T, max_size=B * T)
configs = st.builds(
    AlgorithmConfig,
    loss=st.sampled_from(["ppo", "gspo"]),
    loss_reduction=st.sampled_from(LOSS_REDUCTIONS),
    eps_clip=st.floats(0.01, 0.99),
    eps_clip_high=st.one_of(st.none(), st.floats(0.01, 10.0)),
    dual_clip_c=st.one_of(st.none(), st.floats(1.01, 100.0)),
    kl_coef=st.sampled_from([0.0, 0.1, 10.0]),
    kl_estimator=st.sampled_from(["k1", "k2", "k3"]),
    kl_importance_weight=st.booleans(),
    entropy_coef=st.sampled_from([0.0, 0.01]),
    tis_cap=st.one_of(st.none(), st.floats(0.1, 10.0)),
)


def grid(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(B, T)


@settings(max_examples=300, deadline=None)
@given(
    cfg=configs,
    new=token_values,
    old=token_values,
    ref=token_values,
    rollout=token_values,
    mask=masks,
    adv=st.lists(st.floats(-1e6, 1e6), min_size=B, max_size=B),
)
def test_rl_loss_and_gradient_are_finite_at_extremes(cfg, new, old, ref, rollout, mask, adv):
    logprobs = grid(new).requires_grad_(True)
    m = grid(mask)
    normalizer = loss_normalizer(cfg.loss_reduction, int(m.sum()), B, T)
    loss, stats = rl_loss(
        cfg,
        logprobs,
        grid(old),
        torch.tensor(adv),
        m,
        normalizer,
        ref_logprobs=grid(ref),
        rollout_logprobs=grid(rollout),
        entropy=torch.rand(B, T),
    )
    loss.backward()
    assert torch.isfinite(loss), (loss, stats)
    assert torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(v).all() for v in stats.values()), stats
    if not m.any():
        assert loss.item() == 0.0 and logprobs.grad.abs().sum() == 0


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(ADVANTAGES), groups=st.integers(1, 3), size=st.integers(2, 5), data=st.data())
def test_advantages_are_finite_for_any_finite_rewards(name, groups, size, data):
    rewards = data.draw(st.lists(st.floats(-1e30, 1e30), min_size=groups * size, max_size=groups * size))
    adv = compute_advantages(name, torch.tensor(rewards, dtype=torch.float32), group_size=size)
    assert adv.shape == (groups * size,) and torch.isfinite(adv).all(), (rewards, adv)
    if len(set(rewards)) == 1:  # a group with no signal teaches nothing
        assert adv.abs().max().item() == 0.0


@given(a=logprob, b=logprob, estimator=st.sampled_from(["k1", "k2", "k3"]))
def test_kl_estimators_are_finite_and_k2_k3_nonnegative(a, b, estimator):
    kl = kl_penalty(torch.tensor([a]), torch.tensor([b]), estimator).item()
    assert math.isfinite(kl)
    if estimator != "k1":
        assert kl >= 0.0
