"""OpenAI Responses (`/v1/responses`) on the gateway: input items in, a Response object (or its
event stream) out, with `previous_response_id` chaining kept by the adapter.

Input items become OpenAI chat messages for the core: the output items of one model turn (a
reasoning item, the assistant message, its function calls) come back as consecutive items and
fold into the one assistant message they were generated as, so a re-sent history continues the
same recorded turn; `function_call_output` items become `tool` messages.

`previous_response_id`: the adapter keeps, per session, each stored response's conversation (its
input messages and its reply, as chat messages; not its `instructions`, which OpenAI does not
carry over either). A session's entries live as long as its trajectory in the core: once
`pop_samples` has collected the session they are dropped (checked on every lookup and store),
so memory follows the sessions in flight, with no cap to tune. `store: false` keeps nothing, as
on OpenAI.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slimish.formats.openai import OpenAIError, ResponseFormat
from slimish.formats.tool_choice import check_forced_alone, forced_tool, function_tool
from slimish.gateway.protocols.openai_chat import checked_body, openai_errors, token_logprobs
from slimish.gateway.turns import TurnRequest, TurnResult, session_of
from slimish.protocol import describe_validation_error

if TYPE_CHECKING:
    from slimish.gateway.server import Gateway

Conversation = list[dict[str, Any]]  # OpenAI chat messages


# ---- bodies --------------------------------------------------------------------------------


class _Lax(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextConfig(_Lax):
    format: dict[str, Any] | None = None


class ResponsesRequest(_Lax):
    """`POST /v1/responses`: the fields the gateway uses or accepts (others are ignored)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # {effort}: accepted; the chat template decides whether the model reasons
    parallel_tool_calls: bool | None = None  # accepted; the model writes as many calls as it writes
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" is honoured; the rest name items not made here
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None  # echoed; never truncates (docs/agents.md)
    chat_template_kwargs: dict[str, Any] | None = None  # SGLang's extension, as on chat completions


class FunctionTool(_Lax):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class MessageItem(_Lax):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Lax):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lax):
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningItem(_Lax):
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None


