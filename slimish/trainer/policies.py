"""Several policies trained in one run (`policies`, docs/policies.md): what each one trains on.

Every sample records per response token the policy that made it (`Sample.token_policies`), so a
policy's share of a batch is a pure function of the batch: the samples with a turn of its own, each
seen with the loss mask restricted to its own tokens and with its own reward, in the groups they
came in (its group baselines are over its own samples only). The trainer then runs its ordinary RL
step on that share with the policy's adapter active and the policy's own optimiser (`TorchTrainer
.use_policy`), one policy after the other: the adapters are disjoint parameters, so one policy's
step never moves another's weights.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from slimish.types import Sample

if TYPE_CHECKING:
    from slimish.trainer.base import Trainer


def policy_mask(sample: Sample, policy: str) -> list[int]:
    """1 exactly on the tokens `policy` made and the sample trains on (`train_mask`), 0 elsewhere:
    other policies' turns and environment tokens."""
    if len(sample.token_policies) != sample.response_length:
        raise ValueError(
            f"sample {sample.group_id}/{sample.index}: token_policies has {len(sample.token_policies)} entries, "
            f"response_length is {sample.response_length}: a run with `policies` records which policy made each "
            "token (ctx.chat / ctx.generate_sample / ctx.append_model with policy=); samples built another way "
            "(the agent gateway) are not supported yet"
        )
    return [m if p == policy else 0 for m, p in zip(sample.train_mask, sample.token_policies)]


def made_by(sample: Sample, policy: str) -> bool:
    """Whether `policy` made a token of `sample` (whose record `policy_mask` checks)."""
    policy_mask(sample, policy)
    return policy in sample.token_policies


def policy_reward(sample: Sample, policy: str) -> float:
    """The reward `policy` trains on: `reward[policy]` of a dict reward; a number is every policy's."""
    return sample.reward_value(policy) if isinstance(sample.reward, dict) else sample.reward_value()


def policy_sample(sample: Sample, policy: str) -> Sample:
    """`sample` as `policy`'s trainer sees it: its mask `policy_mask`, its reward `policy_reward`
    (a shallow copy: the token arrays are shared, never edited)."""
    return dataclasses.replace(
        sample, loss_mask=policy_mask(sample, policy), reward=policy_reward(sample, policy), exclude_from_loss=False
    )


def policy_groups(groups: list[list[Sample]], policy: str) -> list[list[Sample]]:
    """`policy`'s share of a batch: in each group, its samples with a token of `policy`
    (`policy_sample`); groups without one are left out."""
    share = [[policy_sample(s, policy) for s in group if made_by(s, policy)] for group in groups]
    return [group for group in share if group]


def train_policies(trainer: Trainer, groups: list[list[Sample]], step: int) -> dict[str, float]:
    """One RL step of every policy on its share of `groups`, metrics under `policy/NAME/`. A policy
    with no token in the batch takes no optimiser step; its schedule advances as if it had."""
    metrics: dict[str, float] = {}
    for policy in trainer.cfg.policies:
        with trainer.use_policy(policy.name):
            share = policy_groups(groups, policy.name)
            if not share:
                for _ in range(trainer.cfg.trainer.updates_per_step):
                    trainer._scheduler_step()
                metrics[f"policy/{policy.name}/train/samples"] = 0.0
                continue
            out = trainer._train_step(share, step, None)
        out["train/samples"] = float(sum(len(g) for g in share))
        metrics.update({f"policy/{policy.name}/{key}": value for key, value in out.items()})
    return metrics
