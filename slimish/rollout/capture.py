"""An OpenAI-compatible chat endpoint that records exact tokens, for agents written against the SDK.

An agent is given `session_base_url(session_id)` as its `base_url`; every `/v1/chat/completions`
call it makes is turned into a native `/generate` on the router with explicit `input_ids`, and the
prompt ids, completion ids, logprobs and weight version of every turn are kept per session.
`pop_samples` then returns exact-token training samples: the engine's own output ids (mask 1,
with its logprobs) interleaved with the tool / user turns (mask 0), never a re-tokenised text.

Where it lives: in the rollout process, on its event loop, not in the router or the engines.
The engines stay pure SGLang protocol (so a cluster runs real SGLang behind sglang-router
unchanged), the router stays a stateless proxy, and the rollout process already holds the
tokenizer and is where the samples are needed; no token record crosses a process boundary.

Turns are chained in token space: when a request's messages are the previous turn's messages, the
assistant message we returned for it, and new (tool / user) messages, the prompt is the previous
turn's prompt + completion ids + `ChatTokens.env_ids(new messages)` (`rollout.history=exact`), or,
with `rollout.history=template`, the template's rendering of the whole conversation when that
extends the ids before it. Anything else (an edited history, a different tool list, a template that
re-renders past turns, a fresh conversation) starts a new segment, rendered by the chat template,
which becomes a separate sample: masks are never guessed across a break.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slimish.client import Client, ServerError
from slimish.formats.model import ModelFormat
from slimish.formats.openai import OpenAIError, active_tools, check_tool_choice, finish, parse_body, reply_message, sampling_params_of
from slimish.formats.template import TemplateError, normalize_message
from slimish.formats.tokens import ChatTokens, same_message
from slimish.protocol import ChatCompletionRequest, GenerateResponse
from slimish.types import Sample, status_of

# OpenAI body field -> native sampling param, for the fields a request may set explicitly.
OPENAI_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens", "min_tokens": "min_new_tokens",
    "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "logit_bias": "logit_bias", "seed": "sampling_seed",
}  # fmt: skip
START_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)


@dataclass
class _Turn:
    messages: list[dict[str, Any]]  # the request's messages, normalised
    reply: dict[str, Any]  # the assistant message returned, canonical form
    render_key: str  # tools + template kwargs: a change means the template renders differently
    env_ids: list[int]  # ids appended before this turn's prompt ran (empty for a segment's first)
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: str
    finish_reason: str


@dataclass
class _Segment:
    """One exact-token trajectory: becomes one sample."""

    turns: list[_Turn] = field(default_factory=list)
    busy: bool = False  # a turn extending it is in flight; a parallel request must not chain onto it

    def extends(self, messages: list[dict[str, Any]], render_key: str) -> bool:
        """Whether `messages` are this segment's conversation, our reply, then new messages."""
        last = self.turns[-1]
        k = len(last.messages)
        history = [*last.messages, last.reply]
        return (
            not self.busy
            and render_key == last.render_key
            and len(messages) > k + 1
            and all(same_message(a, b) for a, b in zip(messages, history))
        )

    @property
    def ids(self) -> list[int]:
        last = self.turns[-1]
        return last.prompt_ids + last.completion_ids


