"""Advantages of the GRPO / PPO family: pure tensor functions, no I/O, no state.

Why pure: every estimator here is checked against hand-computed values and against TRL's own code
(tests/test_algorithms.py), and the trainer backends (torch, Megatron) share them unchanged.

Shapes. Outcome rewards are one per sample (or per trajectory), grouped by prompt: a group is the
samples drawn for one prompt, and its mean is the baseline. GAE (PPO with a critic) works per token
`[B, T]`, as the losses do (losses.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from slimish.trainer.config import ADVANTAGES

if TYPE_CHECKING:
    from slimish.types import Sample

# A user's `algorithm.advantage`: (rewards [T], group [T]) -> advantages [T], one per trajectory.
AdvantageFn = Callable[[Tensor, Tensor], Tensor]

# --- Advantages ----------------------------------------------------------------------------------
# Input: rewards `[n_groups, group_size]` (or flat `[N]` with `group_size`), one reward per sample;
# a group is the samples drawn for one prompt. Output: one advantage per sample, same shape.


def group_rewards(rewards: Tensor, group_size: int | None = None) -> Tensor:
    """`[N]` + group size, or `[G, K]`, as `[G, K]`; rejects shapes and values no estimator can use."""
    if not torch.is_tensor(rewards) or not rewards.is_floating_point():
        raise TypeError(
            f"rewards: expected a floating-point tensor, got {type(rewards).__name__} {getattr(rewards, 'dtype', '')}"
        )
    if rewards.numel() == 0:
        raise ValueError("rewards: empty")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards: must be finite, got {rewards.tolist()}")
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size: {group_size} disagrees with rewards of shape {tuple(rewards.shape)}")
        return rewards
    if rewards.dim() != 1 or group_size is None:
        raise ValueError(
            f"rewards: expected [n_groups, group_size], or [N] with group_size; got shape {tuple(rewards.shape)}"
        )
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the {rewards.numel()} rewards into whole groups")
    return rewards.view(-1, group_size)


def _std(x: Tensor, dim: int | None = None) -> Tensor:
    """Sample std (Bessel-corrected, as TRL, verl and OpenRLHF use), 0 where fewer than 2 values."""
    n = x.numel() if dim is None else x.shape[dim]
    if n < 2:
        return torch.zeros_like(x.mean() if dim is None else x.mean(dim, keepdim=True))
    return x.std() if dim is None else x.std(dim, keepdim=True)


def _centred(x: Tensor, dim: int | None = None) -> tuple[Tensor, Tensor]:
    """x minus its mean, and whether the values are all equal; exactly 0 for equal values (float
    rounding of the mean would leave ~1e-9 there, which a std near 0 would then blow up)."""
    first = x.flatten()[0] if dim is None else x.select(dim, 0).unsqueeze(dim)
    same = (x == first).all() if dim is None else (x == first).all(dim, keepdim=True)
    mean = x.mean() if dim is None else x.mean(dim, keepdim=True)
    return torch.where(same, 0.0, x - mean), same


def grpo_advantages(rewards: Tensor, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """GRPO: reward minus the group mean, over the group std (+ eps); an all-equal group gives
    0, not NaN. `scale=False` is Dr. GRPO: the std division biases the update toward groups whose
    rewards barely differ (too easy or too hard prompts), so Dr. GRPO drops it."""
    centred, same = _centred(rewards, -1)
    if not scale:
        return centred
    return torch.where(same, 0.0, centred / (_std(rewards, -1) + eps))


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO: reward minus the mean of the *other* samples of its group, so the baseline does not
    depend on the sample it judges (unbiased). Equals K/(K-1) * (r - group mean)."""
    k = rewards.shape[-1]
    if k < 2:
        raise ValueError(f"group_size: RLOO needs at least 2 samples per group, got {k}")
    return _centred(rewards, -1)[0] * (k / (k - 1))


def reinforce_pp_advantages(rewards: Tensor, eps: float = 1e-6, baseline: bool = False) -> Tensor:
    """REINFORCE++: no critic and no group std; advantages are whitened over the whole global
    batch (mean and std of all of its samples), which keeps the step size steady across prompts
    without GRPO's per-prompt std bias. `baseline=True` is REINFORCE++-baseline: subtract the
    group mean first, for groups of several samples per prompt.

    OpenRLHF whitens per token (longer responses weigh more); with outcome rewards this is the
    per-sample version of it, equal when responses have equal lengths."""
    a = _centred(rewards, -1)[0] if baseline else rewards
    centred, same = _centred(a)
    return torch.where(same, 0.0, centred / (_std(a) + eps))


