"""The HTTP bodies of docs/protocol.md's SGLang 0.5.23 native protocol (the OpenAI subset's are
slimish/formats/openai.py's).

Every part of slimish that sends or reads one of these bodies (the built-in engine, the router,
the client, the trainer's weight sync) uses these models, so a protocol field has one owner.

Request models are strict (a JSON `1.0` is not an int, `"1"` is not a number), as SGLang's schema
gate is. Top-level keys we do not know are ignored (sglang-router adds several); unknown
`sampling_params` keys are rejected with the field named.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_WEIGHT_VERSION = "default"
DEFAULT_GROUP_NAME = "weight_update_group"
TOP_K_OFF = 1 << 30
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """What every call to a keyed engine or router sends: `Authorization: Bearer <key>`, the one
    form SGLang checks (sglang 0.5.23: python/sglang/srt/utils/auth.py:108-117) and so do the
    slimish engine and router; nothing without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# The routes that change an engine's weights (docs/protocol.md 4): admin routes of the engine, fanned
# out to every worker by the router.
WEIGHT_UPDATE_ROUTES = (
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/update_weights_from_disk",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weight_version",
)


def version_number(version: str) -> int:
    """The wire's weight version as the integer every other part of slimish uses: versions are
    training steps written as strings; anything else (an engine's initial "default") is step 0."""
    try:
        return int(version)
    except (TypeError, ValueError):
        return 0


def wire_version(version: int) -> str:
    """A weight version (an int inside slimish: the training step) as SGLang's routes carry it, a
    string; `version_number` reads it back."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(
            f"weight version: expected an int (the training step), got {type(version).__name__} {version!r}"
        )
    return str(version)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# --------------------------------------------------------------------------------------------
# /generate
# --------------------------------------------------------------------------------------------

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")  # constrained decoding: at most one per request


class SamplingParams(BaseModel):
    """One request's sampling parameters (docs/protocol.md 1.2). Unknown keys are an error."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = TOP_K_OFF
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)  # SGLang's bound: past it a logprob can overflow
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stream_interval: int | None = None
    # Constrained decoding (at most one; slimish/engine/grammar.py), then fields SGLang accepts
    # and ignores, as the built-in engine does.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    custom_params: Any = None
    beam_width: Any = None
    watermark: Any = None
    choice: Any = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (off) or a positive int")
        return TOP_K_OFF if v == -1 else v

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def stop_regexes(self) -> list[str]:
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex or [])


# Fields that reshape the distribution a token is drawn from: penalties, bias, a grammar's mask,
# the end token masked until `min_new_tokens`. SGLang's log-probs are those of the reshaped
# distribution, so they are not the policy's, and the trainer takes pi_old from its own forward
# for a sample drawn with any of them (`reshapes`; docs/training.md).
RESHAPING_FIELDS = (
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    *GRAMMAR_FIELDS,
)


def reshapes(sampling_params: dict[str, Any]) -> bool:
    """Whether a request's sampling parameters move any of `RESHAPING_FIELDS` off its neutral
    value (its default; an empty `logit_bias` too)."""
    fields = SamplingParams.model_fields
    return any(sampling_params.get(k) not in (None, {}, fields[k].default) for k in RESHAPING_FIELDS)


