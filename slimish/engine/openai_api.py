"""The built-in engine's OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`.

They exist so that agent programs written against the OpenAI API run unchanged on slimish
(PROTOCOL.md 3); RL itself uses native `/generate`. Replies follow SGLang 0.5.23's shapes,
field names and quirks (`matched_stop`, `metadata.weight_version`, `text_offset` of -1,
`prompt_token_ids`...), so a client tested here behaves the same against SGLang on a cluster.

Both routes expand a body into `Item`s (n copies of each prompt, prompt-major, as SGLang
orders its choices) and run them through `Engine.submit`, like `/generate`. Every token id
and logprob comes from the engine's own output, never from re-tokenising text; chat prompts
are the ids of the tokenizer's chat template.
"""

from __future__ import annotations

import inspect
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from slimish.engine.engine import Engine, Item, RequestError
from slimish.engine.scheduler import LogprobWish
from slimish.engine.scheduler import Request as Sequence
from slimish.protocol import ChatCompletionRequest, CompletionRequest, SamplingParams, describe_validation_error
from slimish.serving import load_json

M = TypeVar("M", bound=BaseModel)

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# A parsed block is removed with the whitespace after it (the newline between two calls).
TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE) + r"\s*", re.DOTALL)


class OpenAIError(Exception):
    """A 400 in OpenAI's error shape (`error.message` is what the SDKs show); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": "BadRequestError", "param": self.param, "code": 400}
        return JSONResponse({"error": error}, status_code=400)


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
        raise _field_error(describe_validation_error(exc)) from None


def _field_error(message: str, prompt_field: str = "prompt", max_field: str = "max_tokens") -> OpenAIError:
    """Native field names (the engine's checks, `SamplingParams`) -> the OpenAI body's names."""
    renames = {"sampling_params.": "", "input_ids": prompt_field, "max_new_tokens": max_field, "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
    for native, ours in renames.items():
        message = message.replace(native, ours)
    return OpenAIError(message, message.split(":", 1)[0])


def sampling_params_of(body: CompletionRequest | ChatCompletionRequest, max_new_tokens: int, max_field: str) -> SamplingParams:
    try:
        return body.sampling_params(max_new_tokens)
    except ValidationError as exc:
        raise _field_error(describe_validation_error(exc), max_field=max_field) from None


def _items(engine: Engine, body: Any, prompts: list[list[int]], params: SamplingParams, wish: LogprobWish, prefix: str,
           prompt_field: str, max_field: str) -> list[Item]:  # fmt: skip
    """n items per prompt, prompt-major; ids like `/generate` (`rid`, or `rid-i` for several)."""
    base = body.rid or f"{prefix}{uuid.uuid4().hex}"
    count = len(prompts) * body.n
    try:
        engine.check_size(count, "n")
    except RequestError as exc:
        raise _field_error(str(exc)) from None
    items = [Item(ids, params, base if count == 1 else f"{base}-{i * body.n + j}", wish) for i, ids in enumerate(prompts) for j in range(body.n)]
    for item in items:
        try:
            engine.check(item)
        except RequestError as exc:
            raise _field_error(str(exc), prompt_field, max_field) from None
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
        raise _field_error(str(exc)) from None
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if "max_tokens" not in body.model_fields_set or body.max_tokens is None:
        max_tokens = engine.default_max_new_tokens(max_tokens)
    if max_tokens < 1:
        raise OpenAIError(f"max_tokens: must be at least 1, got {max_tokens}", "max_tokens")
    want = body.logprobs is not None
    # SGLang: with echo, prompt logprobs are prepended (logprob_start_len 0).
    wish = LogprobWish(return_logprob=want, logprob_start_len=0 if want and body.echo else -1, top_logprobs_num=body.logprobs or 0)
    items = _items(engine, body, prompts, sampling_params_of(body, max_tokens, "max_tokens"), wish, "cmpl-", "prompt", "max_tokens")
    echoes = [p if isinstance(p, str) else engine.decode(p) for p in raw] if body.echo else [""] * len(raw)
    return items, [echoes[i // body.n] for i in range(len(items))]


def chat_items(engine: Engine, body: ChatCompletionRequest) -> list[Item]:
    if body.tool_choice not in (None, "auto", "none"):
        raise OpenAIError("tool_choice: only 'auto' and 'none' are supported (forcing a tool needs constrained decoding)", "tool_choice")
    if body.stream:
        for flag in ("return_token_ids", "return_prompt_token_ids", "return_meta_info"):
            if getattr(body, flag):
                raise OpenAIError(f"{flag}: not supported with streaming; set stream=false to use {flag}=true", flag)
    ids = render_chat(engine.tokenizer, body)
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # SGLang: up to the end of the context
        max_tokens = engine.default_max_new_tokens(engine.context_length - len(ids))
        if max_tokens < 1:
            raise OpenAIError(f"messages: the prompt ({len(ids)} tokens) fills the model's context length ({engine.context_length} tokens)", "messages")
    if max_tokens < 1:
        raise OpenAIError(f"{max_field}: must be at least 1, got {max_tokens}", max_field)
    params = sampling_params_of(body, max_tokens, max_field)
    if tools_active(body):  # tool-call markers may be special tokens: keep them in the text to parse
        params = params.model_copy(update={"skip_special_tokens": False})
    wish = LogprobWish(return_logprob=body.logprobs, top_logprobs_num=(body.top_logprobs or 0) if body.logprobs else 0)
    return _items(engine, body, [ids], params, wish, "chatcmpl-", "messages", max_field)


def render_chat(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    """Prompt ids from the tokenizer's chat template, with SGLang's message normalisation."""
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    tools = body.tools if tools_active(body) else None
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    for key in body.chat_template_kwargs or {}:
        if key in params and params[key].kind is not inspect.Parameter.VAR_KEYWORD:  # would change the call, not the template
            raise OpenAIError(f"chat_template_kwargs.{key}: an argument of apply_chat_template, not a template variable", "chat_template_kwargs")
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, **(body.chat_template_kwargs or {})
        )
    except Exception as exc:  # template errors are caused by the request (missing keys, bad kwargs)
        raise OpenAIError(f"messages: the chat template could not render them: {exc}", "messages") from None
    return list(ids)


def template_message(message: dict[str, Any], i: int) -> dict[str, Any]:
    """Drop null fields, join text parts (string-content templates), decode tool-call arguments."""
    if "role" not in message:
        raise OpenAIError(f"messages.{i}.role: field required", f"messages.{i}.role")
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list):
        if any(not (isinstance(p, dict) and p.get("type") == "text") for p in content):
            raise OpenAIError(f"messages.{i}.content: only text parts are supported by the built-in engine", f"messages.{i}.content")
        out["content"] = " ".join(p.get("text", "") for p in content)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_decode_arguments(c, i) for c in calls]
    return out


def _decode_arguments(call: Any, i: int) -> Any:
    """OpenAI sends `arguments` as a JSON string; templates (Qwen2.5's `| tojson`) want the object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        raise OpenAIError(f"messages.{i}.tool_calls: function.arguments must be a JSON object", f"messages.{i}.tool_calls") from None
    if not isinstance(args, dict):
        raise OpenAIError(f"messages.{i}.tool_calls: function.arguments must be a JSON object", f"messages.{i}.tool_calls")
    return {**call, "function": {**fn, "arguments": args}}


def tools_active(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


# ---- tool calls -------------------------------------------------------------------------------


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str, list[dict[str, Any]]]:
    """Qwen2.5's `<tool_call>{"name", "arguments"}</tool_call>` blocks -> (content, OpenAI tool_calls).

    A block that is not a JSON object naming one of `tool_names` stays in the content, so no model
    output is lost (SGLang drops calls to unknown tools). The content is stripped, as SGLang's.
    """
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return match.group(0)
        if not isinstance(call, dict) or call.get("name") not in tool_names:
            return match.group(0)
        args = call.get("parameters") or call.get("arguments", {})
        fn = {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "index": len(calls), "type": "function", "function": fn})
        return ""

    content = TOOL_CALL.sub(take, text)
    return content.strip(), calls


def tool_names(body: ChatCompletionRequest) -> set[str]:
    return {t.get("function", {}).get("name") for t in body.tools or [] if isinstance(t, dict)} - {None}


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
        alts = [{"token": k, "bytes": list(k.encode()), "logprob": v} for k, v in (_top_dict(engine, top) or {}).items()]
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
    reason, matched = _finish(req)
    n = len(req.output_ids)
    content, calls = engine.text_of(req, n, True), []
    if tools_active(body):
        content, calls = parse_tool_calls(content, tool_names(body))
    if calls and reason == "stop":
        reason, matched = "tool_calls", None
    message = {"role": "assistant", "content": content, "reasoning_content": None, "tool_calls": calls or None}
    choice = {
        "index": index,
        "message": message,
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
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": None, "reasoning_tokens": 0}  # fmt: skip


class _Header:
    """The fields around the choices, the same in every chunk of one response."""

    def __init__(self, engine: Engine, kind: str, body: Any, items: list[Item]) -> None:
        # The request's id: the rid of its only item, or the common base of `base-k` item rids.
        rid = items[0].rid if len(items) == 1 else items[0].rid.rsplit("-", 1)[0]
        self.fields = {"id": rid, "object": kind, "created": int(time.time()), "model": body.model or engine.served_model_name}

    def __call__(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**self.fields, "choices": choices, "usage": None, **extra}


def _final(engine: Engine, kind: str, body: Any, items: list[Item], choices: list[dict[str, Any]], reqs: list[Sequence]) -> dict[str, Any]:
    header = _Header(engine, kind, body, items)
    return header(choices, usage=_usage(reqs, body.n), metadata={"weight_version": engine.scheduler.weight_version})


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


async def _completion_stream(engine: Engine, body: CompletionRequest, items: list[Item], echoes: list[str],
                             progress: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
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
                "text": (echoes[i] if first else "") + sent.delta(i, text if up.finished else _settled(text, _stop_holds(req))),
                "logprobs": _completion_logprobs(engine, req, start, up.n, body.echo and first) if body.logprobs is not None else None,
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


async def _chat_stream(engine: Engine, body: ChatCompletionRequest, items: list[Item], progress: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """SGLang's chunk order per choice: role, content deltas (with their logprobs), finish.

    With tools, content is streamed only up to a possible `<tool_call>`; the rest of the content
    and the parsed calls come with the finish, so the deltas add up to the non-streamed message.
    """
    header, sent = _Header(engine, "chat.completion.chunk", body, items), _Sent(len(items))
    tools = tools_active(body)
    reqs: list[Sequence] = []

    def chunk(i: int, delta: dict[str, Any], logprobs: Any = None, reason: str | None = None, matched: Any = None) -> dict[str, Any]:
        return header([{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}])

    async with aclosing(progress) as updates:
        async for reqs, up in updates:
            i, req = up.index, reqs[up.index]
            start = sent.tokens[i]
            if start == 0:
                yield chunk(i, {"role": "assistant", "content": ""})
            text, calls = engine.text_of(req, up.n, up.finished), []
            if up.finished and tools:
                text, calls = parse_tool_calls(text, tool_names(body))
            elif tools:
                text = _settled(text.split(TOOL_CALL_OPEN, 1)[0], [*_stop_holds(req), TOOL_CALL_OPEN]).strip()
            elif not up.finished:
                text = _settled(text, _stop_holds(req))
            delta = sent.delta(i, text)
            sent.tokens[i] = up.n
            if delta or calls or up.n > start:
                logprobs = _chat_logprobs(engine, req, start, up.n) if body.logprobs else None
                yield chunk(i, {"content": delta, **({"tool_calls": calls} if calls else {})}, logprobs)
            if up.finished:
                reason, matched = _finish(req)
                if calls and reason == "stop":
                    reason, matched = "tool_calls", None
                yield chunk(i, {}, reason=reason, matched=matched)
    if (body.stream_options or {}).get("include_usage"):
        yield header([], usage=_usage(reqs, body.n))