def ragged_advantages(name: str, rewards: list[Tensor], eps: float = 1e-6) -> list[Tensor]:
    """`compute_advantages` for groups of different sizes (one reward per trajectory; a group
    shrinks when a trajectory's environment failed). Equal sizes take the batched path; otherwise
    group-local estimators run per group, and REINFORCE++ whitens over the whole batch after
    (with its baseline) centring each group."""
    sizes = [len(r) for r in rewards]
    if len(set(sizes)) == 1:
        return list(compute_advantages(name, torch.stack(rewards), eps=eps).unbind(0))
    if name in ("reinforce_pp", "reinforce_pp_baseline"):
        centred = [_centred(r)[0] if name == "reinforce_pp_baseline" else r for r in rewards]
        return list(reinforce_pp_advantages(torch.cat(centred).view(1, -1), eps).view(-1).split(sizes))
    return [compute_advantages(name, r.view(1, -1), eps=eps).view(-1) for r in rewards]


def trajectory_advantages(
    name: str | AdvantageFn, rewards: Tensor, trajectory: Tensor, group: Tensor, weights: Tensor, eps: float = 1e-6
) -> Tensor:
    """One advantage per sample `[N]`, computed over trajectories so that each counts once in its
    group's baseline whatever its number of samples (a conversation split into segments, fan-out
    siblings). `trajectory` `[N]` maps samples to trajectories 0..T-1; `group` `[T]` maps
    trajectories to groups; a trajectory's reward is the mean of its samples' (they carry the
    same one). Each sample gets its trajectory's advantage times its `weights` entry (the credit
    rule: 1 to broadcast, 1/n to split, ...). One sample per trajectory is `compute_advantages`.

    `name` may be a user's function (`algorithm.advantage: module:function`, loaded by the
    caller): it takes the trajectories' rewards `[T]` and their group indices `[T]` (0..G-1,
    int64) and returns one advantage per trajectory `[T]`, in place of the built-in estimators."""
    n_traj = int(trajectory.max()) + 1
    count = torch.zeros(n_traj).index_add_(0, trajectory, torch.ones_like(rewards))
    reward = torch.zeros(n_traj, dtype=rewards.dtype).index_add_(0, trajectory, rewards) / count
    if callable(name):
        return custom_advantages(name, reward, group)[trajectory] * weights
    order = torch.argsort(group, stable=True)
    sizes = torch.bincount(group).tolist()
    per_group = ragged_advantages(name, list(reward[order].split(sizes)), eps)
    advantage = torch.empty(n_traj, dtype=rewards.dtype)
    advantage[order] = torch.cat(per_group)
    return advantage[trajectory] * weights


def custom_advantages(fn: AdvantageFn, rewards: Tensor, group: Tensor) -> Tensor:
    """A user's advantage function on one reward per trajectory, its output checked: a finite
    floating-point tensor of the rewards' shape (cast to their dtype)."""
    out = fn(rewards.clone(), group.clone())  # clones: a function that edits its inputs in place changes nothing
    where = f"algorithm.advantage {getattr(fn, '__qualname__', fn)!r}"
    if not torch.is_tensor(out):
        raise ValueError(
            f"{where}: returned a {type(out).__name__}; it must return a tensor of one advantage per trajectory, shape {tuple(rewards.shape)}"
        )
    if tuple(out.shape) != tuple(rewards.shape):
        raise ValueError(
            f"{where}: returned shape {tuple(out.shape)}; it must return one advantage per trajectory, shape {tuple(rewards.shape)} "
            f"(the shape of `rewards`)"
        )
    if not out.is_floating_point():
        raise ValueError(f"{where}: returned dtype {out.dtype}; it must return a floating-point tensor")
    if not torch.isfinite(out).all():
        raise ValueError(f"{where}: returned non-finite advantages {out.tolist()}")
    return out.detach().to(device=rewards.device, dtype=rewards.dtype)