class GenerateReqInput(_Strict):
    """Body of `POST /generate` (docs/protocol.md 1.1)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    # A loaded LoRA adapter's name (SGLang's field name: a name, not a path), or per batch item
    # a list of them; null is the base model.
    lora_path: str | list[str | None] | None = None
    # Keys sglang-router 0.3.2 injects; accepted and otherwise unused (`model` picks the router's
    # named workers, slimish/router/proxy.py `serving`; the engine ignores it, as SGLang does).
    model: str | None = None
    log_metrics: bool = True
    background: bool = False
    no_logs: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    return_hidden_states: bool = False
    # Mixture-of-experts routes (docs/protocol.md 1.4): scalars for the whole batch, as SGLang's
    # io_struct has them; the start is an absolute token position in [0, prompt tokens].
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> "GenerateReqInput":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self) -> list[str | list[int]]:
        """The batch items, text or ids, before `n` expansion."""
        items = self.text if self.text is not None else self.input_ids
        return list(items) if self.is_batch else [items]  # type: ignore[list-item]

    def per_item(self, field: str, i: int) -> Any:
        """A field that may be given once for the batch or once per item."""
        value = getattr(self, field)
        if field == "token_ids_logprob":
            if value and isinstance(value[0], list):
                return value[i]
            return value
        if field == "sampling_params":
            if isinstance(value, list):
                return value[i]
            return value or SamplingParams()
        return value[i] if isinstance(value, list) else value


class FinishReason(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"]
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class MetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    weight_version: str = DEFAULT_WEIGHT_VERSION
    num_retractions: int = 0
    e2e_latency: float | None = None
    input_token_logprobs: list[list[Any]] | None = None
    output_token_logprobs: list[list[Any]] | None = None
    output_token_logprobs_length: int | None = None
    input_top_logprobs: list[Any] | None = None
    output_top_logprobs: list[Any] | None = None
    input_token_ids_logprobs: list[Any] | None = None
    output_token_ids_logprobs: list[Any] | None = None
    # slimish's engine (optional extra, docs/protocol.md 1.3): which weights made which output tokens,
    # `[{"version", "start", "end"}]`, when a request outlived a weight update.
    weight_versions: list[dict[str, Any]] | None = None
    # With `return_routed_experts`, on the finished (or aborted) item only: `encode_routed_experts`.
    routed_experts: str | None = None

    def output_versions(self, n: int) -> list[int]:
        """The version number that made each of the `n` output tokens; all `weight_version` when
        the engine reports no spans (SGLang): then a request that outlived an update counts as the newer."""
        versions = [span["version"] for span in self.weight_versions or [] for _ in range(span["end"] - span["start"])]
        return [version_number(v) for v in (versions if len(versions) == n else [self.weight_version] * n)]


def encode_routed_experts(routes: np.ndarray) -> str:
    """`meta_info.routed_experts` as SGLang 0.5.23 writes it: base64 of the raw little-endian int32
    bytes of a C-order `[tokens, num_hidden_layers, top_k]` array, no header. Row i is the routing
    of token `routed_experts_start_len + i`; the rows end before the sequence's last token (never fed
    forward); a dense layer's rows are 0; expert ids are logical (shared experts not included)."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype="<i4").tobytes()).decode()


def decode_routed_experts(encoded: str, layers: int, top_k: int) -> np.ndarray:
    """`encode_routed_experts` read back: int32 `[tokens, layers, top_k]` (the shape is not on the
    wire: the model's `num_hidden_layers` and `num_experts_per_tok` give it)."""
    raw = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    if raw.size % (layers * top_k):
        raise ValueError(f"routed_experts: {raw.size} int32 values are not rows of {layers} layers x top-{top_k}")
    return raw.astype(np.int32).reshape(-1, layers, top_k)


class GenerateResponse(BaseModel):
    """One item of a `/generate` reply (docs/protocol.md 1.3); `index` is set on streamed batches."""

    model_config = ConfigDict(extra="allow")

    text: str = ""
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None


# --------------------------------------------------------------------------------------------
# Weight sync and control (docs/protocol.md 2)
# --------------------------------------------------------------------------------------------