def _item(model: type[BaseModel], raw: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message = describe_validation_error(exc, prefix=f"{where}.")
        raise OpenAIError(message, message.split(":", 1)[0]) from None


# ---- request -> TurnRequest -----------------------------------------------------------------


def router(gateway: Gateway) -> APIRouter:
    api, store = APIRouter(), ResponseStore(gateway)

    @api.post("/v1/responses")
    async def responses(request: Request) -> Response:
        async def answer() -> Response:
            session = session_of(request)
            body, _ = await checked_body(request, ResponsesRequest, REFUSED)
            tools, params = chat_tools(body), sampling(body)
            choice = forced_tool(body.tool_choice, tools)  # "required" or {"type": "function", "name"}
            check_forced_alone(choice, params, "text.format")
            history = store.get(session, body.previous_response_id) if body.previous_response_id else []
            conversation = [*history, *chat_messages(body.input)]
            if not conversation:
                raise OpenAIError("input: no input items (and no previous_response_id)", "input")
            system = [{"role": "system", "content": body.instructions}] if body.instructions else []
            turn = TurnRequest(
                [*system, *conversation],
                tools,
                body.chat_template_kwargs or {},
                params,
                (body.top_logprobs or 0) if LOGPROBS in (body.include or []) else 0,
                forced=choice,
                max_field="max_output_tokens",
            )
            result = await gateway.turn(session, turn)
            reply = response_object(gateway, body, result)
            if body.store is not False:
                store.put(session, reply["id"], [*conversation, result.reply.message()])
            if body.stream:
                return StreamingResponse(_sse(reply), media_type="text/event-stream")
            return JSONResponse(reply)

        return await openai_errors(answer)

    return api


class ResponseStore:
    """Stored responses' conversations, by session, for `previous_response_id` (module docstring)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.by_session: dict[str, dict[str, Conversation]] = {}

    def get(self, session: str, response_id: str) -> Conversation:
        self._forget_collected()
        conversation = self.by_session.get(session, {}).get(response_id)
        if conversation is None:
            raise OpenAIError(
                f"previous_response_id: no stored response {response_id!r} in this session "
                "(unknown, made with store=false, or the session was already collected)",
                "previous_response_id",
            )
        return conversation

    def put(self, session: str, response_id: str, conversation: Conversation) -> None:
        self._forget_collected()
        self.by_session.setdefault(session, {})[response_id] = conversation

    def _forget_collected(self) -> None:
        """Drop the sessions `pop_samples` has collected or that expired (their trees are gone from the core)."""
        self.gateway.expire()
        for gone in self.by_session.keys() - self.gateway.sessions.keys():
            del self.by_session[gone]


# Fields of the API the gateway cannot honour: a 400 naming the field when set to anything but
# what is listed (the fields it accepts and ignores are listed, with why, in docs/agents.md).
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "background": ("the gateway answers each request as it is made, background responses are not supported", (False,)),
    "conversation": ("the Conversations API is not served: send the history as input, or previous_response_id", ()),
    "prompt": ("stored prompt templates live on OpenAI's side: send instructions and input instead", ()),
    "context_management": ("server-side compaction is not supported", ()),
}
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the output text's logprobs


def text_format(body: ResponsesRequest) -> tuple[dict[str, Any], dict[str, str]]:
    """`text.format` as sent (echoed), and its grammar: json_schema and json_object constrain the
    reply as `response_format` does on chat completions."""
    fmt = (body.text.format if body.text else None) or {"type": "text"}
    return fmt, _item(ResponseFormat, fmt, "text.format").sampling_fields()


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools, `strict` kept, so a tool renders as on chat
    completions (none when `tool_choice` is "none"); other tool types (web search, file search,
    MCP...) run on OpenAI's side and have no equivalent here."""
    tools = []
    for i, raw in enumerate(body.tools or []):
        if raw.get("type") != "function":
            raise OpenAIError(
                f"tools.{i}.type: only function tools are supported, got {raw.get('type')!r}", f"tools.{i}.type"
            )
        tool = _item(FunctionTool, raw, f"tools.{i}")
        tools.append(function_tool(tool.name, tool.parameters, tool.description, tool.strict, f"tools.{i}"))
    return tools if tools and body.tool_choice != "none" else None


def sampling(body: ResponsesRequest) -> dict[str, Any]:
    """What the request set explicitly, in native names, and the grammar of `text.format`."""
    params = {"temperature": body.temperature, "top_p": body.top_p, "max_new_tokens": body.max_output_tokens}
    return {k: v for k, v in params.items() if v is not None} | text_format(body)[1]


def chat_messages(items: str | list[dict[str, Any]]) -> Conversation:
    """Input items as chat messages. Consecutive output items of one turn (reasoning, assistant
    text, function calls, in the order the Response lists them) fold into one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: Conversation = []
    turn: dict[str, Any] | None = None  # the assistant message the current run of output items builds
    for i, raw in enumerate(items):
        kind, where = raw.get("type", "message"), f"input.{i}"
        if kind == "reasoning":
            text = _reasoning_text(_item(ReasoningItem, raw, where))
            if text is None:
                continue  # only encrypted content: nothing the template can render
            if turn is None or turn["content"] or "tool_calls" in turn or "reasoning_content" in turn:
                turn = _new_turn(messages)
            turn["reasoning_content"] = text
        elif kind == "function_call":
            call = _item(FunctionCallItem, raw, where)
            turn = turn if turn is not None else _new_turn(messages)
            turn.setdefault("tool_calls", []).append(
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            )
        elif kind == "function_call_output":
            out = _item(FunctionCallOutputItem, raw, where)
            messages.append(
                {"role": "tool", "tool_call_id": out.call_id, "content": _text(out.output, f"{where}.output")}
            )
            turn = None
        elif kind == "message":
            msg = _item(MessageItem, raw, where)
            text = _text(msg.content, f"{where}.content")
            if msg.role == "assistant":
                if turn is None or turn["content"] or "tool_calls" in turn:
                    turn = _new_turn(messages)
                turn["content"] = text
            else:  # developer messages are the system prompt of reasoning models; templates know "system"
                messages.append({"role": "user" if msg.role == "user" else "system", "content": text})
                turn = None
        else:
            raise OpenAIError(
                f"{where}.type: {kind!r} items are not supported (message, function_call, "
                "function_call_output and reasoning are)",
                f"{where}.type",
            )
    return messages


def _new_turn(messages: Conversation) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    messages.append(turn)
    return turn


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A content string, or its text parts joined as the chat adapter joins them."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise OpenAIError(f"{where}.{j}: only text parts are supported, got {part.get('type')!r}", f"{where}.{j}")
        texts.append(part["text"])
    return " ".join(texts)


def _reasoning_text(item: ReasoningItem) -> str | None:
    """The reasoning text (its content, else its summary); None when there is none."""
    parts = item.content if item.content else item.summary
    texts = [p["text"] for p in parts if isinstance(p.get("text"), str)]
    return "\n".join(texts) if texts else None


# ---- TurnResult -> Response -----------------------------------------------------------------


# The core's finish reason -> the Response's status, incomplete_details and error.
FINISH: dict[str, tuple[str, dict[str, str] | None, dict[str, str] | None]] = {
    "stop": ("completed", None, None),
    "length": ("incomplete", {"reason": "max_output_tokens"}, None),
    "abort": ("failed", None, {"code": "server_error", "message": "the engine aborted the generation"}),
}


def response_object(gateway: Gateway, body: ResponsesRequest, result: TurnResult) -> dict[str, Any]:
    """The Response as OpenAI's API returns it (every field the SDK's `Response` requires)."""
    status, details, failure = FINISH[result.finish_reason]
    output = output_items(result, token_logprobs(gateway, result) if LOGPROBS in (body.include or []) else [])
    if status == "incomplete" and output:
        output[-1]["status"] = "incomplete"  # the item the token limit cut off
    reasoning = result.reply.reasoning_content
    n_in, n_out = len(result.prompt_ids), len(result.completion_ids)
    n_reasoning = (
        len(gateway.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    )  # re-tokenised: an estimate
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": failure,
        "incomplete_details": details,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model or "slimish",
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": body.store is not False,
        "temperature": body.temperature,
        "text": {"format": text_format(body)[0]},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_logprobs": body.top_logprobs,
        "top_p": body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": n_reasoning},
            "total_tokens": n_in + n_out,
        },
        "user": None,
        "metadata": body.metadata or {},
        "weight_version": result.weight_version,  # slimish's extension, as on chat completions
    }


def output_items(result: TurnResult, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reasoning, then the assistant message (with `logprobs`, those of the whole turn when asked
    for, as on chat completions), then the function calls: the order in which the model wrote
    them and in which `chat_messages` folds them back into one turn."""
    reply, items = result.reply, []
    if reply.reasoning_content:
        items.append(
            {
                "id": _id("rs"),
                "type": "reasoning",
                "summary": [],
                "status": "completed",
                "content": [{"type": "reasoning_text", "text": reply.reasoning_content}],
            }
        )
    if reply.content:
        items.append(
            {
                "id": _id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": reply.content, "annotations": [], "logprobs": logprobs}],
            }
        )
    for call in reply.tool_calls:
        items.append(
            {
                "id": _id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- streaming ------------------------------------------------------------------------------

TEXT_EVENTS = {"message": "output_text", "reasoning": "reasoning_text"}  # item type -> its content's event prefix


def _sse(response: dict[str, Any]) -> Iterator[str]:
    """The events as `event:` / `data:` pairs, numbered by `sequence_number` (no `[DONE]`: OpenAI sends none here)."""
    for n, event in enumerate(events(response)):
        yield f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': n})}\n\n"


def events(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The whole Response as OpenAI streams one: created, in progress, each output item (added,
    its content or arguments, done), then `response.completed` (or `.incomplete`, `.failed`)."""
    start = {
        **response,
        "status": "in_progress",
        "output": [],
        "usage": None,
        "error": None,
        "incomplete_details": None,
    }
    yield {"type": "response.created", "response": start}
    yield {"type": "response.in_progress", "response": start}
    for index, item in enumerate(response["output"]):
        if item["type"] == "function_call":
            yield from _call_events(index, item)
        else:
            yield from _content_events(index, item)
    yield {"type": f"response.{response['status']}", "response": response}


def _content_events(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    kind, at = TEXT_EVENTS[item["type"]], {"item_id": item["id"], "output_index": index}
    yield {
        "type": "response.output_item.added",
        "output_index": index,
        "item": {**item, "status": "in_progress", "content": []},
    }
    for c, part in enumerate(item["content"]):
        logprobs = {"logprobs": part["logprobs"]} if kind == "output_text" else {}
        yield {"type": "response.content_part.added", **at, "content_index": c, "part": {**part, "text": ""}}
        yield {"type": f"response.{kind}.delta", **at, "content_index": c, "delta": part["text"], **logprobs}
        yield {"type": f"response.{kind}.done", **at, "content_index": c, "text": part["text"], **logprobs}
        yield {"type": "response.content_part.done", **at, "content_index": c, "part": part}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}


def _call_events(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    at = {"item_id": item["id"], "output_index": index}
    yield {
        "type": "response.output_item.added",
        "output_index": index,
        "item": {**item, "arguments": "", "status": "in_progress"},
    }
    yield {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]}
    yield {"type": "response.function_call_arguments.done", **at, "name": item["name"], "arguments": item["arguments"]}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}