def credit_weights(rule: str, trajectory: list[int]) -> list[float]:
    """Per sample, its share of its trajectory's advantage: `broadcast` 1, `split` 1 / (the
    trajectory's samples), `last` 1 for its last sample and 0 for the others."""
    counts: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, t in enumerate(trajectory):
        counts[t] = counts.get(t, 0) + 1
        last[t] = i
    if rule == "broadcast":
        return [1.0] * len(trajectory)
    if rule == "split":
        return [1.0 / counts[t] for t in trajectory]
    if rule == "last":
        return [float(last[t] == i) for i, t in enumerate(trajectory)]
    raise ValueError(f"segment_credit: expected broadcast, split or last, got {rule!r}")


def segment_credit(
    rule: str, fn: Callable[[list[Sample]], list[float]] | None, samples: list[Sample], trajectory: list[int]
) -> list[float]:
    """Each sample's share of its trajectory's advantage (`algorithm.segment_credit`): the built-in
    `rule`, or the user's `fn` (`module:function`, loaded by the caller) called on each
    trajectory's samples, its answer checked to hold one share per sample."""
    if fn is None:
        return credit_weights(rule, trajectory)
    weights = [0.0] * len(samples)
    members: dict[int, list[int]] = {}
    for i, t in enumerate(trajectory):
        members.setdefault(t, []).append(i)
    for idx in members.values():
        shares = fn([samples[i] for i in idx])
        if len(shares) != len(idx):
            raise ValueError(
                f"algorithm.segment_credit {rule}: returned {len(shares)} shares for a trajectory of {len(idx)} samples"
            )
        for i, share in zip(idx, shares):
            weights[i] = float(share)
    return weights


def compute_advantages(name: str, rewards: Tensor, group_size: int | None = None, eps: float = 1e-6) -> Tensor:
    """One advantage per sample, same shape as `rewards`. `name` is `AlgorithmConfig.advantage`;
    `gspo` uses GRPO's advantages (GSPO changes the ratio, not the advantage)."""
    grouped = group_rewards(rewards, group_size)
    if name in ("grpo", "gspo"):
        out = grpo_advantages(grouped, eps)
    elif name == "dr_grpo":
        out = grpo_advantages(grouped, eps, scale=False)
    elif name == "rloo":
        out = rloo_advantages(grouped)
    elif name in ("reinforce_pp", "reinforce_pp_baseline"):
        out = reinforce_pp_advantages(grouped, eps, baseline=name == "reinforce_pp_baseline")
    else:
        raise ValueError(f"advantage: expected one of {', '.join(ADVANTAGES)}, got {name!r}")
    return out.view_as(rewards)


# --- PPO with a critic: GAE -----------------------------------------------------------------------
# Per-token `[B, T]` over response tokens, as the losses (losses.py `value_loss` trains the critic).


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation: per-token advantages and returns (advantage + value),
    0 where `mask` is 0. delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next.

    Only mask-1 tokens are steps: environment / tool tokens (and padding) are skipped as if the
    trained tokens were contiguous, so `next` is the next mask-1 token, and after the last one
    V = 0 (the episode ends). Rewards on mask-0 tokens are ignored: put the outcome reward on
    the last trained token. gamma = lam = 1 gives A_t = (sum of later rewards) - V_t."""
    m = mask.bool()
    advantages = torch.zeros_like(values)
    running = values.new_zeros(values.shape[0])
    next_value = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        on = m[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        advantages[:, t] = torch.where(on, step, 0.0)
        running = torch.where(on, step, running)
        next_value = torch.where(on, values[:, t], next_value)
    return advantages, torch.where(m, advantages + values, 0.0)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over the mask-1 entries (sample std, as `_std`), 0 elsewhere:
    the batch-level advantage normalisation of PPO (verl, OpenRLHF)."""
    m = mask.bool()
    if not m.any():
        return torch.zeros_like(x)
    centred, same = _centred(x[m])
    out = torch.where(same, 0.0, centred / (_std(x[m]) + eps))
    return torch.zeros_like(x).masked_scatter(m, out)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over mask-1 tokens: 1 for a perfect critic, 0
    for one no better than the mean return, negative for worse; 0 when the returns are constant
    (up to float rounding of advantage + value: variance below 1e-8), where it means nothing."""
    m = mask.bool()
    var = returns[m].double().var(unbiased=False) if m.any() else values.new_zeros((), dtype=torch.float64)
    if var < 1e-8:
        return 0.0
    return float(1 - (returns[m] - values[m]).double().var(unbiased=False) / var)
