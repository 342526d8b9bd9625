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

from slimish.protocol import MetaInfo, decode_routed_experts, encode_routed_experts, version_number

# The SGLang server flag without which a reply carries no routes (SGLang then ignores the request's
# `return_routed_experts`: sglang 0.5.23: python/sglang/srt/state_capturer/routed_experts.py:50).
ROUTES_FLAG = "--enable-return-routed-experts"


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
    # Asked for (`algorithm.routing_replay: r3`): the engine's routes, int32 `[rows, layers, top_k]`,
    # row i the experts of token `routes_start + i` of the request's input ids + output ids.
    routed_experts: np.ndarray | None = field(default=None, repr=False)
    routes_start: int = 0
    policy: str | None = None  # the run's policy that sampled it (`policies`, docs/policies.md)
    # Sampled with parameters that reshape the distribution (`protocol.reshapes`): `logprobs`
    # are the reshaped distribution's, not the policy's.
    reshaped: bool = False


def reply_routes(meta: MetaInfo, shape: tuple[int, int]) -> np.ndarray | None:
    """A reply's `meta_info.routed_experts` decoded to `[rows, layers, top_k]`. A run that asked for
    routes and got none (SGLang started without the flag ignores the request's field) must not
    train on half its samples' routes: that raises, naming the flag. Only an aborted reply may
    lack them (SGLang answers a request aborted in its queue, e.g. retracted after some output,
    without collecting them): None, its tokens go in without rows, and the request that resumes
    the sample asks from the rows it holds, so they are routed then."""
    if meta.routed_experts is not None:
        return decode_routed_experts(meta.routed_experts, *shape)
    if meta.finish_reason is None or meta.finish_reason.type == "abort":
        return None
    raise RuntimeError(
        f"request {meta.id}: the run asked for routes (algorithm.routing_replay=r3) and the engine returned none: "
        f"start the engines with {ROUTES_FLAG} (built-in engine: enable_return_routed_experts=true)"
    )


