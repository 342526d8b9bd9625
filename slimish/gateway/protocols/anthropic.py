"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`) on the gateway.

A request becomes the core's OpenAI chat messages: `system` a system message, a user turn's
`tool_result` blocks `tool` messages (its text a user message), an assistant turn's `tool_use`
blocks `tool_calls` and its `thinking` blocks `reasoning_content`. The parsed reply goes back as
content blocks (thinking, text, tool_use); a streamed one as Anthropic's event sequence, built
from the whole turn once it is generated (the core generates a turn in one request).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slimish.client import ServerError
from slimish.formats.template import TemplateError
from slimish.formats.tool_choice import ForcedTool, ToolChoiceError, forced_tool, function_tool
from slimish.gateway.turns import SessionLimit, TurnRequest, TurnResult, refused_field, session_of
from slimish.protocol import describe_validation_error
from slimish.serving import load_json

if TYPE_CHECKING:
    from slimish.gateway.server import Gateway

M = TypeVar("M", bound=BaseModel)

# Anthropic body field -> native sampling param (`max_tokens` is required: always `max_new_tokens`).
ANTHROPIC_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop"}
# HTTP status -> Anthropic's `error.type`; any other status is an `api_error`.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
# Which blocks each role may send (Anthropic's rule; the conversion relies on it).
BLOCKS_OF = {"user": {"text", "tool_result"}, "assistant": {"text", "thinking", "redacted_thinking", "tool_use"}}
# A thinking block must carry a signature for SDKs and harnesses to send it back; the gateway
# verifies none (a reply sent back is matched by its content and calls), so it is a fixed tag.
SIGNATURE = "slimish"
# Fields of the API the gateway cannot honour: a 400 naming the field when set to anything but
# what is listed (the fields it accepts and ignores are listed, with why, in docs/agents.md).
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "container": ("code execution containers run on Anthropic's side", ()),
    "mcp_servers": ("MCP servers are called from Anthropic's side: offer their tools as tools instead", ()),
}


# ---- request bodies (unknown fields ignored, as Anthropic adds them often) -----------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    """Encrypted reasoning (another model's): there is no text to render, so it is left out."""

    type: Literal["redacted_thinking"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False  # not rendered: chat templates have no error marker, the content says what failed


Block = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Body):
    type: Literal["custom"] | None = None  # server tools (web search, code execution...) run on Anthropic's side
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None


class ToolChoice(_Body):
    """`disable_parallel_tool_use` is not read: a forced reply is one call; with auto, the model
    writes as many calls as it writes (docs/agents.md)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class JSONOutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """`format` constrains the reply; `effort` is ignored: the chat template decides how the model reasons."""

    format: JSONOutputFormat | None = None


class ThinkingConfig(_Body):
    """Accepted; whether the model thinks is its chat template's (`chat_template_kwargs`)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=0)


class CountTokensRequest(_Body):
    """What renders the prompt: the body of `count_tokens`, and the base of a Messages request."""

    model: str = "slimish"
    system: str | list[TextBlock] | None = None
    messages: list[MessageParam] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # slimish's extra (SDK `extra_body`), as on chat completions


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # {user_id}: accepted, for Anthropic's abuse detection; nothing here
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = None  # the structured-outputs beta's name for output_config.format


class AnthropicError(Exception):
    """An error in Anthropic's shape; a 400's message starts with the field at fault."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> JSONResponse:
        error = {"type": ERROR_TYPES.get(self.status, "api_error"), "message": self.message}
        return JSONResponse({"type": "error", "error": error}, status_code=self.status)


# ---- the endpoints -------------------------------------------------------------------------------


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            session = _session(request)
            body = await parse_body(request, MessagesRequest)
            result = await gateway.turn(session, turn_request(body, sampling(body)))
        except (TemplateError, ToolChoiceError) as exc:
            return AnthropicError(400, str(exc)).response()
        except AnthropicError as exc:
            return exc.response()
        except SessionLimit as exc:
            return AnthropicError(429, str(exc)).response()
        except ServerError as exc:
            return AnthropicError(exc.status or 502, exc.message).response()  # 0: no reply upstream
        reply = message(body, result)
        if body.stream:
            return StreamingResponse(_events(reply), media_type="text/event-stream")
        return JSONResponse(reply)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Renders only: no session is needed and nothing is recorded."""
        try:
            n = gateway.count_tokens(turn_request(await parse_body(request, CountTokensRequest)))
        except (TemplateError, ToolChoiceError) as exc:
            return AnthropicError(400, str(exc)).response()
        except AnthropicError as exc:
            return exc.response()
        return JSONResponse({"input_tokens": n})

    return api


def _session(request: Request) -> str:
    try:
        return session_of(request)
    except KeyError as exc:
        raise AnthropicError(401, str(exc.args[0])) from None


async def parse_body(request: Request, model: type[M]) -> M:
    """The body as `model`, or a 400 naming the field (`body` when it is not a JSON object)."""
    try:
        data = load_json(await request.body())
    except ValueError as exc:
        raise AnthropicError(400, f"body: malformed JSON ({exc})") from None
    if not isinstance(data, dict):
        raise AnthropicError(400, f"body: expected a JSON object, got {type(data).__name__}")
    bad = refused_field(data, REFUSED)
    if bad is not None:
        raise AnthropicError(400, bad[1])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise AnthropicError(400, describe_validation_error(exc)) from None


# ---- request -> the core's OpenAI chat messages ---------------------------------------------------


