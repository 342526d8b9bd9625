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
import copy
import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from transformers import AutoConfig, AutoTokenizer

from slimish.client import Client
from slimish.formats.model import ModelFormat
from slimish.formats.tokens import ChatTokens, same_message
from slimish.gateway.server import Gateway
from slimish.moe import replay_shape
from slimish.protocol import GenerateResponse, reshapes, version_number
from slimish.rollout.config import RolloutConfig
from slimish.rollout.teacher import Teacher
from slimish.types import GenerateResult, Sample, SampleStatus, reply_routes, status_of

if TYPE_CHECKING:
    from slimish.config import RunConfig


F = TypeVar("F", bound=Callable[..., Any])


def resumable(fn: F) -> F:
    """Marks a rollout function that continues a partial sample itself: with
    `rollout.partial_rollout`, a sample it was building when a step ended is handed back to it
    next step, tokens and all. Without the mark only samples built by `ctx.generate_sample` alone
    are resumed; any other sample cut off by the end of a step restarts from its prompt (a
    conversation's state lives in the function, which is gone)."""
    fn.__slimish_resumable__ = True  # type: ignore[attr-defined]
    return fn


def is_resumable(fn: Any) -> bool:
    return getattr(fn, "__slimish_resumable__", False) is True


def trajectory_of(sample: Sample) -> str:
    """The sample's trajectory id, set to `group-index` where nothing set one: the samples one
    rollout call returns share it."""
    if sample.trajectory_id is None:
        sample.trajectory_id = f"{sample.group_id}-{sample.index}"
    return sample.trajectory_id


def default_sampling_params(cfg: RolloutConfig) -> dict[str, Any]:
    """The sampling params every generate call starts from (a call's own params override them)."""
    params: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
    }
    if cfg.stop:
        params["stop"] = list(cfg.stop)
    return params


def run_route_shape(cfg: RunConfig) -> tuple[int, int] | None:
    """`(layers, top_k)` of the routes a run asks its engines for (`algorithm.routing_replay: r3`),
    from the model's config; None when it asks for none. A dense model has nothing to replay."""
    if cfg.algorithm.routing_replay != "r3":
        return None
    return replay_shape("r3", AutoConfig.from_pretrained(cfg.model), str(cfg.model))


def to_result(
    out: GenerateResponse, route_shape: tuple[int, int] | None = None, routes_start: int = 0
) -> GenerateResult:
    """A `/generate` reply as rollout code sees it; a reply without one logprob per id is refused,
    and so is one without routes where they were asked for (`route_shape`: their rows' shape)."""
    meta = out.meta_info
    logprobs = [float(entry[0]) for entry in meta.output_token_logprobs or []]
    if len(logprobs) != len(out.output_ids):
        raise RuntimeError(
            f"/generate returned {len(out.output_ids)} output ids but {len(logprobs)} logprobs (request {meta.id})"
        )
    return GenerateResult(
        output_ids=list(out.output_ids),
        logprobs=logprobs,
        text=out.text,
        finish_reason=meta.finish_reason.type if meta.finish_reason else "abort",
        weight_version=version_number(meta.weight_version),
        prompt_tokens=meta.prompt_tokens,
        token_versions=meta.output_versions(len(out.output_ids)),
        # No output id (aborted before its first): nothing to route, the next request asks again.
        routed_experts=reply_routes(meta, route_shape) if route_shape and out.output_ids else None,
        routes_start=routes_start,
    )


def sample_from_reply(
    prompt_ids: list[int], reply: dict[str, Any], route_shape: tuple[int, int] | None = None, **fields: Any
) -> Sample:
    """A single-turn sample from a raw `/generate` reply (its JSON), with the ids, logprobs and
    versions as served, and its routes (`route_shape`: a request with `return_routed_experts`):
    for code that calls an engine directly (benchmarks, tests)."""
    result = to_result(GenerateResponse(**reply), route_shape)
    sample = Sample(prompt="", tokens=list(prompt_ids), **fields)
    sample.append_model(result.output_ids, result.logprobs, result.token_versions, routes=result.routed_experts)
    return sample


