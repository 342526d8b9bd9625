"""slime.utils.types.Sample as slime code uses it, for slimish's adapter (slimish.compat.slime).

Field names, defaults and `Sample.Status` values are slime's; the per-token arrays cover the
response, as in slime (and slimish). Multimodal, routed-expert and top-p replay fields are
accepted and carried but not used by slimish.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any


class _Counters:
    """`to_dict` / `from_dict` of a dataclass of int counters, as slime's Sample.SpecInfo and
    Sample.PrefixCacheInfo have them (a missing counter reads as 0)."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Any:
        return cls(**{f.name: data.get(f.name, 0) for f in fields(cls)})


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None  # None: every response token is trained on
    weight_versions: list[str] = field(default_factory=list)  # the engine's, as strings
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False  # slimish: the sample counts in its group's baseline, not in the loss
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None  # sent as the routing key by slime; slimish sends its own
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo(_Counters):
        """Speculative-decoding counts summed over the sample's replies (slimish's engines do
        not speculate: they stay 0 unless a reply reports them)."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

    @dataclass
    class PrefixCacheInfo(_Counters):
        """Prompt tokens the engine found in its prefix cache, summed over the sample's replies."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    # ---- what slime code calls -----------------------------------------------------------

    def get_reward_value(self, args: Any) -> Any:
        """The reward, or `reward[args.reward_key]` when a reward key is set."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Any = None,
        log_probs: Any = None,
        trainable: bool = True,
        meta_info: dict | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Response tokens at the end: the model's (`trainable`, with their logprobs and the
        reply's `meta_info`) or the environment's (loss mask 0, logprob 0.0)."""
        new = [int(t) for t in (tokens if tokens is not None else [])]
        lps = None if log_probs is None else [float(x) for x in log_probs]
        if lps is not None and len(lps) != len(new):
            raise ValueError(f"append_response_tokens: {len(new)} tokens but {len(lps)} log_probs")
        if new and trainable and lps is None:
            raise ValueError("append_response_tokens: trainable tokens need their rollout log_probs")
        if new and not trainable:
            if lps is not None:
                raise ValueError("append_response_tokens: environment tokens (trainable=False) take no log_probs")
            lps = [0.0] * len(new)
        if text is not None:
            self.response += text
        before = self.response_length
        if new:
            self.tokens = list(self.tokens) + new
            self.response_length += len(new)
            self.loss_mask = (list(self.loss_mask) if self.loss_mask is not None else [1] * before) + [
                int(trainable)
            ] * len(new)
        if lps is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("append_response_tokens: the sample has response tokens without rollout_log_probs")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs = list(self.rollout_log_probs) + lps
        if meta_info:
            if update_terminal_info:
                self.update_from_meta_info(args, meta_info)
            elif "weight_version" in meta_info:
                self.weight_versions.append(meta_info["weight_version"])

    def update_from_meta_info(self, args: Any, meta_info: dict) -> None:
        """The reply's weight version, speculative and prefix-cache counts, and the status its
        finish reason implies."""
        self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        finish = (meta_info.get("finish_reason") or {}).get("type")
        status = {
            "length": Sample.Status.TRUNCATED,
            "abort": Sample.Status.ABORTED,
            "stop": Sample.Status.COMPLETED,
        }.get(finish)
        if status is not None:
            self.status = status

    def to_dict(self) -> dict[str, Any]:
        value = dict(self.__dict__)
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Sample":
        data = dict(data)
        data["status"] = Sample.Status(data.get("status", "pending"))
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info") or {})
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info") or {})
        names = {f.name for f in fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as slime's weight sync describes it (name, dtype, shape, attrs, size, src_rank)."""

    name: str
    dtype: Any
    shape: Any
    attrs: dict
    size: int
    src_rank: int


# slime's rollout-to-training batch: field name -> one entry per sample (slimish trains on its own Samples).
RolloutBatch = dict[str, list[Any]]


__all__ = ["ParamInfo", "RolloutBatch", "Sample"]
