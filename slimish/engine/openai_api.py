"""The built-in engine's OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`.

They exist so that agent programs written against the OpenAI API run unchanged on slimish
(docs/protocol.md 3); RL itself uses native `/generate`. Replies follow SGLang 0.5.23's shapes,
field names and quirks (`matched_stop`, `metadata.weight_version`, `text_offset` of -1,
`prompt_token_ids`...), so a client tested here behaves the same against SGLang on a cluster.

Both routes expand a body into `Item`s (n copies of each prompt, prompt-major, as SGLang
orders its choices) and run them through `Engine.submit`, like `/generate`. Every token id
and logprob comes from the engine's own output, never from re-tokenising text; chat prompts
are the ids of the tokenizer's chat template.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slimish.engine.engine import Engine
from slimish.engine.items import Item, RequestError, nth_copy
from slimish.engine.scheduler import LogprobWish, Sequence
from slimish.formats.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    active_tools,
    field_error,
    finish,
    parse_body,
    reply_message,
    sampling_params_of,
)
from slimish.formats.template import TemplateError
from slimish.formats.tool_choice import (
    ToolChoiceError,
    check_forced_alone,
    clamp_max_tokens,
    forced_tool,
    forcing_fields,
    normalize_tools,
)
from slimish.protocol import SamplingParams


def build_openai_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = await parse_body(request, CompletionRequest)
            items, echoes = completion_items(engine, body)
        except OpenAIError as exc:
            return exc.response()
        if body.stream:  # scheduled before the headers go out: a full engine is a 503, not a broken stream
            return _sse(_completion_stream(engine, body, items, echoes, engine.submit(items, stream=True)))
        reqs = await engine.generate(items)
        choices = [_completion_choice(engine, body, r, i, echoes[i]) for i, r in enumerate(reqs)]
        return JSONResponse(_final(engine, "text_completion", body, items, choices, reqs))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = await parse_body(request, ChatCompletionRequest)
            items = chat_items(engine, body)
        except OpenAIError as exc:
            return exc.response()
        if body.stream:
            return _sse(_chat_stream(engine, body, items, engine.submit(items, stream=True)))
        reqs = await engine.generate(items)
        choices = [_chat_choice(engine, body, r, i) for i, r in enumerate(reqs)]
        return JSONResponse(_final(engine, "chat.completion", body, items, choices, reqs))

    return router


# ---- requests -> items ------------------------------------------------------------------------


def _items(
    engine: Engine,
    body: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    wish: LogprobWish,
    prefix: str,
    prompt_field: str,
    max_field: str,
) -> list[Item]:
    """n items per prompt, prompt-major; ids like `/generate` (`rid`, or `rid-i` for several)."""
    base = body.rid or f"{prefix}{uuid.uuid4().hex}"
    count = len(prompts) * body.n
    try:
        engine.check_size(count, "n")
        lora = engine.adapter_of_model(body.model)
    except RequestError as exc:
        raise field_error(str(exc)) from None
    items = [
        Item(ids, nth_copy(params, j), base if count == 1 else f"{base}-{i * body.n + j}", wish, lora=lora)
        for i, ids in enumerate(prompts)
        for j in range(body.n)
    ]
    for item in items:
        try:
            engine.check(item)
        except RequestError as exc:
            raise field_error(str(exc), prompt_field, max_field) from None
    return items


def completion_items(engine: Engine, body: CompletionRequest) -> tuple[list[Item], list[str]]:
    """The items of a completions body, and per item the prompt text that `echo` prepends."""
    prompt = body.prompt
    batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    raw = list(prompt) if batch else [prompt]
    if not raw or any(not p for p in raw):
        raise OpenAIError("prompt: prompt cannot be empty", "prompt")
    try:
        prompts = [engine.tokenize(p, field="prompt") for p in raw]
    except RequestError as exc:
        raise field_error(str(exc)) from None
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if "max_tokens" not in body.model_fields_set or body.max_tokens is None:
        max_tokens = engine.default_max_new_tokens(max_tokens)
    if max_tokens < 1:
        raise OpenAIError(f"max_tokens: must be at least 1, got {max_tokens}", "max_tokens")
    want = body.logprobs is not None
    # SGLang: with echo, prompt logprobs are prepended (logprob_start_len 0).
    wish = LogprobWish(
        return_logprob=want, logprob_start_len=0 if want and body.echo else -1, top_logprobs_num=body.logprobs or 0
    )
    items = _items(
        engine, body, prompts, sampling_params_of(body, max_tokens, "max_tokens"), wish, "cmpl-", "prompt", "max_tokens"
    )
    echoes = [p if isinstance(p, str) else engine.decode(p) for p in raw] if body.echo else [""] * len(raw)
    return items, [echoes[i // body.n] for i in range(len(items))]


def chat_items(engine: Engine, body: ChatCompletionRequest) -> list[Item]:
    """A forced tool call (`tool_choice` "required" or a named function) is constrained to the
    family's own call syntax; `max_tokens` is clamped to the room the prompt leaves (docs/model-families.md)."""
    if body.stream:
        for flag in ("return_token_ids", "return_prompt_token_ids", "return_meta_info"):
            if getattr(body, flag):
                raise OpenAIError(f"{flag}: not supported with streaming; set stream=false to use {flag}=true", flag)
    tools = active_tools(body)
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    try:
        offered = normalize_tools(tools)
        forced = forced_tool(body.tool_choice, offered)
        ids = engine.format.template.render(body.messages, tools, True, **(body.chat_template_kwargs or {}))
        max_tokens = clamp_max_tokens(requested, len(ids), engine.context_length, field=max_field)
    except TemplateError as exc:
        raise OpenAIError.of(exc) from None
    except ToolChoiceError as exc:
        raise OpenAIError(str(exc), exc.field) from None
    if requested is None:  # a default the client did not choose is lowered to the engine's cap
        max_tokens = engine.default_max_new_tokens(max_tokens)
    params = sampling_params_of(body, max_tokens, max_field)
    if forced is not None:
        try:
            check_forced_alone(forced, params.model_dump(), "response_format, regex or ebnf")
            fields = forcing_fields(engine.format, ids, offered, forced)
        except ToolChoiceError as exc:
            raise OpenAIError(str(exc), exc.field) from None
        params = params.model_copy(update=fields)
    if engine.format.parses(tools, body.separate_reasoning):
        params = params.model_copy(update={"skip_special_tokens": False})
    wish = LogprobWish(return_logprob=body.logprobs, top_logprobs_num=(body.top_logprobs or 0) if body.logprobs else 0)
    return _items(engine, body, [ids], params, wish, "chatcmpl-", "messages", max_field)