class RolloutRuntime:
    """Shared by every sample of a run."""

    def __init__(self, cfg: RunConfig, client: Client, tokenizer: Any, teacher: Teacher | None = None) -> None:
        self.cfg, self.client, self.tokenizer = cfg, client, tokenizer
        self.teacher = teacher  # on-policy distillation: scores every finished training sample
        self.sampling_params = default_sampling_params(cfg.rollout)
        # The model's chat format (template, end tokens, parsers): the same object the engine builds.
        self.format = ModelFormat(tokenizer, cfg.model, cfg.rollout.tool_call_parser, cfg.rollout.reasoning_parser)
        self.gateway: Gateway | None = None  # the agent gateway, started by the first session
        self._gateway_lock = asyncio.Lock()
        self.key = uuid.uuid4().hex[:8]  # this run's part of every routing key
        # trainer.lora: every generate call of the run (training, evaluation, the gateway) names
        # the run's adapter; the teacher's calls go through their own client and never do.
        self.lora = {"lora_path": cfg.trainer.lora.adapter} if cfg.trainer.lora.enabled else {}
        self.policies = [p.name for p in cfg.policies]  # `policies`: one adapter each, of its name
        if self.policies:  # a call that names none samples the first
            self.lora = {"lora_path": self.policies[0]}
        # algorithm.routing_replay=r3: every generate call of the run asks for the engine's routes
        # (the gateway's too), `(layers, top_k)` their rows' shape; None when the run does not.
        self.route_shape = run_route_shape(cfg)

    def policy(self, name: str | None) -> str | None:
        """The policy a call samples (docs/policies.md): `name`, else the run's first; None without `policies`."""
        if name is not None and name not in self.policies:
            raise ValueError(f"policy={name!r} is not one of the run's policies {self.policies} (docs/policies.md)")
        return name or next(iter(self.policies), None)

    def chat_tokens(
        self, tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None
    ) -> ChatTokens:
        """The chat template in token space for a tool list; template kwargs over the run's."""
        return self.format.chat(tools, **{**self.cfg.rollout.chat_template_kwargs, **(chat_template_kwargs or {})})

    @classmethod
    async def create(cls, cfg: RunConfig, router_url: str, teacher_url: str | None = None) -> "RolloutRuntime":
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, cfg.model)
        teacher = None
        if teacher_url:
            teacher = Teacher(
                Client(teacher_url, api_key=cfg.launch.api_key), cfg.rollout.temperature, cfg.launch.teacher.served_name
            )
        client = Client(router_url, api_key=cfg.launch.api_key, reconnect_s=cfg.launch.router_reconnect_s)
        return cls(cfg, client, tokenizer, teacher)

    async def get_gateway(self) -> Gateway:
        async with self._gateway_lock:
            if self.gateway is None:
                r = self.cfg.rollout
                gateway = Gateway(
                    self.client.base_url,
                    self.format,
                    self.cfg.launch.api_key,
                    self.sampling_params,
                    r.chat_template_kwargs,
                    r.history,
                    r.realign_tokens,
                    self.lora,
                    self.route_shape,
                    self.cfg.gateway,
                    self.client.reconnect_s,
                )
                await gateway.start()
                self.gateway = gateway
        return self.gateway

    async def close(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
            self.gateway = None
        if self.teacher is not None:
            await self.teacher.close()
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

    def __init__(
        self,
        runtime: RolloutRuntime,
        sample: Sample | None,
        sampling_params: dict[str, Any] | None = None,
        abort: asyncio.Event | None = None,
        routing_key: str | None = None,
    ) -> None:
        self.runtime, self.sample = runtime, sample
        self.client, self.tokenizer, self.config = runtime.client, runtime.tokenizer, runtime.cfg
        self.args: dict[str, Any] = runtime.cfg.rollout.args  # the plugin's own settings (`rollout.args`)
        self.sampling_params = {**runtime.sampling_params, **(sampling_params or {})}
        self._abort = abort  # set at the end of a rollout step: no new generate call is sent
        self._chat: ChatTokens | None = None
        self._messages: list[dict[str, Any]] = []  # the conversation ctx.chat has rendered so far
        self._last_token: int | None = None  # the model's last output id in the conversation
        self._session: str | None = None
        self._hand_built = False  # tokens appended by the rollout function itself
        self._resumable = True
        self._siblings: list[RolloutContext] = []
        self._calls = 0  # generate calls so far: each one's `sampling_seed` under algorithm.true_on_policy
        self._routing_key = routing_key or (
            f"{runtime.key}-{sample.group_id}-{sample.index}" if sample is not None else None
        )

    @property
    def routing_key(self) -> str | None:
        """Sent with every generate call of this sample (`X-SMG-Routing-Key`, as sglang-router
        reads it): the router's `session` policy keeps a conversation on one engine's cache."""
        return self._routing_key

    @property
    def resumable(self) -> bool:
        """Whether an aborted sample can be continued by calling the rollout function again: a
        sample built by `generate_sample` alone can; a conversation's state (ctx.chat, a gateway
        session, turns appended by hand, siblings) lives in the function and is gone."""
        return (
            self._resumable
            and self._chat is None
            and self._session is None
            and not self._hand_built
            and not self._siblings
        )

    @resumable.setter
    def resumable(self, value: bool) -> None:
        """`ctx.resumable = False`: this sample restarts from its prompt if cut off, whatever built it."""
        self._resumable = value

    @property
    def aborting(self) -> bool:
        """The step is ending: generate calls return at once, aborted (for code that talks to the router itself)."""
        return self._abort is not None and self._abort.is_set()

    def new_sample(self, prompt: str | list[dict[str, Any]] | None = None) -> "RolloutContext":
        """A sibling of this sample in the same trajectory (multi-agent fan-out: a planner and its
        workers), with its own context: `generate_sample`, `chat`, `append_*` and the gateway as
        here. Same group, label, metadata and trajectory id, so the trajectory counts once in its
        group's baseline; return `[ctx.sample, sibling.sample, ...]` from the rollout function.
        `prompt`: the sibling's own (text or messages), else this sample's."""
        parent = self._need_sample("new_sample")
        sibling = Sample(
            prompt=copy.deepcopy(parent.prompt if prompt is None else prompt),
            label=parent.label,
            group_id=parent.group_id,
            index=parent.index,
            trajectory_id=trajectory_of(parent),
            metadata=copy.deepcopy(parent.metadata),
        )
        key = f"{self._routing_key}.{len(self._siblings) + 1}"
        ctx = RolloutContext(self.runtime, sibling, self.sampling_params, self._abort, routing_key=key)
        self._siblings.append(ctx)
        return ctx

    # ---- generation -------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, policy: str | None = None
    ) -> GenerateResult:
        """Native `/generate` on the router: token ids in, token ids and logprobs out. The text
        keeps a matched stop string (SGLang's `no_stop_trim`): ids are the truth, and text that
        rollout code parses must say what the model emitted. `policy`: which of `policies` samples."""
        policy = self.runtime.policy(policy)
        params = {**self.sampling_params, **(sampling_params or {})}
        if self.runtime.cfg.algorithm.true_on_policy:
            params.setdefault("sampling_seed", self._sampling_seed())
        if self.aborting:
            return GenerateResult(
                [], [], "", "abort", weight_version=-1, prompt_tokens=len(input_ids)
            )  # nothing was asked
        params.setdefault("no_stop_trim", True)  # rollout code parses the text: a matched stop string stays in it
        shape, start = self.runtime.route_shape, self._routes_held(input_ids)
        routes = {"return_routed_experts": True, "routed_experts_start_len": start} if shape else {}
        out = await self.client.generate(
            routing_key=self._routing_key,
            input_ids=list(input_ids),
            sampling_params=params,
            return_logprob=True,
            **({"lora_path": policy} if policy else self.runtime.lora),
            **routes,
        )
        assert isinstance(out, GenerateResponse)
        return replace(to_result(out, shape, start), policy=policy, reshaped=reshapes(params))

    def _routes_held(self, input_ids: list[int]) -> int:
        """Where the routes a request asks for start: after the rows `ctx.sample` holds already
        when the request continues its tokens (each token is routed once, and the sample keeps
        the routes its tokens were generated with), else from the first token."""
        sample = self.sample
        if sample is None or sample.routed_experts is None or list(input_ids[: len(sample.tokens)]) != sample.tokens:
            return 0
        return len(sample.routed_experts)

    def _sampling_seed(self) -> int:
        """The next generate call's seed, from the run's seed, the sample (prompt, index, sibling) and
        the call's number: a token depends on nothing that changes between two runs (arrival order,
        batch mates, the run's routing key)."""
        self._calls += 1
        who = (self._routing_key or "").removeprefix(f"{self.runtime.key}-")
        digest = hashlib.blake2b(f"{self.runtime.cfg.seed}/{who}/{self._calls}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1  # 63 bits: a valid torch seed

    async def generate_sample(
        self, sampling_params: dict[str, Any] | None = None, chat_template_kwargs: dict[str, Any] | None = None
    ) -> Sample:
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
        self._record(await self.generate(sample.tokens, {**params, "max_new_tokens": budget}))
        return sample

    def prompt_ids(
        self, prompt: str | list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """Chat messages through the chat template (with the generation prompt); text as is."""
        return self.runtime.format.prompt_ids(prompt, self.runtime.chat_tokens(None, chat_template_kwargs))

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        sampling_params: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        policy: str | None = None,
    ) -> ChatTurn:
        """One assistant turn of a conversation, recorded token-exactly into `ctx.sample`.

        The first call renders `messages` as the prompt. Each later call must pass the previous
        conversation, the returned `turn.message`, then the new (tool / user) messages: only the
        new ones are rendered (mask 0) after the model's own ids, so the sample holds exactly the
        ids the model saw, also where the template would re-render history differently (Qwen3
        and GLM drop earlier reasoning). Template kwargs (`enable_thinking`, `thinking`...) go
        over the run's `rollout.chat_template_kwargs` and must stay the same for a conversation.
        The reply is parsed as an OpenAI server returns it: without its end token or a matched stop
        string (`turn.result.output_ids` has every id). `policy`: which of `policies` answers (its turn to train).
        """
        sample = self._need_sample("chat")
        chat = self.runtime.chat_tokens(tools, chat_template_kwargs)
        if self._chat is None:
            if sample.tokens:
                raise ValueError(
                    f"ctx.chat: sample {sample.group_id}/{sample.index} already has tokens; "
                    "start the conversation with ctx.chat on a fresh sample"
                )
            self._chat = chat
            sample.set_prompt(chat.prompt_ids(messages))
        else:
            if chat is not self._chat:
                raise ValueError(
                    "ctx.chat: `tools` or `chat_template_kwargs` changed between turns of one conversation; pass the same every turn"
                )
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
        params.setdefault("no_stop_trim", False)  # the reply is parsed as a server returns it: without its end token
        prompt = list(sample.tokens)
        result = await self.generate(prompt, params, policy)
        self._record(result)
        reply = fmt.reply(result.text, prompt, tools)
        self._messages = [*messages, reply.message()]
        self._last_token = result.output_ids[-1] if result.output_ids else None
        return ChatTurn(
            result.text,
            reply.content,
            reply.reasoning_content,
            reply.tool_calls,
            result.finish_reason,
            reply.message(),
            result,
        )

    # ---- recording --------------------------------------------------------------------------

    def append_model(self, result: GenerateResult) -> None:
        """The engine's tokens (mask 1, its logprobs, its weight version); status from the finish reason."""
        self._hand_built = True
        self._record(result, "append_model")

    def append_env(self, ids: list[int]) -> None:
        """Environment tokens (tool output, user turns): in context, mask 0."""
        self._hand_built = True
        self._need_sample("append_env").append_env(list(ids))

    def _record(self, result: GenerateResult, what: str = "generate") -> None:
        sample = self._need_sample(what)
        sample.append_model(
            result.output_ids,
            result.logprobs,
            result.token_versions or result.weight_version,
            result.routed_experts,
            result.routes_start,
            result.policy,
            result.reshaped,
        )
        sample.status = status_of(result.finish_reason)

    # ---- agents on the gateway (OpenAI / Anthropic SDKs, black-box harnesses) ---------------

    async def openai_base_url(self, policy: str | None = None) -> str:
        """`base_url` for `openai.AsyncOpenAI` (Chat Completions and Responses): every call
        through it is captured for this sample (`policy`: see `_gateway_session`)."""
        gateway, session = await self._gateway_session(policy)
        return gateway.session_base_url(session)

    async def anthropic_base_url(self, policy: str | None = None) -> str:
        """`base_url` for `anthropic.AsyncAnthropic` (Messages): captured for this sample."""
        gateway, session = await self._gateway_session(policy)
        return gateway.session_url(session)

    async def agent_env(self, policy: str | None = None) -> dict[str, str]:
        """Environment variables that point an unmodified agent program at this sample's session:
        `OPENAI_BASE_URL` / `ANTHROPIC_BASE_URL` name the gateway, the API keys name the session
        (many harnesses take nothing but a base URL and a key from the environment)."""
        from slimish.gateway.harness import gateway_env

        gateway, session = await self._gateway_session(policy)
        return gateway_env(gateway.url, session)

    async def _gateway_session(self, policy: str | None = None) -> tuple[Gateway, str]:
        """The rollout process's gateway, started on first use, and this sample's session on it,
        answered by `policy` (`policies`) as named by the first call (another: `ctx.new_sample`)."""
        sample, gateway = self._need_sample("the gateway"), await self.runtime.get_gateway()
        if self._session is None:  # sampled as this call samples (eval: its temperature)
            label, policy = f"{sample.group_id}-{sample.index}", self.runtime.policy(policy)
            self._session = gateway.new_session(label, self.sampling_params, policy)
        elif policy is not None and policy != (held := gateway.session_policy.get(self._session)):
            raise ValueError(f"policy={policy!r}: the sample's session is answered by {held!r} (ctx.new_sample)")
        return gateway, self._session

    def captured_samples(self) -> list[Sample]:
        """The exact-token samples of this context's gateway session (one per leaf of its tree)."""
        sample = self._need_sample("captured_samples")
        if self._session is None or self.runtime.gateway is None:
            raise ValueError(
                "ctx.captured_samples: no gateway session; call `await ctx.openai_base_url()` (or "
                "anthropic_base_url, agent_env) and use it first"
            )
        return self.runtime.gateway.pop_samples(self._session, sample)

    def release(self) -> None:
        """Forget the gateway sessions (this sample's, its siblings') the rollout function never
        collected (it raised, or was cut off)."""
        if self._session is not None and self.runtime.gateway is not None and self.sample is not None:
            self.runtime.gateway.pop_samples(self._session, self.sample)
        for sibling in self._siblings:
            sibling.release()

    def _need_sample(self, what: str) -> Sample:
        if self.sample is None:
            raise ValueError(f"ctx.{what}: this context scores a whole group and has no sample of its own")
        return self.sample