def turn_request(body: CountTokensRequest, sampling: dict[str, Any] | None = None) -> TurnRequest:
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        for j, block in enumerate(m.content):
            if block.type not in BLOCKS_OF[m.role]:
                raise AnthropicError(
                    400, f"messages.{i}.content.{j}.type: {block.type} blocks are not allowed in {m.role} messages"
                )
        messages += _assistant(m.content) if m.role == "assistant" else _user(m.content)
    offered = tools(body)
    return TurnRequest(messages, offered, body.chat_template_kwargs or {}, sampling or {}, forced=forced(body, offered))


def _text(content: str | list[TextBlock]) -> str | list[dict[str, Any]]:
    """A string as is; text blocks as OpenAI text parts, joined by the core as for chat agents."""
    return content if isinstance(content, str) else [{"type": "text", "text": b.text} for b in content]


def _user(blocks: list[Any]) -> list[dict[str, Any]]:
    """Each `tool_result` a tool message, each run of text blocks a user message, in their order."""
    out: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"].append({"type": "text", "text": block.text})
        else:
            out.append({"role": "user", "content": [{"type": "text", "text": block.text}]})
    return out


def _assistant(blocks: list[Any]) -> list[dict[str, Any]]:
    """One assistant message: text blocks its content, thinking its reasoning, tool_use its calls."""
    out: dict[str, Any] = {
        "role": "assistant",
        "content": [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)],
    }
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    calls = [_call(b) for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        out["tool_calls"] = calls
    return [out]


def _call(block: ToolUseBlock) -> dict[str, Any]:
    """An OpenAI call, its arguments written as the tool-call parser writes them: a reply sent back
    has the same string (templates that render it as is render what the model wrote)."""
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def tools(body: CountTokensRequest) -> list[dict[str, Any]] | None:
    """The tools the model is offered, as OpenAI function tools (`strict` kept, so a tool renders
    as on the OpenAI protocols): none when `tool_choice` is none."""
    if not body.tools or (body.tool_choice and body.tool_choice.type == "none"):
        return None
    return [
        function_tool(t.name, t.input_schema, t.description, t.strict, f"tools.{i}") for i, t in enumerate(body.tools)
    ]


def forced(body: CountTokensRequest, offered: list[dict[str, Any]] | None) -> ForcedTool | None:
    """`tool_choice` any (some tool) or tool (that one), read as OpenAI's "required" and named
    function. The forced reply is one call, so `disable_parallel_tool_use` holds."""
    choice = body.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return None
    if choice.type == "any":
        return forced_tool("required", offered)
    if not choice.name:
        raise AnthropicError(400, "tool_choice.name: required when tool_choice.type is 'tool'")
    return forced_tool({"type": "function", "name": choice.name}, offered, "tool_choice.name")


def sampling(body: MessagesRequest) -> dict[str, Any]:
    """What the request set, in native names (the body's bounds are the engine's, so they are
    valid), and the grammar of a structured output (`output_config.format`)."""
    params = {
        ours: getattr(body, theirs) for theirs, ours in ANTHROPIC_SAMPLING.items() if getattr(body, theirs) is not None
    }
    fmt = (body.output_config.format if body.output_config else None) or body.output_format
    if fmt is not None:
        if body.tool_choice and body.tool_choice.type in ("any", "tool"):
            raise AnthropicError(400, "output_config.format: cannot be combined with forcing a tool (tool_choice)")
        params["json_schema"] = json.dumps(fmt.schema_)
    return {"max_new_tokens": body.max_tokens, **params}


# ---- the reply -----------------------------------------------------------------------------------


def message(body: MessagesRequest, result: TurnResult) -> dict[str, Any]:
    reply = result.reply
    content: list[dict[str, Any]] = []
    if reply.reasoning_content:
        content.append({"type": "thinking", "thinking": reply.reasoning_content, "signature": SIGNATURE})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        fn = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"])})
    reason, sequence = stop_reason(body, result)
    return {
        "id": f"msg_{result.id}",
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": len(result.prompt_ids), "output_tokens": len(result.completion_ids)},
    }


def stop_reason(body: MessagesRequest, result: TurnResult) -> tuple[str, str | None]:
    """Anthropic's stop reason and matched stop sequence. A stop string the request did not set
    (the run's `rollout.stop`) ends the turn; an aborted turn says `abort`, as on chat completions."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.finish_reason != "stop":
        return result.finish_reason, None
    if result.reply.tool_calls:
        return "tool_use", None
    if isinstance(result.matched_stop, str) and result.matched_stop in (body.stop_sequences or []):
        return "stop_sequence", result.matched_stop
    return "end_turn", None


async def _events(reply: dict[str, Any]) -> AsyncIterator[str]:
    """The whole reply as Anthropic's stream: message_start, each block's start, deltas and stop,
    message_delta (stop reason, usage), message_stop."""
    usage = reply["usage"]
    start = {**reply, "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
    yield _sse("message_start", {"message": start})
    for index, block in enumerate(reply["content"]):
        opening, deltas = _block_events(block)
        yield _sse("content_block_start", {"index": index, "content_block": opening})
        for delta in deltas:
            yield _sse("content_block_delta", {"index": index, "delta": delta})
        yield _sse("content_block_stop", {"index": index})
    stop = {"stop_reason": reply["stop_reason"], "stop_sequence": reply["stop_sequence"]}
    yield _sse("message_delta", {"delta": stop, "usage": {"output_tokens": usage["output_tokens"]}})
    yield _sse("message_stop", {})


def _block_events(block: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A block's `content_block_start` (empty) and the deltas that fill it."""
    if block["type"] == "thinking":
        return {**block, "thinking": "", "signature": ""}, [
            {"type": "thinking_delta", "thinking": block["thinking"]},
            {"type": "signature_delta", "signature": block["signature"]},
        ]
    if block["type"] == "text":
        return {**block, "text": ""}, [{"type": "text_delta", "text": block["text"]}]
    return {**block, "input": {}}, [
        {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    ]


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n"