# ---- replies ----------------------------------------------------------------------------------


def _settled(text: str, holds: list[str]) -> str:
    """The part of a still-growing text that can be streamed: later tokens will not change it.

    Held back: a tail that may begin one of `holds` (stop strings are cut out at the finish) and
    trailing U+FFFD (an incomplete UTF-8 character that the next byte token completes).
    """
    cut = max((k for h in holds for k in range(1, len(h)) if text.endswith(h[:k])), default=0)
    return text[: len(text) - cut].rstrip("\ufffd")


def _finish(req: Sequence) -> tuple[str | None, Any]:
    reason = req.finish_reason
    return (reason["type"], reason.get("matched")) if reason else (None, None)


def _token(engine: Engine, token_id: int) -> str:
    return engine.decode([token_id], False)


def _top_dict(engine: Engine, entry: list[tuple[float, int]] | None) -> dict[str, float] | None:
    """SGLang keys alternatives by token text; on a text collision the higher-ranked one wins."""
    if entry is None:
        return None
    out: dict[str, float] = {}
    for lp, t in entry:
        out.setdefault(_token(engine, t), lp)
    return out


def _completion_logprobs(engine: Engine, req: Sequence, start: int, end: int, with_prompt: bool) -> dict[str, Any]:
    """OpenAI legacy logprobs of output tokens [start, end), the prompt's first when echoed."""
    ids, lps = list(req.output_ids[start:end]), list(req.output_logprobs[start:end])
    tops = list(req.output_top_logprobs[start:end])
    if with_prompt:
        ids, lps = req.input_ids + ids, list(req.input_logprobs or []) + lps
        tops = list(req.input_top_logprobs or []) + tops
    return {
        "tokens": [_token(engine, t) for t in ids],
        "token_logprobs": lps,
        "top_logprobs": [_top_dict(engine, e) for e in tops] if req.wish.top_logprobs_num > 0 else [],
        "text_offset": [-1] * len(ids),  # SGLang does not compute offsets
    }


