"""The agent gateway: model APIs that record exact tokens, for agents written against an SDK.

An agent is pointed at a session: by base URL (`session_base_url(id)`, the path names the
session) or by key (the plain `url`, with the session's id as its `Authorization: Bearer` or
`x-api-key` value: many harnesses take only a base URL and a key from the environment). It may
speak any of three protocols; each is a thin adapter (`slimish/gateway/protocols/`) that turns
its request into OpenAI chat messages and its reply back:

- OpenAI Chat Completions, `/v1/chat/completions`;
- OpenAI Responses, `/v1/responses`;
- Anthropic Messages, `/v1/messages` and `/v1/messages/count_tokens`.

Every turn becomes a native `/generate` on the router with explicit `input_ids`, placed in the
session's trajectory tree (`slimish/gateway/trajectory.py`: continue, realign or fork), and its
prompt ids, completion ids, logprobs and weight versions are kept. `pop_samples` then returns
exact-token training samples: the engine's own output ids (mask 1, with its logprobs)
interleaved with the tool / user turns (mask 0), never a re-tokenised text.

Where it lives: in the rollout process, on its event loop, not in the router or the engines.
The engines stay pure SGLang protocol (so a cluster runs real SGLang behind sglang-router
unchanged), the router stays a stateless proxy, and the rollout process already holds the
tokenizer and is where the samples are needed; no token record crosses a process boundary.
Streaming replies are sent as each protocol's events once the turn is generated: an agent sees
its protocol's stream, the engine generates the turn in one request.

A session's id is its only credential (the URL's, or the key): `new_session` makes ids of 128
random bits, so one agent cannot name another's session, and nothing lists them. An agent runs
code the run does not control, so what sessions hold is bounded (`GatewayConfig`): an idle
session is forgotten, and a new session or a turn past the bounds is refused with a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
from collections import OrderedDict
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from slimish.client import Client, ServerError
from slimish.formats.model import ModelFormat
from slimish.formats.openai import ChatCompletionRequest
from slimish.formats.template import normalize_message
from slimish.formats.tool_choice import clamp_max_tokens, forcing_fields, json_answer_fields, normalize_tools
from slimish.gateway.config import GatewayConfig
from slimish.gateway.protocols import anthropic, openai_chat, openai_responses
from slimish.gateway.trajectory import TrajectoryTree
from slimish.gateway.turns import SessionLimit, TurnRequest, TurnResult
from slimish.protocol import GenerateResponse, reshapes
from slimish.serving import document_bodies
from slimish.types import Sample, reply_routes

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
SESSION_PREFIX = "/sessions/{session_id}"
BODIES = {  # each protocol's request model, for /openapi.json (clients, the fuzz tests)
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": openai_responses.ResponsesRequest,
    "/v1/messages": anthropic.MessagesRequest,
    "/v1/messages/count_tokens": anthropic.CountTokensRequest,
}


class _UvicornServer(uvicorn.Server):
    """uvicorn without its signal handlers: Ctrl-C belongs to the rollout process, not to this."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class Gateway:
    """Serves every protocol under `{url}/sessions/{id}` and, for key-addressed sessions, at `{url}`."""

    def __init__(
        self,
        router_url: str,
        fmt: ModelFormat,
        api_key: str | None = None,
        default_sampling: dict | None = None,
        chat_template_kwargs: dict | None = None,
        history: str = "exact",
        realign_tokens: int = 8,
        lora: dict[str, str] | None = None,
        route_shape: tuple[int, int] | None = None,
        limits: GatewayConfig | None = None,
        reconnect_s: float = 0.0,
    ) -> None:
        """`api_key` is the router's; agents may send any key (it names their session when the
        URL does not). `default_sampling` (native names) and `chat_template_kwargs` apply to
        every call; what a request sets explicitly overrides them. `history` is
        `rollout.history` (exact | template), `realign_tokens` `rollout.realign_tokens`.
        `lora` (`{"lora_path": NAME}`, trainer.lora) goes on every turn whatever model the agent
        names: an agent's calls are the policy's, and the policy is that adapter. `route_shape`
        (`(layers, top_k)`, algorithm.routing_replay=r3): every turn asks for the engine's routes.
        `limits` (`gateway.*`): idle expiry, live sessions and the token ids they hold.
        `reconnect_s` (`launch.router_reconnect_s`): agents' turns outlive a router restart."""
        self.route_shape = route_shape
        self.client = Client(router_url, api_key=api_key, reconnect_s=reconnect_s)
        self.format, self.tokenizer = fmt, fmt.tokenizer
        self.default_sampling = dict(default_sampling or {})
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.history, self.realign_tokens = history, realign_tokens
        self.lora = dict(lora or {})
        self.limits = limits or GatewayConfig()
        self.sessions: dict[str, TrajectoryTree] = {}
        self.held = 0  # token ids the live sessions' trees hold
        self.clock = time.monotonic  # what idle expiry reads (tests move it)
        self._used: OrderedDict[str, float] = OrderedDict()  # session -> last use, least recent first
        self.session_sampling: dict[
            str, dict[str, Any]
        ] = {}  # per-session defaults (ctx's: eval lowers the temperature)
        self.session_policy: dict[str, str] = {}  # `policies`: the policy of a session that names one
        self.url = ""
        self._context_length: int | None = None
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
                raise RuntimeError(f"gateway on {self.url} exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway on {self.url} did not start within {START_TIMEOUT_S} s")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        await self.client.close()

    def session_url(self, session_id: str) -> str:
        """The session's root: Anthropic's SDK takes it as `base_url` (it adds `/v1/messages`)."""
        if not self.url:
            raise RuntimeError("Gateway.start() has not been awaited")
        return f"{self.url}/sessions/{session_id}"

    def session_base_url(self, session_id: str) -> str:
        """`base_url` for OpenAI's SDKs (they add `/chat/completions`, `/responses`)."""
        return self.session_url(session_id) + "/v1"

    # ---- sessions ---------------------------------------------------------------------------

    def new_session(self, label: str = "", sampling: dict[str, Any] | None = None, policy: str | None = None) -> str:
        """A new session's id (and credential): `label-` then 128 random bits. `sampling`: its
        defaults over the gateway's (a rollout's: evaluation lowers the temperature). `policy`: the
        run's policy (`policies`) that answers every turn of it, in place of `lora`'s adapter."""
        session_id = f"{label}-{secrets.token_urlsafe(16)}" if label else secrets.token_urlsafe(16)
        self._session(session_id)
        if sampling:
            self.session_sampling[session_id] = dict(sampling)
        if policy:
            self.session_policy[session_id] = policy
        return session_id

    def _session(self, session_id: str) -> TrajectoryTree:
        """The session's tree, opened if new (within `max_sessions`), marked used now."""
        self.expire()
        tree = self.sessions.get(session_id)
        if tree is None:
            if len(self.sessions) >= self.limits.max_sessions:
                raise SessionLimit(
                    f"gateway: {len(self.sessions)} sessions are live, the most gateway.max_sessions allows: "
                    f"collect or let sessions expire (gateway.session_idle_s) before opening more"
                )
            tree = self.sessions[session_id] = TrajectoryTree(self.history, self.realign_tokens)
        self._used[session_id] = self.clock()
        self._used.move_to_end(session_id)
        return tree

    def expire(self) -> None:
        """Forget the sessions idle for `session_idle_s` (least recently used first); each request
        runs this before it finds its session."""
        cutoff = self.clock() - self.limits.session_idle_s
        while self._used and next(iter(self._used.values())) <= cutoff:
            session_id = next(iter(self._used))
            log.warning(
                "gateway: session %s expired after %.0f s idle (gateway.session_idle_s): its turns are dropped",
                session_id,
                self.limits.session_idle_s,
            )
            self._forget(session_id)

    def _forget(self, session_id: str) -> TrajectoryTree | None:
        self._used.pop(session_id, None)
        self.session_sampling.pop(session_id, None)
        self.session_policy.pop(session_id, None)
        tree = self.sessions.pop(session_id, None)
        if tree is not None:
            self.held -= tree.held
        return tree

    # ---- the core ---------------------------------------------------------------------------

    async def turn(self, session_id: str, req: TurnRequest) -> TurnResult:
        """One model turn of a session: placed in its tree, generated (a forced tool call
        constrained, `max_new_tokens` clamped by `clamp_max_tokens`), recorded, parsed. Template
        errors raise `TemplateError`, tool and length errors `ToolChoiceError` (each a 400 naming
        the field, in each protocol's shape)."""
        tree = self._session(session_id)
        kwargs = {**self.chat_template_kwargs, **req.chat_template_kwargs}
        render_key = json.dumps([req.tools, kwargs], sort_keys=True, default=str)
        messages = [normalize_message(m, i) for i, m in enumerate(req.messages)]
        at = tree.place(messages, render_key, self.format.chat(req.tools, **kwargs))
        if self.held + len(at.prompt_ids) > self.limits.max_tokens:
            raise SessionLimit(
                f"gateway: live sessions hold {self.held} token ids, and this turn's prompt of {len(at.prompt_ids)} "
                f"would pass gateway.max_tokens ({self.limits.max_tokens}): collect or let sessions expire first"
            )
        defaults = {**self.default_sampling, **self.session_sampling.get(session_id, {})}
        params = {**defaults, **req.sampling}
        if params.get("max_new_tokens") is not None:  # the run's max_new_tokens caps what an agent asks for
            params["max_new_tokens"] = clamp_max_tokens(
                params["max_new_tokens"],
                len(at.prompt_ids),
                await self.context_length(),
                defaults.get("max_new_tokens"),
                req.max_field,
            )
        if req.forced is not None:
            params |= forcing_fields(self.format, at.prompt_ids, normalize_tools(req.tools), req.forced)
        if "json_schema" in req.sampling:  # a structured answer: after the reasoning a prompt opened
            params |= json_answer_fields(self.format, at.prompt_ids, params.pop("json_schema"))
        if self.format.parses(req.tools, req.separate_reasoning):
            params["skip_special_tokens"] = False
        start = tree.routes_held(at)
        routes = {"return_routed_experts": True, "routed_experts_start_len": start} if self.route_shape else {}
        out = await self.client.generate(
            input_ids=at.prompt_ids,
            sampling_params=params,
            return_logprob=True,
            top_logprobs_num=req.top_logprobs,
            **({"lora_path": policy} if (policy := self.session_policy.get(session_id)) else self.lora),
            **routes,
        )
        assert isinstance(out, GenerateResponse)
        meta = out.meta_info
        reason = meta.finish_reason.type if meta.finish_reason else "abort"
        reply = self.format.reply(out.text, at.prompt_ids, req.tools, req.separate_reasoning)
        ids = list(out.output_ids)
        rows = None
        if self.route_shape and ids:
            try:
                rows = reply_routes(meta, self.route_shape)
            except RuntimeError as exc:  # the turn is not recorded: no token of a sample lacks its route
                raise ServerError(self.client.base_url + "/generate", 502, str(exc)) from None
        turn = tree.add(
            at,
            messages,
            reply.message(),
            render_key,
            ids,
            [e[0] for e in meta.output_token_logprobs or []],
            meta.output_versions(len(ids)),
            reason,
            rows,
            start,
            reshapes(params),
        )
        if self.sessions.get(session_id) is tree:  # not collected or expired while it generated
            self.held += len(turn.ids)
        matched = meta.finish_reason.matched if meta.finish_reason else None
        return TurnResult(meta.id, reply, reason, matched, at.prompt_ids, ids, meta.weight_version, meta)

    async def context_length(self) -> int:
        """The engines' context length (`max_model_len` of `/v1/models`, SGLang's), asked once."""
        if self._context_length is None:
            lengths = [c["max_model_len"] for c in (await self.client.models())["data"] if c.get("max_model_len")]
            if not lengths:
                raise ServerError(self.client.base_url + "/v1/models", 502, "no model lists its max_model_len")
            self._context_length = min(lengths)
        return self._context_length

    def count_tokens(self, req: TurnRequest) -> int:
        """The prompt a new conversation of `req` would have (Anthropic's `count_tokens`)."""
        kwargs = {**self.chat_template_kwargs, **req.chat_template_kwargs}
        return len(
            self.format.chat(req.tools, **kwargs).prompt_ids(
                [normalize_message(m, i) for i, m in enumerate(req.messages)]
            )
        )

    # ---- samples ----------------------------------------------------------------------------

    def pop_samples(self, session_id: str, template: Sample) -> list[Sample]:
        """The session's samples (one per leaf of its tree), forgetting the session; a turn still
        in flight is not included. `metadata["capture"]` says which segment and branch each is."""
        policy = self.session_policy.get(session_id)
        tree = self._forget(session_id)
        if tree is None:
            return []
        meta = {"session": session_id, "segments": len(tree.roots), "realignments": tree.realignments}
        return tree.samples(template, meta, policy)

    # ---- HTTP -------------------------------------------------------------------------------

    def _app(self) -> FastAPI:
        app = FastAPI()
        document_bodies(app, {p + path: model for path, model in BODIES.items() for p in ("", SESSION_PREFIX)})
        for protocol in (openai_chat, openai_responses, anthropic):
            router = protocol.router(self)
            app.include_router(router, prefix=SESSION_PREFIX)
            app.include_router(router)  # the session named by the key

        @app.get(SESSION_PREFIX + "/v1/models")
        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse(await self.client.models())

        return app
