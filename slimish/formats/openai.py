"""OpenAI shapes shared by the engine's `/v1/completions` and `/v1/chat/completions`, the router and
the agent gateway: the request bodies (docs/protocol.md 3), their parsing with field-naming 400s,
and the reply's message and finish reason.

Both servers answer the same SDKs, so they must agree to the field; the agent gateway lives in
the rollout process and must not import the engine (torch, the scheduler) to get them.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from slimish.formats.model import ParsedReply
from slimish.formats.template import TemplateError
from slimish.protocol import SamplingParams, describe_validation_error
from slimish.serving import load_json

M = TypeVar("M", bound=BaseModel)


# --------------------------------------------------------------------------------------------
# OpenAI-compatible (docs/protocol.md 3). Lax types: SDKs send floats and ints freely.
# --------------------------------------------------------------------------------------------


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`, turned into a grammar as SGLang does (`sampling_fields`)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # SGLang also takes it at the top

    @model_validator(mode="after")
    def _has_schema(self) -> "ResponseFormat":
        if (
            self.type == "json_schema"
            and self.schema_ is None
            and not isinstance((self.json_schema or {}).get("schema"), dict)
        ):
            raise ValueError("json_schema.schema is required for a json_schema response format request")
        return self

    def sampling_fields(self) -> dict[str, str]:
        if self.type == "json_schema":
            return {"json_schema": json.dumps(self.schema_ if self.schema_ is not None else self.json_schema["schema"])}
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "structural_tag":
            return {"structural_tag": json.dumps(self.model_dump(by_alias=True, exclude_none=True))}
        return {}


class _OpenAISampling(BaseModel):
    """Fields the two OpenAI request kinds share, with SGLang's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    rid: str | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        grammar = {"regex": self.regex, "ebnf": self.ebnf, "json_schema": getattr(self, "json_schema", None)}
        if self.response_format is not None:
            grammar.update(self.response_format.sampling_fields())
        return SamplingParams(
            **{name: text for name, text in grammar.items() if text is not None},
            max_new_tokens=max_new_tokens,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=self.top_k,
            min_p=float(self.min_p),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            no_stop_trim=self.no_stop_trim,
            skip_special_tokens=self.skip_special_tokens,
            min_new_tokens=self.min_tokens,
            repetition_penalty=float(self.repetition_penalty),
            frequency_penalty=float(self.frequency_penalty),
            presence_penalty=float(self.presence_penalty),
            logit_bias=self.logit_bias,
            sampling_seed=self.seed,
        )


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    json_schema: str | None = None
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False


class ChatCompletionRequest(_OpenAISampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # SGLang: reasoning in `reasoning_content` (False: left in `content`)
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False


class OpenAIError(Exception):
    """A 400 in OpenAI's error shape (`error.message` is what the SDKs show); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param

    @classmethod
    def of(cls, exc: TemplateError) -> "OpenAIError":
        return cls(str(exc), exc.field)

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": "BadRequestError", "param": self.param, "code": 400}
        return JSONResponse({"error": error}, status_code=400)


async def parse_body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = load_json(raw)
    except ValueError as exc:
        raise OpenAIError(f"body: malformed JSON ({exc})", "body") from None
    if not isinstance(data, dict):
        raise OpenAIError(f"body: expected a JSON object, got {type(data).__name__}", "body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise field_error(describe_validation_error(exc)) from None


def field_error(message: str, prompt_field: str = "prompt", max_field: str = "max_tokens") -> OpenAIError:
    """Native field names (the engine's checks, `SamplingParams`) -> the OpenAI body's names."""
    renames = {
        "sampling_params.": "",
        "input_ids": prompt_field,
        "max_new_tokens": max_field,
        "min_new_tokens": "min_tokens",
        "sampling_seed": "seed",
    }
    for native, ours in renames.items():
        message = message.replace(native, ours)
    return OpenAIError(message, message.split(":", 1)[0])


def sampling_params_of(
    body: CompletionRequest | ChatCompletionRequest, max_new_tokens: int, max_field: str
) -> SamplingParams:
    try:
        return body.sampling_params(max_new_tokens)
    except ValidationError as exc:
        raise field_error(describe_validation_error(exc), max_field=max_field) from None


def active_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the model is offered: none when `tool_choice` is "none"."""
    return body.tools if body.tools and body.tool_choice != "none" else None


def reply_message(reply: ParsedReply) -> dict[str, Any]:
    """The choice's `message`, in SGLang's shape (every field present, null when empty)."""
    return {
        "role": "assistant",
        "content": reply.content,
        "reasoning_content": reply.reasoning_content,
        "tool_calls": reply.tool_calls or None,
    }


def finish(reason: str | None, matched: Any, called: bool) -> tuple[str | None, Any]:
    """A reply that called tools finishes with "tool_calls" (no matched stop), as SGLang's."""
    return ("tool_calls", None) if called and reason == "stop" else (reason, matched)