class _UvicornServer(uvicorn.Server):
    """uvicorn without its signal handlers: Ctrl-C belongs to the rollout process, not to this."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class CaptureServer:
    """Serves `{url}/sessions/{session_id}/v1/chat/completions` and `/v1/models` on 127.0.0.1."""

    def __init__(self, router_url: str, fmt: ModelFormat, api_key: str | None = None, default_sampling: dict | None = None,
                 chat_template_kwargs: dict | None = None, history: str = "exact") -> None:  # fmt: skip
        """`api_key` is the router's; agents may send any key. `default_sampling` (native names)
        and `chat_template_kwargs` apply to every call; what a request sets explicitly overrides
        them. `history` is `rollout.history` (exact | template)."""
        self.client = Client(router_url, api_key=api_key)
        self.format, self.tokenizer = fmt, fmt.tokenizer
        self.default_sampling = dict(default_sampling or {})
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.history = history
        self.sessions: dict[str, list[_Segment]] = {}
        self.url = ""
        self._server: _UvicornServer | None = None
        self._task: asyncio.Task | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = _UvicornServer(uvicorn.Config(self._app(), log_level="warning", lifespan="off"))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise RuntimeError(f"capture server on {self.url} exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"capture server on {self.url} did not start within {START_TIMEOUT_S} s")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        await self.client.close()

    def session_base_url(self, session_id: str) -> str:
        if not self.url:
            raise RuntimeError("CaptureServer.start() has not been awaited")
        return f"{self.url}/sessions/{session_id}/v1"

    # ---- samples ----------------------------------------------------------------------------

    def pop_samples(self, session_id: str, template: Sample) -> list[Sample]:
        """One sample per segment of the session, in the order segments began; forgets the session.
        A turn still in flight is not included."""
        samples = []
        for k, segment in enumerate(self.sessions.pop(session_id, [])):
            s = Sample(prompt=template.prompt, label=template.label, group_id=template.group_id, index=template.index,
                       metadata={**template.metadata, "capture": {"session": session_id, "segment": k, "turns": len(segment.turns)}})  # fmt: skip
            s.set_prompt(segment.turns[0].prompt_ids)
            for turn in segment.turns:
                s.append_env(turn.env_ids)
                s.append_model(turn.completion_ids, turn.logprobs, turn.weight_version)
            s.status = status_of(segment.turns[-1].finish_reason)
            s.check()
            samples.append(s)
        return samples

    # ---- HTTP -------------------------------------------------------------------------------

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/sessions/{session_id}/v1/chat/completions")
        async def chat_completions(session_id: str, request: Request) -> Response:
            try:
                return JSONResponse(await self._chat(session_id, await parse_body(request, ChatCompletionRequest)))
            except OpenAIError as exc:
                return exc.response()
            except ServerError as exc:
                error = {"message": exc.message, "type": "ServerError", "param": None, "code": exc.status}
                return JSONResponse({"error": error}, status_code=exc.status or 502)  # 0: no reply upstream

        @app.get("/sessions/{session_id}/v1/models")
        async def models(session_id: str) -> Response:
            return JSONResponse(await self.client.models())

        return app

    async def _chat(self, session_id: str, body: ChatCompletionRequest) -> dict[str, Any]:
        if body.stream:
            raise OpenAIError("stream: streaming is not supported by the capture endpoint; set stream=false", "stream")
        if body.n != 1:
            raise OpenAIError(f"n: a captured session is one trajectory, n must be 1, got {body.n}", "n")
        check_tool_choice(body)
        tools = active_tools(body)
        kwargs = {**self.chat_template_kwargs, **(body.chat_template_kwargs or {})}
        render_key = json.dumps([tools, kwargs], sort_keys=True, default=str)
        segments = self.sessions.setdefault(session_id, [])
        try:
            messages = [normalize_message(m, i) for i, m in enumerate(body.messages)]
            chat = self.format.chat(tools, **kwargs)
            segment, env = self._continuation(segments, messages, render_key, chat)
            prompt = chat.prompt_ids(messages) if segment is None else segment.ids + env
        except TemplateError as exc:
            raise OpenAIError.of(exc) from None

        params = self._sampling(body, tools)
        if segment is not None:
            segment.busy = True
        try:
            out = await self.client.generate(input_ids=prompt, sampling_params=params, return_logprob=True,
                                             top_logprobs_num=(body.top_logprobs or 0) if body.logprobs else 0)  # fmt: skip
        finally:
            if segment is not None:
                segment.busy = False
        assert isinstance(out, GenerateResponse)
        meta = out.meta_info
        reason = meta.finish_reason.type if meta.finish_reason else "abort"
        matched = meta.finish_reason.matched if meta.finish_reason else None
        reply = self.format.reply(out.text, prompt, tools, body.separate_reasoning)
        turn = _Turn(
            messages=messages, reply=reply.message(), render_key=render_key, env_ids=env,
            prompt_ids=prompt, completion_ids=list(out.output_ids), logprobs=[e[0] for e in meta.output_token_logprobs or []],
            weight_version=meta.weight_version, finish_reason=reason,
        )  # fmt: skip
        if segment is None:
            segment = _Segment()
            segments.append(segment)
        segment.turns.append(turn)

        reason, matched = finish(reason, matched, called=bool(reply.tool_calls))
        choice: dict[str, Any] = {
            "index": 0,
            "message": reply_message(reply),
            "logprobs": self._logprobs(out) if body.logprobs else None,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        if body.return_token_ids or body.return_prompt_token_ids:
            choice["prompt_token_ids"] = prompt
        if body.return_token_ids:
            choice["response_token_ids"] = list(out.output_ids)
        n_out = len(out.output_ids)
        return {
            "id": f"chatcmpl-{meta.id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or "slimish",
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out, "total_tokens": len(prompt) + n_out},
            "metadata": {"weight_version": meta.weight_version},
        }

    def _continuation(self, segments: list[_Segment], messages: list[dict[str, Any]], render_key: str,
                      chat: ChatTokens) -> tuple[_Segment | None, list[int]]:  # fmt: skip
        """The segment this request continues and the ids to append to it, or (None, []) for a new segment."""
        for segment in reversed(segments):
            if not segment.extends(messages, render_key):
                continue
            last = segment.turns[-1]
            if self.history == "exact":
                last_token = last.completion_ids[-1] if last.completion_ids else None
                return segment, chat.env_ids(messages[len(last.messages) + 1 :], last_token)
            rendered, held = chat.prompt_ids(messages), segment.ids
            if rendered[: len(held)] == held:
                return segment, rendered[len(held) :]
            log.debug("capture: the template re-renders the history of session segment %d: new segment", segments.index(segment))
            return None, []
        return None, []

    def _sampling(self, body: ChatCompletionRequest, tools: list[dict] | None) -> dict[str, Any]:
        """The defaults, overridden by what the request set explicitly (OpenAI names -> native)."""
        max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(f"{max_field}: must be at least 1, got {max_tokens}", max_field)
        native = sampling_params_of(body, max_tokens or 1, max_field).model_dump()  # validates, naming the OpenAI field
        params = dict(self.default_sampling)
        params.update({ours: native[ours] for theirs, ours in OPENAI_SAMPLING.items() if theirs in body.model_fields_set})
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        if (self.format.tools is not None and tools) or (self.format.reasoning is not None and body.separate_reasoning):
            params["skip_special_tokens"] = False  # tool-call and reasoning markers may be special tokens: keep them to parse
        return params

    def _logprobs(self, out: GenerateResponse) -> dict[str, Any]:
        tops = out.meta_info.output_top_logprobs or [None] * len(out.output_ids)
        content = []
        for (lp, t, *_), top in zip(out.meta_info.output_token_logprobs or [], tops):
            token = self.tokenizer.decode([t])
            alts = [{"token": self.tokenizer.decode([a]), "logprob": v, "bytes": list(self.tokenizer.decode([a]).encode())} for v, a, *_ in top or []]
            content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": alts})
        return {"content": content}
