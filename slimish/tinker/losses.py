"""The Tinker API's built-in losses as pure functions of one datum's tensors: no model, no state.

Tinker's contract (tinker 0.38.0: types/loss_fn_type.py; the formulas are those of Tinker's loss
documentation): every loss is a SUM over the datum's positions, never a mean, so the loss of a
batch is the sum of its datums' and `forward_backward` calls add up until `optim_step`. `lp` is
the log-probability of `target_tokens` under the trained model, `[N]` (or `[N, K]` for top-K
cross-entropy), position i of the model input predicting `target_tokens[i]`. RL inputs
(`logprobs` of the sampler, `advantages`) have the same shape.

The ratio and the clipped surrogate are slimish's own (`importance_ratio`, `ppo_clip_loss`), and
DRO's penalty is the k2 estimator of `kl_penalty`: one owner per formula. Tinker's thresholds are
ratio bounds (`clip_low_threshold` 0.8, `clip_high_threshold` 1.2), slimish's are epsilons.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from slimish.trainer.losses import importance_ratio, kl_penalty, ppo_clip_loss

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": RL_INPUTS,
    "ppo": RL_INPUTS,
    "cispo": RL_INPUTS,
    "dro": RL_INPUTS,
    "gspo": (*RL_INPUTS, "sequence_ratio_mask"),
}
LOSSES = tuple(REQUIRED_INPUTS)
# Every `loss_fn_inputs` key the SDK knows (tinker 0.38.0: types/datum.py:28-35); others are refused by name.
KNOWN_INPUTS = frozenset(
    {"target_tokens", "weights", "logprobs", "advantages", "clip_low_threshold", "clip_high_threshold"}
    | {"sequence_ratio_mask"}
)
CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
CONFIG_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset(),
    "ppo": frozenset(CLIP_DEFAULTS),
    "cispo": frozenset(CLIP_DEFAULTS),
    "gspo": frozenset(CLIP_DEFAULTS),
    "dro": frozenset({"beta"}),
}
UNSUPPORTED = {
    "stable_reinforce": (
        "it needs the sampler's recorded stability info (sampling with record_stability_info and the "
        "datums' provenance spans), which this server does not record; train with importance_sampling, ppo, "
        "cispo, gspo or dro"
    ),
    "custom": (
        "server-side custom losses (create_custom_loss) are not supported; forward_backward_custom, which "
        "computes the loss in the client and sends cross_entropy weights, works"
    ),
}


def check_loss(loss_fn: str, config: Mapping[str, float | str] | None) -> None:
    """Refuse, by name, a loss this server does not run and a config key the loss does not take."""
    if loss_fn in UNSUPPORTED:
        raise ValueError(f"loss_fn {loss_fn!r} is not supported: {UNSUPPORTED[loss_fn]}")
    if loss_fn not in REQUIRED_INPUTS:
        raise ValueError(f"loss_fn: expected one of {', '.join(LOSSES)}, got {loss_fn!r}")
    for key, value in (config or {}).items():
        if key not in CONFIG_KEYS[loss_fn]:
            takes = ", ".join(sorted(CONFIG_KEYS[loss_fn])) or "no keys"
            raise ValueError(f"loss_fn_config[{key!r}]: loss_fn {loss_fn!r} takes {takes}")
        try:
            float(value)
        except (TypeError, ValueError):
            raise ValueError(f"loss_fn_config[{key!r}]: expected a number, got {value!r}") from None
    if loss_fn == "dro" and "beta" not in (config or {}):
        raise ValueError("loss_fn_config['beta']: loss_fn 'dro' needs beta, the weight of its quadratic penalty")


def check_inputs(loss_fn: str, n_tokens: int, inputs: Mapping[str, Tensor], where: str = "datum") -> None:
    """A datum's `loss_fn_inputs` against the loss: every required key, no unknown key, and the
    shapes the alignment needs (`[N]`, or `[N, K]` targets and weights for cross-entropy)."""
    for key in inputs:
        if key not in KNOWN_INPUTS:
            raise ValueError(
                f"{where}: loss_fn_inputs[{key!r}] is not an input of any loss ({', '.join(sorted(KNOWN_INPUTS))})"
            )
    for key in REQUIRED_INPUTS[loss_fn]:
        if key not in inputs:
            raise ValueError(f"{where}: loss_fn_inputs[{key!r}] is required by loss_fn {loss_fn!r}")
    target = tuple(inputs["target_tokens"].shape)
    top_k = loss_fn == "cross_entropy" and len(target) == 2
    if not target or target[0] != n_tokens or len(target) > (2 if top_k else 1):
        shapes = f"({n_tokens},)" + (f" or ({n_tokens}, K)" if loss_fn == "cross_entropy" else "")
        raise ValueError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {target}; expected {shapes}, one target per "
            f"input token (model_input has {n_tokens})"
        )
    for key, value in inputs.items():
        if key == "target_tokens":
            continue
        scalar_ok = key in CLIP_DEFAULTS and value.numel() == 1
        if tuple(value.shape) != target and not scalar_ok:
            raise ValueError(f"{where}: loss_fn_inputs[{key!r}] has shape {tuple(value.shape)}; expected {target}")


def _bounds(inputs: Mapping[str, Tensor], config: Mapping[str, float], like: Tensor) -> tuple[Tensor, Tensor]:
    """The ratio's clip bounds: a datum's own `clip_*_threshold` input, else the request's config, else 0.8 / 1.2."""
    low, high = (
        torch.as_tensor(inputs.get(k, config.get(k, CLIP_DEFAULTS[k])), dtype=like.dtype) for k in CLIP_DEFAULTS
    )
    return low, high


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """-min(r A, clip(r, low, high) A) summed: slimish's PPO surrogate with ratio bounds as epsilons."""
    per_token, _ = ppo_clip_loss(ratio, advantages, 1 - low, high - 1)
    return per_token.sum()


def datum_loss(loss_fn: str, lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """One datum's loss (a scalar with `lp`'s gradient), `check_inputs` having passed."""
    if loss_fn == "cross_entropy":
        return -(lp * inputs["weights"]).sum()
    old, adv = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "dro":
        return -(lp * adv - config["beta"] * kl_penalty(lp, old, "k2")).sum()
    everywhere = torch.ones_like(lp)
    if loss_fn == "gspo":
        ratio = importance_ratio(lp, old, inputs["sequence_ratio_mask"] != 0, "sequence")
        return _clipped_surrogate(ratio, adv, *_bounds(inputs, config, lp))
    ratio = importance_ratio(lp, old, everywhere, "token")
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    if loss_fn == "ppo":
        return _clipped_surrogate(ratio, adv, *_bounds(inputs, config, lp))
    if loss_fn == "cispo":
        low, high = _bounds(inputs, config, lp)
        return -(ratio.clamp(low, high).detach() * lp * adv).sum()
    raise ValueError(f"loss_fn: expected one of {', '.join(LOSSES)}, got {loss_fn!r}")
