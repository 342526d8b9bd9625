"""OpenAI chat shapes shared by the engine's `/v1/chat/completions` and the capture endpoint:
request parsing with field-naming 400s, and the reply's message and finish reason.

Both servers answer the same SDKs, so they must agree to the field; the capture endpoint lives in
the rollout process and must not import the engine (torch, the scheduler) to get them.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from slimish.formats.model import Reply
from slimish.formats.template import TemplateError
from slimish.protocol import ChatCompletionRequest, CompletionRequest, SamplingParams, describe_validation_error
from slimish.serving import load_json

M = TypeVar("M", bound=BaseModel)


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


def check_tool_choice(body: ChatCompletionRequest) -> None:
    if body.tool_choice not in (None, "auto", "none"):
        raise OpenAIError(
            "tool_choice: only 'auto' and 'none' are supported (forcing a tool needs constrained decoding)",
            "tool_choice",
        )


def active_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the model is offered: none when `tool_choice` is "none"."""
    return body.tools if body.tools and body.tool_choice != "none" else None


def reply_message(reply: Reply) -> dict[str, Any]:
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
