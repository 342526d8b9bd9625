"""What a user's rollout function is given: `ctx`, one per sample call.

A rollout function is an ordinary agent program: `async def fn(ctx, sample) -> Sample | list[Sample]`.
It talks to the router through `ctx` and never edits a sample's per-token arrays itself: every
model token enters through `append_model` (mask 1, the engine's logprob, the weight version that
produced it) and every environment token through `append_env` (mask 0), so the arrays cannot
drift. Token in, token out: multi-turn samples are the engine's own output ids with the
environment's turns spliced in by `ChatTokens.env_ids`, never a re-tokenised text.

`RolloutRuntime` holds what all samples of a run share (router client, tokenizer, config, and the
OpenAI capture endpoint, started the first time an agent asks for it).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from transformers import AutoTokenizer

from slimish.client import Client
from slimish.config import RolloutConfig, RunConfig
from slimish.engine.openai_api import parse_tool_calls
from slimish.protocol import GenerateResponse
from slimish.rollout.capture import CaptureServer
from slimish.rollout.chat import ChatTokens, render_prompt
from slimish.types import GenerateResult, Sample, SampleStatus

STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


def default_sampling_params(cfg: RolloutConfig) -> dict[str, Any]:
    """The sampling params every generate call starts from (a call's own params override them)."""
    params: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
    if cfg.stop:
        params["stop"] = list(cfg.stop)
    return params


def to_result(out: GenerateResponse) -> GenerateResult:
    """A `/generate` reply as rollout code sees it; a reply without one logprob per id is refused."""
    meta = out.meta_info
    logprobs = [float(entry[0]) for entry in meta.output_token_logprobs or []]
    if len(logprobs) != len(out.output_ids):
        raise RuntimeError(f"/generate returned {len(out.output_ids)} output ids but {len(logprobs)} logprobs (request {meta.id})")
    return GenerateResult(
        output_ids=list(out.output_ids),
        logprobs=logprobs,
        text=out.text,
        finish_reason=meta.finish_reason.type if meta.finish_reason else "abort",
        weight_version=meta.weight_version,
        prompt_tokens=meta.prompt_tokens,
        token_versions=meta.output_versions(len(out.output_ids)),
    )


class RolloutRuntime:
    """Shared by every sample of a run."""

    def __init__(self, cfg: RunConfig, client: Client, tokenizer: Any) -> None:
        self.cfg, self.client, self.tokenizer = cfg, client, tokenizer
        self.sampling_params = default_sampling_params(cfg.rollout)
        self.capture: CaptureServer | None = None  # started by the first `ctx.openai_base_url()`
        self._capture_lock = asyncio.Lock()
        self._chat_tokens: dict[str, ChatTokens] = {}

    def chat_tokens(self, tools: list[dict] | None = None) -> ChatTokens:
        """The chat template renderer for a tool list, built once (building one renders the template)."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._chat_tokens:
            self._chat_tokens[key] = ChatTokens(self.tokenizer, tools=tools)
        return self._chat_tokens[key]

    @classmethod
    async def create(cls, cfg: RunConfig, router_url: str) -> "RolloutRuntime":
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, cfg.model)
        return cls(cfg, Client(router_url, api_key=cfg.launch.api_key), tokenizer)

    async def get_capture(self) -> CaptureServer:
        async with self._capture_lock:
            if self.capture is None:
                capture = CaptureServer(self.client.base_url, self.tokenizer, self.cfg.launch.api_key, self.sampling_params)
                await capture.start()
                self.capture = capture
        return self.capture

    async def close(self) -> None:
        if self.capture is not None:
            await self.capture.stop()
            self.capture = None
        await self.client.close()


@dataclass
class ChatTurn:
    """One assistant turn of `ctx.chat`. Append `message` to the conversation before the next call."""

    text: str  # the model's text (tool-call blocks included)
    content: str  # the text without the parsed tool-call blocks
    tool_calls: list[dict[str, Any]]  # OpenAI-shaped calls parsed from the text
    finish_reason: str  # stop | length | abort
    message: dict[str, Any]  # {"role": "assistant", "content", "tool_calls"?}
    result: GenerateResult = field(repr=False)  # the engine's reply: output ids, logprobs, weight version


class RolloutContext:
    """One per call of the rollout function (and of a reward function) on one sample."""

    def __init__(self, runtime: RolloutRuntime, sample: Sample | None, sampling_params: dict[str, Any] | None = None,
                 abort: asyncio.Event | None = None) -> None:  # fmt: skip
        self.runtime, self.sample = runtime, sample
        self.client, self.tokenizer, self.config = runtime.client, runtime.tokenizer, runtime.cfg
        self.sampling_params = {**runtime.sampling_params, **(sampling_params or {})}
        self._abort = abort  # set at the end of a rollout step: no new generate call is sent
        self._chat: ChatTokens | None = None
        self._tools: list[dict] | None = None
        self._messages: list[dict[str, Any]] = []  # the conversation ctx.chat has rendered so far
        self._ended_with_stop_token = False
        self._session: str | None = None

    @property
    def resumable(self) -> bool:
        """Whether an aborted sample can be continued by calling the rollout function again:
        single-turn samples can; a conversation's state (ctx.chat, an OpenAI session) is not kept."""
        return self._chat is None and self._session is None

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None) -> GenerateResult:
        """Native `/generate` on the router: token ids in, token ids and logprobs out."""
        params = {**self.sampling_params, **(sampling_params or {})}
        if self._abort is not None and self._abort.is_set():
            return GenerateResult([], [], "", "abort", weight_version="", prompt_tokens=len(input_ids))
        out = await self.client.generate(input_ids=list(input_ids), sampling_params=params, return_logprob=True)
        assert isinstance(out, GenerateResponse)
        return to_result(out)

    async def generate_sample(self, sampling_params: dict[str, Any] | None = None) -> Sample:
        """One model turn on `ctx.sample`: renders its prompt the first time (chat template for
        messages), continues a partial sample within what is left of `max_new_tokens`, appends
        the tokens and sets the status from the finish reason."""
        sample = self._need_sample("generate_sample")
        if not sample.tokens:
            sample.set_prompt(self.prompt_ids(sample.prompt))
        params = {**self.sampling_params, **(sampling_params or {})}
        budget = params["max_new_tokens"] - sample.response_length
        if budget <= 0:
            sample.status = SampleStatus.TRUNCATED
            return sample
        self.append_model(await self.generate(sample.tokens, {**params, "max_new_tokens": budget}))
        return sample

    def prompt_ids(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """Chat messages through the chat template (with the generation prompt); text as is."""
        return render_prompt(self.tokenizer, self.runtime.chat_tokens(), prompt)

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                   sampling_params: dict[str, Any] | None = None) -> ChatTurn:  # fmt: skip
        """One assistant turn of a conversation, recorded token-exactly into `ctx.sample`.

        The first call renders `messages` as the prompt. Each later call must pass the previous
        conversation, the returned `turn.message`, then the new (tool / user) messages: only the
        new ones are rendered (mask 0) after the model's own ids.
        """
        sample = self._need_sample("chat")
        if self._chat is None:
            if sample.tokens:
                raise ValueError(f"ctx.chat: sample {sample.group_id}/{sample.index} already has tokens; "
                                 "start the conversation with ctx.chat on a fresh sample")  # fmt: skip
            self._chat, self._tools = self.runtime.chat_tokens(tools), tools
            sample.set_prompt(self._chat.prompt_ids(messages))
        else:
            if tools != self._tools:
                raise ValueError("ctx.chat: `tools` changed between turns of one conversation; pass the same list every turn")
            known = len(self._messages)
            if len(messages) <= known or [_canonical(m) for m in messages[:known]] != [_canonical(m) for m in self._messages]:
                raise ValueError(
                    "ctx.chat: `messages` must be the previous conversation, the returned turn.message, then new "
                    f"messages (expected the first {known} to be unchanged and at least one new one, got {len(messages)})"
                )
            sample.append_env(self._chat.env_ids(messages[known:], self._ended_with_stop_token))
        params = {**self.sampling_params, **(sampling_params or {})}
        if tools:  # tool-call markers may be special tokens: keep them in the text to parse
            params.setdefault("skip_special_tokens", False)
        result = await self.generate(sample.tokens, params)
        self.append_model(result)
        names = {t.get("function", {}).get("name") for t in tools or []} - {None}
        content, calls = parse_tool_calls(result.text, names) if tools else (result.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        self._messages = [*messages, message]
        # The turn's close is in the ids when the model stopped on a stop token (not a stop string).
        stop_ids = {self._chat.end_of_turn_id, self.tokenizer.eos_token_id, *(params.get("stop_token_ids") or [])}
        self._ended_with_stop_token = result.finish_reason == "stop" and bool(result.output_ids) and result.output_ids[-1] in stop_ids
        return ChatTurn(result.text, content, calls, result.finish_reason, message, result)

    # ---- recording --------------------------------------------------------------------------

    def append_model(self, result: GenerateResult) -> None:
        """The engine's tokens (mask 1, its logprobs, its weight version); status from the finish reason."""
        sample = self._need_sample("append_model")
        sample.append_model(result.output_ids, result.logprobs, result.token_versions or result.weight_version or None)
        sample.status = STATUS[result.finish_reason]

    def append_env(self, ids: list[int]) -> None:
        """Environment tokens (tool output, user turns): in context, mask 0."""
        self._need_sample("append_env").append_env(list(ids))

    # ---- OpenAI-SDK agents ------------------------------------------------------------------

    async def openai_base_url(self) -> str:
        """`base_url` for `openai.AsyncOpenAI`: every chat call through it is captured for this sample."""
        sample = self._need_sample("openai_base_url")
        capture = await self.runtime.get_capture()
        if self._session is None:
            self._session = f"{sample.group_id}-{sample.index}-{uuid.uuid4().hex[:12]}"
        return capture.session_base_url(self._session)

    def captured_samples(self) -> list[Sample]:
        """The exact-token samples of this context's OpenAI session (one per template segment)."""
        sample = self._need_sample("captured_samples")
        if self._session is None or self.runtime.capture is None:
            raise ValueError("ctx.captured_samples: no OpenAI session; call `await ctx.openai_base_url()` and use it first")
        return self.runtime.capture.pop_samples(self._session, sample)

    def release(self) -> None:
        """Forget an OpenAI session the rollout function never collected (it raised, or was cut off)."""
        if self._session is not None and self.runtime.capture is not None and self.sample is not None:
            self.runtime.capture.pop_samples(self._session, self.sample)

    def _need_sample(self, what: str) -> Sample:
        if self.sample is None:
            raise ValueError(f"ctx.{what}: this context scores a whole group and has no sample of its own")
        return self.sample


def _canonical(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if v is not None}