def _chat_logprobs(engine: Engine, req: Sequence, start: int, end: int) -> dict[str, Any]:
    content = []
    tops = req.output_top_logprobs[start:end] if req.wish.top_logprobs_num > 0 else [None] * (end - start)
    for t, lp, top in zip(req.output_ids[start:end], req.output_logprobs[start:end], tops):
        token = _token(engine, t)
        alts = [
            {"token": k, "bytes": list(k.encode()), "logprob": v} for k, v in (_top_dict(engine, top) or {}).items()
        ]
        content.append({"token": token, "bytes": list(token.encode()), "logprob": lp, "top_logprobs": alts})
    return {"content": content}


def _completion_choice(engine: Engine, body: CompletionRequest, req: Sequence, index: int, echo: str) -> dict[str, Any]:
    reason, matched = _finish(req)
    n = len(req.output_ids)
    choice = {
        "index": index,
        "text": echo + engine.text_of(req, n, True),
        "logprobs": _completion_logprobs(engine, req, 0, n, body.echo) if body.logprobs is not None else None,
        "finish_reason": reason,
        "matched_stop": matched,
    }
    if body.return_token_ids:
        choice.update(token_ids=list(req.output_ids), prompt_token_ids=list(req.input_ids))
    return choice


def _chat_choice(engine: Engine, body: ChatCompletionRequest, req: Sequence, index: int) -> dict[str, Any]:
    n = len(req.output_ids)
    reply = engine.format.reply(
        engine.text_of(req, n, True), req.input_ids, active_tools(body), body.separate_reasoning
    )
    reason, matched = finish(*_finish(req), called=bool(reply.tool_calls))
    choice = {
        "index": index,
        "message": reply_message(reply),
        "logprobs": _chat_logprobs(engine, req, 0, n) if body.logprobs else None,
        "finish_reason": reason,
        "matched_stop": matched,
    }
    if body.return_token_ids or body.return_prompt_token_ids:
        choice["prompt_token_ids"] = list(req.input_ids)
    if body.return_token_ids:
        choice["response_token_ids"] = list(req.output_ids)
    if body.return_meta_info:
        choice["meta_info"] = engine.reply(req, n, True, text_in_logprobs=True)["meta_info"]
    return choice


