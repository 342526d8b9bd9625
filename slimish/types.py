"""The one data contract every part shares: a `Sample` and what a generate call returns.

A sample's per-token arrays cover the *response* only (everything after the prompt): model tokens
(loss mask 1, with the engine's logprobs) interleaved with environment tokens (mask 0, logprob 0).
Rollout code never edits the arrays by hand; it calls `append_model` and `append_env`, so the
arrays cannot drift apart, and `check()` is the single place the invariants are enforced.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from slimish.protocol import version_number


class SampleStatus(str, Enum):
    PENDING = "pending"  # not started, or a partial sample waiting to be resumed
    COMPLETED = "completed"  # the model stopped on its own (EOS or a stop string)
    TRUNCATED = "truncated"  # hit max_new_tokens or the context length
    ABORTED = "aborted"  # cut off at the end of a rollout step
    FAILED = "failed"  # the rollout or reward function raised; `error` says why: its group is dropped
    # The environment failed, not the policy (a harness that crashed, ran out of time or lost its
    # sandbox): the trajectory is left out of the loss and of its group's baseline, not scored 0;
    # the rest of its group trains. `error` says why.
    INFRA_FAILED = "infra_failed"


def status_of(finish_reason: str) -> SampleStatus:
    """A sample's status after the engine's finish reason (stop, length or abort)."""
    return {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}[
        finish_reason
    ]


@dataclass
class GenerateResult:
    """One `/generate` call, as rollout code sees it."""

    output_ids: list[int]
    logprobs: list[float]  # one per output id
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int  # the engine's, as a number (`protocol.version_number`)
    prompt_tokens: int = 0
    token_versions: list[int] = field(default_factory=list)  # per output id: the weights that made it


@dataclass
class Sample:
    prompt: str | list[dict[str, Any]]  # text, or chat messages
    label: Any = None
    tokens: list[int] = field(default_factory=list)  # prompt ids + response ids
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)  # one per response token
    rollout_logprobs: list[float] = field(default_factory=list)  # one per response token (0.0 where mask 0)
    # On-policy distillation (algorithm.opd): the teacher's log-probs of the response tokens, one
    # per token as `rollout_logprobs` and at the same temperature; None until the teacher scored it.
    teacher_logprobs: list[float] | None = None
    reward: float | dict[str, Any] | None = (
        None  # a dict: named values, `rollout.reward_key` the numeric one trained on
    )
    status: SampleStatus = SampleStatus.PENDING
    # Per response token: the weight version that made it; -1 for environment tokens and where
    # unknown. Empty for a sample built without versions. The one record: `weight_versions` and
    # `trained_versions` are read from it.
    token_versions: list[int] = field(default_factory=list)
    group_id: int = 0  # the prompt's position in the data stream: unique per prompt taken
    index: int = 0  # position within its group
    # The trajectory it belongs to: the segments and branches of one gateway session, and every
    # sample one rollout call returned, share it (set by the manager where the rollout fn did
    # not). A trajectory counts once in its group's baseline, however many samples it has.
    trajectory_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # any JSON values; saved and logged with the sample
    error: str | None = None  # why it failed
    # The response ids decoded (special tokens kept), set when the rollout function returns:
    # what reward functions and hooks read. Stop strings are in it: ids are the truth.
    response: str = ""
    # Counted in its group's baseline (its reward is part of the mean) but not trained on: e.g. a
    # sample a hook judged malformed, or a fan-out sibling whose tokens should not move the policy.
    exclude_from_loss: bool = False
    # Mixture-of-experts routes the engine took (SGLang's `routed_experts`, slimish/protocol.py):
    # int32 `[rows, num_hidden_layers, top_k]`, row i the experts chosen for `tokens[i]`; at most
    # `len(tokens) - 1` rows (the last token is never fed forward). None unless the run asked for
    # routes (`algorithm.routing_replay: r3`), which replays them in the trainer.
    routed_experts: np.ndarray | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_ids(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def set_prompt(self, ids: list[int]) -> None:
        """The prompt's token ids; only before any response token exists."""
        if self.response_length:
            raise ValueError(
                f"sample {self.group_id}/{self.index}: set_prompt after {self.response_length} response tokens"
            )
        self.tokens = list(ids)

    def append_model(
        self, ids: list[int], logprobs: list[float], weight_version: int | list[int] | None = None
    ) -> None:
        """Tokens the policy generated: trained on (mask 1), with the engine's logprobs and the
        weight version that made them (one per token when they span a weight update)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"sample {self.group_id}/{self.index}: {len(ids)} ids but {len(logprobs)} logprobs")
        versions = list(weight_version) if isinstance(weight_version, list) else [weight_version] * len(ids)
        if len(versions) != len(ids):
            raise ValueError(f"sample {self.group_id}/{self.index}: {len(ids)} ids but {len(versions)} token versions")
        self._append(ids, [1] * len(ids), list(logprobs), [-1 if v is None else v for v in versions])

    def append_env(self, ids: list[int]) -> None:
        """Tokens from the environment (tool output, user turns): in context, not trained on."""
        self._append(ids, [0] * len(ids), [0.0] * len(ids), [-1] * len(ids))

    def _append(self, ids: list[int], mask: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not self.tokens:
            raise ValueError(f"sample {self.group_id}/{self.index}: set the prompt before appending response tokens")
        if len(self.token_versions) != self.response_length:  # a sample from before per-token versions
            self.token_versions = [-1] * self.response_length
        self.tokens.extend(ids)
        self.loss_mask.extend(mask)
        self.rollout_logprobs.extend(logprobs)
        self.token_versions.extend(versions)
        self.response_length += len(ids)
        self.teacher_logprobs = None  # scored again once the response is final

    @property
    def train_mask(self) -> list[int]:
        """The loss mask the trainer uses: `loss_mask`, all zeros when `exclude_from_loss`."""
        return [0] * self.response_length if self.exclude_from_loss else self.loss_mask

    @property
    def weight_versions(self) -> list[int]:
        """The versions that made its tokens, in order, each once per run of tokens it made."""
        known = [v for v in self.token_versions if v >= 0]
        return [v for i, v in enumerate(known) if i == 0 or known[i - 1] != v]

    def trained_versions(self) -> set[int]:
        """The versions of the tokens it trains on (mask 1)."""
        return {v for v, m in zip(self.token_versions, self.loss_mask) if m and v >= 0}

    def mask_older_than(self, version: int) -> int:
        """Stop training on tokens made by weights older than `version`; how many were masked."""
        masked = 0
        for t, v in enumerate(self.token_versions):
            if self.loss_mask[t] and 0 <= v < version:
                self.loss_mask[t], self.rollout_logprobs[t] = 0, 0.0
                masked += 1
        return masked

    def reward_value(self, key: str | None = None) -> float:
        """The scalar the advantage uses: the reward, or `reward[key]` for dict rewards."""
        if isinstance(self.reward, dict):
            if key is None:
                raise ValueError(
                    f"sample {self.group_id}/{self.index}: dict reward {sorted(self.reward)} needs rollout.reward_key"
                )
            if key not in self.reward:
                raise ValueError(
                    f"sample {self.group_id}/{self.index}: rollout.reward_key {key!r} is not in its reward {sorted(self.reward)}"
                )
            value = self.reward[key]
            if not isinstance(value, (int, float)):
                numeric = sorted(k for k, v in self.reward.items() if isinstance(v, (int, float)))
                raise ValueError(
                    f"sample {self.group_id}/{self.index}: rollout.reward_key {key!r} names a {type(value).__name__} "
                    f"({value!r}); it must name a number (numeric keys: {numeric})"
                )
            return float(value)
        if self.reward is None:
            raise ValueError(f"sample {self.group_id}/{self.index}: reward is missing")
        return float(self.reward)

    def check(self) -> None:
        """The invariants, in one place: a violation names the sample and the field."""
        where = f"sample {self.group_id}/{self.index}"
        if not 0 <= self.response_length <= len(self.tokens):
            raise ValueError(f"{where}: response_length {self.response_length} outside 0..{len(self.tokens)} tokens")
        optional = (("token_versions",) if self.token_versions else ()) + (
            ("teacher_logprobs",) if self.teacher_logprobs is not None else ()
        )
        for name in ("loss_mask", "rollout_logprobs", *optional):
            if len(getattr(self, name)) != self.response_length:
                raise ValueError(
                    f"{where}: {name} has {len(getattr(self, name))} entries, response_length is {self.response_length}"
                )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"{where}: loss_mask must hold only 0 and 1")
        if self.status in (SampleStatus.FAILED, SampleStatus.INFRA_FAILED) and not self.error:
            raise ValueError(f"{where}: status {self.status.value} needs an error")
        for key, value in self.metadata.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"{where}: metadata[{key!r}] must be a JSON value (it is saved and logged): {exc}"
                ) from None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        d = copy.deepcopy(d)  # the sample must not share lists with saved state
        d["status"] = SampleStatus(d.get("status", "pending"))
        # Saved before the per-token record was the only one: versions in order (as strings before
        # that), kept as the per-token record where the sample has none.
        ordered = [version_number(v) if isinstance(v, str) else v for v in d.pop("weight_versions", None) or []]
        if ordered and not d.get("token_versions"):
            d["token_versions"] = spread_versions(d.get("loss_mask", []), ordered)
        return cls(**d)


def spread_versions(loss_mask: list[int], versions: list[int]) -> list[int]:
    """Per-token versions from a sample's versions in order, where which token each made is not
    known: every token the policy made (mask 1) gets the oldest, the one its staleness is judged
    by; environment tokens -1."""
    oldest = min(versions, default=-1)
    return [oldest if m else -1 for m in loss_mask]


def trajectories(group: list[Sample]) -> dict[str | None, list[Sample]]:
    """A group's samples by trajectory, in the order they came."""
    out: dict[str | None, list[Sample]] = {}
    for s in group:
        out.setdefault(s.trajectory_id, []).append(s)
    return out
