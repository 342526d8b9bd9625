"""OpenAI Chat Completions (`/v1/chat/completions`) on the gateway, SGLang's reply shape."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from slimish.client import ServerError
from slimish.formats.openai import (
    ChatCompletionRequest,
    OpenAIError,
    active_tools,
    finish,
    parse_body,
    reply_message,
    sampling_params_of,
)
from slimish.formats.template import TemplateError
from slimish.formats.tool_choice import ToolChoiceError, check_forced_alone, forced_tool, normalize_tools
from slimish.gateway.turns import SessionLimit, TurnRequest, TurnResult, refused_field, session_of
from slimish.protocol import GRAMMAR_FIELDS
from slimish.serving import load_json

if TYPE_CHECKING:
    from slimish.gateway.server import Gateway

M = TypeVar("M", bound=BaseModel)

# OpenAI body field -> native sampling param, for the fields a request may set explicitly.
OPENAI_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens",
    "min_tokens": "min_new_tokens",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "logit_bias": "logit_bias",
    "seed": "sampling_seed",
}


# Fields of the API the gateway cannot honour: a 400 naming the field when set to anything but
# what is listed (the fields it accepts and ignores are listed, with why, in docs/agents.md).
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("the legacy function fields are not supported, send `tools`", ()),
    "function_call": ("the legacy function fields are not supported, send `tool_choice`", ()),
    "audio": ("audio output is not supported", ()),
    "modalities": ("only text output is supported", (["text"],)),
    "web_search_options": ("web search runs on OpenAI's side: offer a search tool of your own instead", ()),
    "return_meta_info": ("not served by the gateway (its samples carry each turn's ids and logprobs)", (False,)),
}


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def answer() -> Response:
            body, data = await checked_body(request, ChatCompletionRequest, REFUSED)
            if body.n != 1:
                raise OpenAIError(f"n: a captured session is one trajectory, n must be 1, got {body.n}", "n")
            metadata = _metadata(data.get("metadata"))
            tools, params = active_tools(body), sampling(body)
            forced = forced_tool(body.tool_choice, normalize_tools(tools))
            check_forced_alone(forced, params, "response_format")
            turn = TurnRequest(
                body.messages,
                tools,
                body.chat_template_kwargs or {},
                params,
                (body.top_logprobs or 0) if body.logprobs else 0,
                body.separate_reasoning,
                forced,
                "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
            )
            reply = completion(gateway, body, await gateway.turn(session_of(request), turn), metadata)
            if body.stream:
                return StreamingResponse(_events(reply, body), media_type="text/event-stream")
            return JSONResponse(reply)

        return await openai_errors(answer)

    return api


async def checked_body(
    request: Request, model: type[M], refused: dict[str, tuple[str, tuple[Any, ...]]]
) -> tuple[M, dict[str, Any]]:
    """The body as `model` and as sent, or a 400 naming the field at fault (`refused_field`)."""
    body = await parse_body(request, model)
    data = load_json(await request.body())  # parse_body has checked it is a JSON object
    bad = refused_field(data, refused)
    if bad is not None:
        raise OpenAIError(bad[1], bad[0])
    return body, data


def _metadata(value: Any) -> dict[str, str]:
    """The request's `metadata`, to be echoed: up to 16 string pairs, as OpenAI takes it."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 16 or not all(isinstance(v, str) for v in value.values()):
        raise OpenAIError("metadata: expected an object of at most 16 string values", "metadata")
    return value


async def openai_errors(answer: Callable[[], Awaitable[Response]]) -> Response:
    """A route's answer, or the gateway's failures as OpenAI error replies: no session (401), a
    bad request or conversation (400 naming the field), past the gateway's bounds (429 naming the
    limit), an engine or router error (its status)."""
    try:
        return await answer()
    except KeyError as exc:
        return error(401, str(exc.args[0]), "AuthenticationError")
    except SessionLimit as exc:
        return error(429, str(exc), "RateLimitError")
    except (TemplateError, ToolChoiceError) as exc:
        return OpenAIError.of(exc).response()
    except OpenAIError as exc:
        return exc.response()
    except ServerError as exc:
        return error(exc.status or 502, exc.message, "ServerError")  # 0: no reply upstream


def error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
    )


def sampling(body: ChatCompletionRequest) -> dict[str, Any]:
    """What the request set explicitly, in native names (validated, errors naming the OpenAI field)."""
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(f"{max_field}: must be at least 1, got {max_tokens}", max_field)
    native = sampling_params_of(body, max_tokens or 1, max_field).model_dump()
    params = {ours: native[ours] for theirs, ours in OPENAI_SAMPLING.items() if theirs in body.model_fields_set}
    params |= {name: native[name] for name in GRAMMAR_FIELDS if native[name] is not None}  # response_format...
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    return params


def completion(
    gateway: Gateway, body: ChatCompletionRequest, result: TurnResult, metadata: dict[str, str]
) -> dict[str, Any]:
    reason, matched = finish(result.finish_reason, result.matched_stop, called=bool(result.reply.tool_calls))
    choice: dict[str, Any] = {
        "index": 0,
        "message": reply_message(result.reply),
        "logprobs": {"content": token_logprobs(gateway, result)} if body.logprobs else None,
        "finish_reason": reason,
        "matched_stop": matched,
    }
    if body.return_token_ids or body.return_prompt_token_ids:
        choice["prompt_token_ids"] = result.prompt_ids
    if body.return_token_ids:
        choice["response_token_ids"] = result.completion_ids
    n_in, n_out = len(result.prompt_ids), len(result.completion_ids)
    return {
        "id": f"chatcmpl-{result.id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model or "slimish",
        "choices": [choice],
        "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
        "metadata": {"weight_version": result.weight_version, **metadata},  # SGLang's field, then the request's
    }


async def _events(reply: dict[str, Any], body: ChatCompletionRequest) -> AsyncIterator[str]:
    """The whole reply as chunks: role, reasoning, content and calls, finish (then usage)."""
    choice, message = reply["choices"][0], reply["choices"][0]["message"]
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], **extra: Any) -> str:
        data = {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}],
            "usage": None,
        }
        return f"data: {json.dumps(data)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    delta: dict[str, Any] = {"content": message["content"]}
    if message["reasoning_content"]:
        delta["reasoning_content"] = message["reasoning_content"]
    if message["tool_calls"]:
        delta["tool_calls"] = message["tool_calls"]
    yield chunk(delta, logprobs=choice["logprobs"])
    yield chunk({}, finish_reason=choice["finish_reason"], matched_stop=choice["matched_stop"])
    if (body.stream_options or {}).get("include_usage"):
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': reply['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def token_logprobs(gateway: Gateway, result: TurnResult) -> list[dict[str, Any]]:
    """Every token of the turn with its logprob and alternatives (OpenAI's `logprobs.content`;
    the Responses output text's `logprobs`): reasoning and tool-call tokens included, as SGLang's."""
    meta, decode = result.meta, gateway.tokenizer.decode
    tops = meta.output_top_logprobs or [None] * len(result.completion_ids)
    content = []
    for (lp, t, *_), top in zip(meta.output_token_logprobs or [], tops):
        token = decode([t])
        alts = [{"token": decode([a]), "logprob": v, "bytes": list(decode([a]).encode())} for v, a, *_ in top or []]
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": alts})
    return content
