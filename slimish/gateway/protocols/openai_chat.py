"""OpenAI Chat Completions (`/v1/chat/completions`) on the gateway, SGLang's reply shape."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slimish.client import ServerError
from slimish.formats.openai import (
    ChatCompletionRequest,
    OpenAIError,
    active_tools,
    check_tool_choice,
    finish,
    parse_body,
    reply_message,
    sampling_params_of,
)
from slimish.formats.template import TemplateError
from slimish.gateway.turns import TurnRequest, TurnResult, session_of

if TYPE_CHECKING:
    from slimish.gateway.server import Gateway

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


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def answer() -> Response:
            body = await parse_body(request, ChatCompletionRequest)
            if body.n != 1:
                raise OpenAIError(f"n: a captured session is one trajectory, n must be 1, got {body.n}", "n")
            check_tool_choice(body)
            turn = TurnRequest(
                body.messages,
                active_tools(body),
                body.chat_template_kwargs or {},
                sampling(body),
                (body.top_logprobs or 0) if body.logprobs else 0,
                body.separate_reasoning,
            )
            reply = completion(gateway, body, await gateway.turn(session_of(request), turn))
            if body.stream:
                return StreamingResponse(_events(reply, body), media_type="text/event-stream")
            return JSONResponse(reply)

        return await openai_errors(answer)

    return api


async def openai_errors(answer: Callable[[], Awaitable[Response]]) -> Response:
    """A route's answer, or the gateway's failures as OpenAI error replies: no session (401), a
    bad request or conversation (400 naming the field), an engine or router error (its status)."""
    try:
        return await answer()
    except KeyError as exc:
        return error(401, str(exc.args[0]), "AuthenticationError")
    except TemplateError as exc:
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
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    return params


def completion(gateway: Gateway, body: ChatCompletionRequest, result: TurnResult) -> dict[str, Any]:
    reason, matched = finish(result.finish_reason, result.matched_stop, called=bool(result.reply.tool_calls))
    choice: dict[str, Any] = {
        "index": 0,
        "message": reply_message(result.reply),
        "logprobs": _logprobs(gateway, result) if body.logprobs else None,
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
        "metadata": {"weight_version": result.weight_version},
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


def _logprobs(gateway: Gateway, result: TurnResult) -> dict[str, Any]:
    meta, decode = result.meta, gateway.tokenizer.decode
    tops = meta.output_top_logprobs or [None] * len(result.completion_ids)
    content = []
    for (lp, t, *_), top in zip(meta.output_token_logprobs or [], tops):
        token = decode([t])
        alts = [{"token": decode([a]), "logprob": v, "bytes": list(decode([a]).encode())} for v, a, *_ in top or []]
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": alts})
    return {"content": content}