class InitWeightsUpdateGroupReq(_Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class UpdateWeightsFromDistributedReq(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False
    # slimish extension: push into this loaded LoRA adapter only. `names` are then its PEFT
    # state-dict names (`get_peft_model_state_dict`), and `weight_version` versions it alone.
    lora_name: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> "UpdateWeightsFromDistributedReq":
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names, dtypes and shapes must have equal lengths, got "
                f"{len(self.names)}, {len(self.dtypes)}, {len(self.shapes)}"
            )
        return self


class DestroyWeightsUpdateGroupReq(_Strict):
    group_name: str = DEFAULT_GROUP_NAME


class UpdateWeightsFromDiskReq(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    torch_empty_cache: bool = False
    manifest: dict[str, Any] | None = None


class BeginWeightUpdateReq(_Strict):
    selector: Literal["target", "draft", "all"] = "all"


class UpdateWeightVersionReq(_Strict):
    new_version: str
    abort_all_requests: bool = True
    # slimish extension: version this loaded LoRA adapter alone, its batch slots refreshed from its
    # tensors first (an adapter mapped from a colocated trainer's store: the trainer wrote them).
    lora_name: str | None = None


class PauseGenerationReq(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReq(_Strict):
    torch_empty_cache: bool = True


class AbortReq(_Strict):
    rid: str = ""
    abort_all: bool = False


class GetWeightsByNameReq(_Strict):
    name: str
    truncate_size: int = Field(100, ge=1)
    lora_name: str | None = None  # read that adapter's tensor (`name`: its PEFT state-dict name)


class GetWeightVersionReq(_Strict):
    """`/get_weight_version`: the base model's version, or a loaded adapter's."""

    lora_name: str | None = None


class AddWorkerReq(_Strict):
    """The router's `POST /workers` (sglang-router 0.3's worker config; its other fields, priority,
    cost and so on, are ignored)."""

    url: Any = None  # checked by the registry, whose error names the form it expects
    # A name: the worker serves only requests whose `model` names it, and admin fan-outs skip it
    # unless they name it (`?model=`). None: a worker of the router's own model.
    model_id: str | None = Field(None, min_length=1)


# --------------------------------------------------------------------------------------------
# LoRA adapters (SGLang's bodies)
# --------------------------------------------------------------------------------------------


class LoadLoraAdapterReq(_Strict):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)  # a PEFT adapter directory on the engine's machine
    pinned: bool = False  # never evicted from the batch slots once in one
    # slimish extension: the loaded adapter's weight version, for a trainer's disk push (its only
    # call); left out of the body when None, so SGLang gets its own body
    weight_version: str | None = None


class UnloadLoraAdapterReq(_Strict):
    lora_name: str = Field(min_length=1)


class LoraUpdateResult(BaseModel):
    """The reply of `/load_lora_adapter` and `/unload_lora_adapter`: `loaded_adapters` maps each
    adapter name to its path. The router adds `workers` (one reply per worker) when it fans out."""

    model_config = ConfigDict(extra="allow")

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] = Field(default_factory=dict)


# What /release_memory_occupation and /resume_memory_occupation name (sglang 0.5.23: python/sglang/srt/constants.py:2)
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class MemoryOccupationReq(_Strict):
    tags: list[str] | None = None  # some of MEMORY_TAGS; None or empty: all


class ProfileReq(BaseModel):
    """`/start_profile` (every field optional). Lax: SGLang's bench client sends step counts as
    strings."""

    model_config = ConfigDict(extra="ignore")

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = Field(None, ge=1)
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_prefix: str | None = None


class TokenizeRequest(BaseModel):
    """`/tokenize` and `/v1/tokenize`: exactly one of `prompt` or `messages`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Exactly one of 'prompt' or 'messages' must be provided.")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class ControlResult(BaseModel):
    """The `{"success", "message"}` reply of control endpoints."""

    model_config = ConfigDict(extra="allow")

    success: bool
    message: str = ""


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the field path, e.g. `sampling_params.top_k: ...`.

    For a union field pydantic reports why every member failed; the user wants the member that
    got furthest (`sampling_params.max_new_tokens: ...`), not "sampling_params: not a list".
    """
    errors = [(tuple(p for p in e["loc"] if not _is_union_tag(p)), e) for e in exc.errors()]
    deepest: dict[Any, int] = {}
    for loc, _ in errors:
        root = loc[:1]
        deepest[root] = max(deepest.get(root, 0), len(loc))
    parts = []
    for loc, err in errors:
        if len(loc) < deepest[loc[:1]]:
            continue
        where = prefix + ".".join(str(p) for p in loc) if loc else (prefix.rstrip(".") or "body")
        got = err.get("input")
        shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
        parts.append(f"{where}: {err['msg']} (got {shown})")
    return "; ".join(dict.fromkeys(parts))


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member it tried (`list[int]`, `str`); the user wants the field."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "SamplingParams"})