def _usage(reqs: list[Sequence], n: int) -> dict[str, Any]:
    """SGLang's count: each prompt once (the first of its n choices), every completion."""
    prompt = sum(len(reqs[i].input_ids) for i in range(0, len(reqs), n))
    completion = sum(len(r.output_ids) for r in reqs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


class _Header:
    """The fields around the choices, the same in every chunk of one response."""

    def __init__(self, engine: Engine, kind: str, body: Any, items: list[Item]) -> None:
        # The request's id: the rid of its only item, or the common base of `base-k` item rids.
        rid = items[0].rid if len(items) == 1 else items[0].rid.rsplit("-", 1)[0]
        self.fields = {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": body.model or engine.served_model_name,
        }

    def __call__(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**self.fields, "choices": choices, "usage": None, **extra}


def _final(
    engine: Engine, kind: str, body: Any, items: list[Item], choices: list[dict[str, Any]], reqs: list[Sequence]
) -> dict[str, Any]:
    header = _Header(engine, kind, body, items)
    return header(choices, usage=_usage(reqs, body.n), metadata={"weight_version": engine.version_of(reqs[0])})


# ---- streaming --------------------------------------------------------------------------------


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def _stop_holds(req: Sequence) -> list[str]:
    return [] if req.params.no_stop_trim else req.params.stop_strings()


class _Sent:
    """Per choice: the text and the number of tokens already streamed."""

    def __init__(self, count: int) -> None:
        self.text, self.tokens = [""] * count, [0] * count

    def delta(self, i: int, text: str) -> str:
        """New text since the last chunk (`text` only ever extends what was sent)."""
        new = text[len(self.text[i]) :] if text.startswith(self.text[i]) else ""
        self.text[i] += new
        return new


async def _completion_stream(
    engine: Engine, body: CompletionRequest, items: list[Item], echoes: list[str], progress: AsyncIterator[Any]
) -> AsyncIterator[dict[str, Any]]:
    header, sent = _Header(engine, "text_completion", body, items), _Sent(len(items))
    reqs: list[Sequence] = []
    async with aclosing(progress) as updates:  # a client gone aborts
        async for reqs, up in updates:
            i, req = up.index, reqs[up.index]
            start, first = sent.tokens[i], sent.tokens[i] == 0
            text = engine.text_of(req, up.n, up.finished)
            reason, matched = _finish(req) if up.finished else (None, None)
            choice: dict[str, Any] = {
                "index": i,
                "text": (echoes[i] if first else "")
                + sent.delta(i, text if up.finished else _settled(text, _stop_holds(req))),
                "logprobs": _completion_logprobs(engine, req, start, up.n, body.echo and first)
                if body.logprobs is not None
                else None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
            if body.return_token_ids:
                choice["token_ids"] = list(req.output_ids[start : up.n])
                if first:
                    choice["prompt_token_ids"] = list(req.input_ids)
            sent.tokens[i] = up.n
            yield header([choice])
    if (body.stream_options or {}).get("include_usage"):
        yield header([], usage=_usage(reqs, body.n))


async def _chat_stream(
    engine: Engine, body: ChatCompletionRequest, items: list[Item], progress: AsyncIterator[Any]
) -> AsyncIterator[dict[str, Any]]:
    """SGLang's chunk order per choice: role, deltas (reasoning, content, tool calls, with their
    logprobs), finish. The text is split by the same parsers as a whole reply, as it grows: what
    might still become a marker is held back, so the deltas add up to the non-streamed message."""
    header, sent = _Header(engine, "chat.completion.chunk", body, items), _Sent(len(items))
    tools = active_tools(body)
    streams = [engine.format.reply_stream(item.input_ids, tools, body.separate_reasoning) for item in items]
    called = [False] * len(items)
    reqs: list[Sequence] = []

    def chunk(
        i: int, delta: dict[str, Any], logprobs: Any = None, reason: str | None = None, matched: Any = None
    ) -> dict[str, Any]:
        return header(
            [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}]
        )

    async with aclosing(progress) as updates:
        async for reqs, up in updates:
            i, req = up.index, reqs[up.index]
            start = sent.tokens[i]
            if start == 0:
                yield chunk(i, {"role": "assistant", "content": ""})
            text = engine.text_of(req, up.n, up.finished)
            delta = sent.delta(i, text if up.finished else _settled(text, _stop_holds(req)))
            sent.tokens[i] = up.n
            part = streams[i].feed(delta, last=up.finished)
            called[i] = called[i] or bool(part.tool_calls)
            if part.content or part.reasoning_content or part.tool_calls or up.n > start:
                out: dict[str, Any] = {"content": part.content}
                if part.reasoning_content:
                    out["reasoning_content"] = part.reasoning_content
                if part.tool_calls:
                    out["tool_calls"] = part.tool_calls
                yield chunk(i, out, _chat_logprobs(engine, req, start, up.n) if body.logprobs else None)
            if up.finished:
                reason, matched = finish(*_finish(req), called=called[i])
                yield chunk(i, {}, reason=reason, matched=matched)
    if (body.stream_options or {}).get("include_usage"):
        yield header([], usage=_usage(reqs, body.n))