@dataclass
class Sample:
    prompt: str | list[dict[str, Any]]  # text, or chat messages
    label: Any = None
    tokens: list[int] = field(default_factory=list)  # prompt ids + response ids
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)  # one per response token
    rollout_logprobs: list[float] = field(default_factory=list)  # one per response token (0.0 where mask 0)
    # Some response tokens were drawn from a reshaped distribution (penalties, bias, a grammar,
    # `min_new_tokens`: `protocol.reshapes`), so `rollout_logprobs` are not the policy's there:
    # the trainer takes this sample's pi_old from its own forward instead.
    reshaped: bool = False
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
    # Per response token: the policy that made it (a run's `policies`, docs/policies.md), None for
    # environment tokens. Empty in a run of one policy. Each policy trains on its own tokens only.
    token_policies: list[str | None] = field(default_factory=list)
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
        self,
        ids: list[int],
        logprobs: list[float],
        weight_version: int | list[int] | None = None,
        routes: np.ndarray | None = None,
        routes_start: int = 0,
        policy: str | None = None,
        reshaped: bool = False,
    ) -> None:
        """Tokens the policy generated: trained on (mask 1), with the engine's logprobs and the
        weight version that made them (one per token when they span a weight update); `policy`: the
        name of the run's policy that made them (`token_policies`). `routes`:
        the reply's routed experts, rows from token `routes_start` to the last one fed forward
        (the reply was for this sample's tokens); merged by `add_routes`. `reshaped`: drawn
        with reshaping sampling parameters (`GenerateResult.reshaped`), marks the sample."""
        where = f"sample {self.group_id}/{self.index}"
        if len(ids) != len(logprobs):
            raise ValueError(f"{where}: {len(ids)} ids but {len(logprobs)} logprobs")
        versions = list(weight_version) if isinstance(weight_version, list) else [weight_version] * len(ids)
        if len(versions) != len(ids):
            raise ValueError(f"{where}: {len(ids)} ids but {len(versions)} token versions")
        merged = None
        if routes is not None and ids and self.tokens:
            end = len(self.tokens) + len(ids) - 1  # the reply's rows end before its last token
            if routes_start + len(routes) != end:
                raise ValueError(
                    f"{where}: routed_experts rows {routes_start}..{routes_start + len(routes) - 1} do not end at "
                    f"token {end - 1}, the last one fed forward: the reply was not for this sample's tokens"
                )
            merged = self._merged_routes(routes, routes_start, end)
        self._append(ids, [1] * len(ids), list(logprobs), [-1 if v is None else v for v in versions], policy)
        self.reshaped = self.reshaped or (reshaped and bool(ids))
        if merged is not None:
            self.routed_experts = merged

    def add_routes(self, rows: np.ndarray, start: int) -> None:
        """Routes for `tokens[start : start + len(rows)]` (SGLang's `routed_experts` from
        `routed_experts_start_len`). The earliest rows win: rows the sample holds are kept (they
        are the ones its tokens were generated with; an engine that re-prefilled a later turn's
        history may have routed it differently), the new ones extend them. A gap, or a row for
        the last token (never fed forward), is refused."""
        self.routed_experts = self._merged_routes(rows, start, len(self.tokens) - 1)

    def _merged_routes(self, rows: np.ndarray, start: int, limit: int) -> np.ndarray:
        """The sample's routes with `rows` (from token `start`) merged; at most `limit` rows."""
        where = f"sample {self.group_id}/{self.index}"
        rows = np.asarray(rows, dtype=np.int32)
        held = self.routed_experts if self.routed_experts is not None else rows[:0]
        if rows.ndim != 3 or rows.shape[1:] != held.shape[1:]:
            raise ValueError(
                f"{where}: routed_experts rows of shape {rows.shape}, expected [rows, layers, top_k] as held "
                f"{held.shape}"
            )
        if not 0 <= start <= len(held):
            raise ValueError(
                f"{where}: routed_experts from token {start} would leave a gap: the sample holds rows for its first "
                f"{len(held)} tokens (ask with routed_experts_start_len={len(held)})"
            )
        if start + len(rows) > limit:
            raise ValueError(
                f"{where}: routed_experts reach token {start + len(rows) - 1}, past token {limit - 1}, the last "
                "one fed forward"
            )
        return np.concatenate([held, rows[len(held) - start :]])

    def append_env(self, ids: list[int]) -> None:
        """Tokens from the environment (tool output, user turns): in context, not trained on."""
        self._append(ids, [0] * len(ids), [0.0] * len(ids), [-1] * len(ids))

    def _append(
        self, ids: list[int], mask: list[int], logprobs: list[float], versions: list[int], policy: str | None = None
    ) -> None:
        if not self.tokens:
            raise ValueError(f"sample {self.group_id}/{self.index}: set the prompt before appending response tokens")
        if len(self.token_versions) != self.response_length:  # a sample from before per-token versions
            self.token_versions = [-1] * self.response_length
        self.tokens.extend(ids)
        self.loss_mask.extend(mask)
        self.rollout_logprobs.extend(logprobs)
        self.token_versions.extend(versions)
        if policy is not None and not self.token_policies:  # the sample's first tokens of a named policy
            self.token_policies = [None] * self.response_length
        if policy is not None or self.token_policies:
            self.token_policies.extend([policy if m else None for m in mask])
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
        optional = (
            (("token_versions",) if self.token_versions else ())
            + (("token_policies",) if self.token_policies else ())
            + (("teacher_logprobs",) if self.teacher_logprobs is not None else ())
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
        routes = self.routed_experts
        if routes is not None and (routes.ndim != 3 or len(routes) > max(len(self.tokens) - 1, 0)):
            raise ValueError(
                f"{where}: routed_experts of shape {routes.shape}: [rows, layers, top_k] with at most "
                f"{max(len(self.tokens) - 1, 0)} rows (one per token but the last)"
            )
        for key, value in self.metadata.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"{where}: metadata[{key!r}] must be a JSON value (it is saved and logged): {exc}"
                ) from None

    def to_dict(self) -> dict[str, Any]:
        """JSON values only (saved in run state and buffers, written as JSON lines): the routes
        in SGLang's own encoding, with their shape."""
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        if self.routed_experts is not None:
            _, layers, top_k = self.routed_experts.shape
            d["routed_experts"] = {
                "b64": encode_routed_experts(self.routed_experts),
                "layers": layers,
                "top_k": top_k,
            }
        return d

    def __eq__(self, other: object) -> bool:
        """Field by field, the routes by value (an array's `==` is elementwise)."""
        if not isinstance(other, Sample):
            return NotImplemented
        mine, theirs = self.routed_experts, other.routed_experts
        if (mine is None) != (theirs is None) or (mine is not None and not np.array_equal(mine, theirs)):
            return False
        return all(
            getattr(self, f.name) == getattr(other, f.name)
            for f in dataclasses.fields(self)
            if f.name != "routed_experts"
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        d = copy.deepcopy(d)  # the sample must not share lists with saved state
        d["status"] = SampleStatus(d.get("status", "pending"))
        # Saved before the per-token record was the only one: versions in order (as strings before
        # that), kept as the per-token record where the sample has none.
        ordered = [version_number(v) if isinstance(v, str) else v for v in d.pop("weight_versions", None) or []]
        if ordered and not d.get("token_versions"):
            d["token_versions"] = spread_versions(d.get("loss_mask", []), ordered)
        if isinstance(routes := d.get("routed_experts"), dict):
            d["routed_experts"] = decode_routed_experts(routes["b64"], routes["layers"], routes["top_k"])
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
