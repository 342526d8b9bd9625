"""What a user's rollout function is given: `ctx`, one per sample call.

A rollout function is an ordinary agent program: `async def fn(ctx, sample) -> Sample | list[Sample]`.
It talks to the router through `ctx` and never edits a sample's per-token arrays itself: every
model token enters through `append_model` (mask 1, the engine's logprob, the weight version that
produced it) and every environment token through `append_env` (mask 0), so the arrays cannot
drift. Token in, token out: multi-turn samples are the engine's own output ids with the
environment's turns spliced in by `ChatTokens.env_ids` (slimish/formats), never a re-tokenised text.

`RolloutRuntime` holds what all samples of a run share (router client, tokenizer, model format,
config, and the agent gateway, started the first time an agent asks for it).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from transformers import AutoTokenizer

from slimish.client import Client
from slimish.config import RolloutConfig, RunConfig
from slimish.formats.model import ModelFormat
from slimish.formats.tokens import ChatTokens, same_message
from slimish.protocol import GenerateResponse, version_number
from slimish.rollout.capture import CaptureServer
from slimish.types import GenerateResult, Sample, SampleStatus, status_of


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
        weight_version=version_number(meta.weight_version),
        prompt_tokens=meta.prompt_tokens,
        token_versions=meta.output_versions(len(out.output_ids)),
    )


def sample_from_reply(prompt_ids: list[int], reply: dict[str, Any], **fields: Any) -> Sample:
    """A single-turn sample from a raw `/generate` reply (its JSON), with the ids, logprobs and
    versions as served: for code that calls an engine directly (benchmarks, tests)."""
    result = to_result(GenerateResponse(**reply))
    sample = Sample(prompt="", tokens=list(prompt_ids), **fields)
    sample.append_model(result.output_ids, result.logprobs, result.token_versions)
    return sample


class RolloutRuntime:
    """Shared by every sample of a run."""

    def __init__(self, cfg: RunConfig, client: Client, tokenizer: Any) -> None:
        self.cfg, self.client, self.tokenizer = cfg, client, tokenizer
        self.sampling_params = default_sampling_params(cfg.rollout)
        # The model's chat format (template, end tokens, parsers): the same object the engine builds.
        self.format = ModelFormat(tokenizer, cfg.model, cfg.rollout.tool_call_parser, cfg.rollout.reasoning_parser)
        self.capture: CaptureServer | None = None  # the agent gateway, started by the first session
        self._capture_lock = asyncio.Lock()

    def chat_tokens(self, tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> ChatTokens:
        """The chat template in token space for a tool list; template kwargs over the run's."""
        return self.format.chat(tools, **{**self.cfg.rollout.chat_template_kwargs, **(chat_template_kwargs or {})})

    @classmethod
    async def create(cls, cfg: RunConfig, router_url: str) -> "RolloutRuntime":
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, cfg.model)
        return cls(cfg, Client(router_url, api_key=cfg.launch.api_key), tokenizer)

    async def get_capture(self) -> CaptureServer:
        async with self._capture_lock:
            if self.capture is None:
                r = self.cfg.rollout
                capture = CaptureServer(self.client.base_url, self.format, self.cfg.launch.api_key, self.sampling_params,
                                        r.chat_template_kwargs, r.history, r.realign_tokens)  # fmt: skip
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

    text: str  # the model's text (reasoning and tool-call blocks included)
    content: str  # the text without reasoning and the parsed tool-call blocks
    reasoning_content: str | None  # the reasoning block's text (reasoning parser), None when there is none
    tool_calls: list[dict[str, Any]]  # OpenAI-shaped calls parsed from the text
    finish_reason: str  # stop | length | abort
    message: dict[str, Any]  # {"role": "assistant", "content", "reasoning_content"?, "tool_calls"?}
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
        self._messages: list[dict[str, Any]] = []  # the conversation ctx.chat has rendered so far
        self._last_token: int | None = None  # the model's last output id in the conversation
        self._session: str | None = None

    @property
    def resumable(self) -> bool:
        """Whether an aborted sample can be continued by calling the rollout function again:
        single-turn samples can; a conversation's state (ctx.chat, a gateway session) is not kept."""
        return self._chat is None and self._session is None

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None) -> GenerateResult:
        """Native `/generate` on the router: token ids in, token ids and logprobs out."""
        params = {**self.sampling_params, **(sampling_params or {})}
        if self._abort is not None and self._abort.is_set():
            return GenerateResult([], [], "", "abort", weight_version=-1, prompt_tokens=len(input_ids))  # nothing was asked
        out = await self.client.generate(input_ids=list(input_ids), sampling_params=params, return_logprob=True)
        assert isinstance(out, GenerateResponse)
        return to_result(out)

    async def generate_sample(self, sampling_params: dict[str, Any] | None = None,
                              chat_template_kwargs: dict[str, Any] | None = None) -> Sample:  # fmt: skip
        """One model turn on `ctx.sample`: renders its prompt the first time (chat template for
        messages), continues a partial sample within what is left of `max_new_tokens`, appends
        the tokens and sets the status from the finish reason."""
        sample = self._need_sample("generate_sample")
        if not sample.tokens:
            sample.set_prompt(self.prompt_ids(sample.prompt, chat_template_kwargs))
        params = {**self.sampling_params, **(sampling_params or {})}
        budget = params["max_new_tokens"] - sample.response_length
        if budget <= 0:
            sample.status = SampleStatus.TRUNCATED
            return sample
        self.append_model(await self.generate(sample.tokens, {**params, "max_new_tokens": budget}))
        return sample

    def prompt_ids(self, prompt: str | list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Chat messages through the chat template (with the generation prompt); text as is."""
        return self.runtime.format.prompt_ids(prompt, self.runtime.chat_tokens(None, chat_template_kwargs))

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None, sampling_params: dict[str, Any] | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None) -> ChatTurn:  # fmt: skip
        """One assistant turn of a conversation, recorded token-exactly into `ctx.sample`.

        The first call renders `messages` as the prompt. Each later call must pass the previous
        conversation, the returned `turn.message`, then the new (tool / user) messages: only the
        new ones are rendered (mask 0) after the model's own ids, so the sample holds exactly the
        ids the model saw, also where the template would re-render history differently (Qwen3
        and GLM drop earlier reasoning). Template kwargs (`enable_thinking`, `thinking`...) go
        over the run's `rollout.chat_template_kwargs` and must stay the same for a conversation.
        """
        sample = self._need_sample("chat")
        chat = self.runtime.chat_tokens(tools, chat_template_kwargs)
        if self._chat is None:
            if sample.tokens:
                raise ValueError(f"ctx.chat: sample {sample.group_id}/{sample.index} already has tokens; "
                                 "start the conversation with ctx.chat on a fresh sample")  # fmt: skip
            self._chat = chat
            sample.set_prompt(chat.prompt_ids(messages))
        else:
            if chat is not self._chat:
                raise ValueError("ctx.chat: `tools` or `chat_template_kwargs` changed between turns of one conversation; pass the same every turn")
            known = len(self._messages)
            if len(messages) <= known or not all(same_message(a, b) for a, b in zip(messages, self._messages)):
                raise ValueError(
                    "ctx.chat: `messages` must be the previous conversation, the returned turn.message, then new "
                    f"messages (expected the first {known} to be unchanged and at least one new one, got {len(messages)})"
                )
            sample.append_env(chat.env_ids(messages[known:], self._last_token))
        params = {**self.sampling_params, **(sampling_params or {})}
        fmt = self.runtime.format
        if fmt.parses(tools):
            params.setdefault("skip_special_tokens", False)
        prompt = list(sample.tokens)
        result = await self.generate(prompt, params)
        self.append_model(result)
        reply = fmt.reply(result.text, prompt, tools)
        self._messages = [*messages, reply.message()]
        self._last_token = result.output_ids[-1] if result.output_ids else None
        return ChatTurn(result.text, reply.content, reply.reasoning_content, reply.tool_calls, result.finish_reason, reply.message(), result)

    # ---- recording --------------------------------------------------------------------------

    def append_model(self, result: GenerateResult) -> None:
        """The engine's tokens (mask 1, its logprobs, its weight version); status from the finish reason."""
        sample = self._need_sample("append_model")
        sample.append_model(result.output_ids, result.logprobs, result.token_versions or result.weight_version)
        sample.status = status_of(result.finish_reason)

    def append_env(self, ids: list[int]) -> None:
        """Environment tokens (tool output, user turns): in context, mask 0."""
        self._need_sample("append_env").append_env(list(ids))

    # ---- agents on the gateway (OpenAI / Anthropic SDKs, black-box harnesses) ---------------

    async def openai_base_url(self) -> str:
        """`base_url` for `openai.AsyncOpenAI` (Chat Completions and Responses): every call
        through it is captured for this sample."""
        gateway, session = await self._gateway()
        return gateway.session_base_url(session)

    async def anthropic_base_url(self) -> str:
        """`base_url` for `anthropic.AsyncAnthropic` (Messages): captured for this sample."""
        gateway, session = await self._gateway()
        return gateway.session_url(session)

    async def agent_env(self) -> dict[str, str]:
        """Environment variables that point an unmodified agent program at this sample's session:
        `OPENAI_BASE_URL` / `ANTHROPIC_BASE_URL` name the gateway, the API keys name the session
        (many harnesses take nothing but a base URL and a key from the environment)."""
        from slimish.rollout.harness import gateway_env

        gateway, session = await self._gateway()
        return gateway_env(gateway.url, session)

    async def _gateway(self) -> tuple[CaptureServer, str]:
        """The rollout process's gateway, started on first use, and this sample's session on it."""
        sample = self._need_sample("the gateway")
        capture = await self.runtime.get_capture()
        if self._session is None:
            self._session = f"{sample.group_id}-{sample.index}-{uuid.uuid4().hex[:12]}"
            capture.session_sampling[self._session] = dict(self.sampling_params)  # what this call samples with (eval: its temperature)
        return capture, self._session

    def captured_samples(self) -> list[Sample]:
        """The exact-token samples of this context's gateway session (one per leaf of its tree)."""
        sample = self._need_sample("captured_samples")
        if self._session is None or self.runtime.capture is None:
            raise ValueError("ctx.captured_samples: no gateway session; call `await ctx.openai_base_url()` (or "
                             "anthropic_base_url, agent_env) and use it first")  # fmt: skip
        return self.runtime.capture.pop_samples(self._session, sample)

    def release(self) -> None:
        """Forget a gateway session the rollout function never collected (it raised, or was cut off)."""
        if self._session is not None and self.runtime.capture is not None and self.sample is not None:
            self.runtime.capture.pop_samples(self._session, self.sample)

    def _need_sample(self, what: str) -> Sample:
        if self.sample is None:
            raise ValueError(f"ctx.{what}: this context scores a whole group and has no sample of its own")
        return self.sample

