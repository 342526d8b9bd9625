"""What a protocol adapter (`slimish/gateway/protocols/`) hands the gateway's core and gets back,
and which session a request belongs to: the adapters and the core both import this, not each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from slimish.formats.model import ParsedReply

if TYPE_CHECKING:
    from slimish.formats.tool_choice import ForcedTool


@dataclass
class TurnRequest:
    """One request of any protocol, as the core sees it: OpenAI chat messages and tools."""

    messages: list[dict[str, Any]]  # OpenAI chat messages (tool_calls' arguments as JSON strings)
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)  # native sampling params the request set explicitly
    top_logprobs: int = 0
    separate_reasoning: bool = True
    forced: ForcedTool | None = None  # tool_choice "required" or a named tool: the core constrains the reply
    max_field: str = "max_tokens"  # the protocol's name for `sampling["max_new_tokens"]`, for its 400s


@dataclass
class TurnResult:
    """The engine's reply to one turn, parsed by the model's format."""

    id: str
    reply: ParsedReply
    finish_reason: str  # stop | length | abort
    matched_stop: Any
    prompt_ids: list[int]
    completion_ids: list[int]
    weight_version: str
    meta: Any  # the native MetaInfo (logprobs, top logprobs)


class SessionLimit(Exception):
    """A request the gateway's bounds refuse (`gateway.max_sessions`, `gateway.max_tokens`): a 429
    in each protocol's shape, whose message names the limit."""


def refused_field(data: dict[str, Any], refused: dict[str, tuple[str, tuple[Any, ...]]]) -> tuple[str, str] | None:
    """The first field of a request body set to what the gateway cannot honour, as (field, message):
    `refused` maps a field to why, and the values it accepts (null always is)."""
    for name, (why, accepted) in refused.items():
        if data.get(name) is not None and data[name] not in accepted:
            return name, f"{name}: {why}"
    return None


def session_of(request: Request) -> str:
    """The session a request belongs to: the URL's, else its key (`Authorization: Bearer` or `x-api-key`)."""
    if "session_id" in request.path_params:
        return request.path_params["session_id"]
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "").strip()
    if not key:
        raise KeyError("no session: use a session URL, or the session id as the API key")
    return key
