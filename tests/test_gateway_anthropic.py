"""Anthropic Messages on the gateway: agents on the real `anthropic` SDK against a real engine.

The acceptance test sends the 3-turn tool conversation of tests/family_cases.py (tool call, tool
result, answer, user follow-up, answer) through `/v1/messages`, plain and streamed, on fitted
models of real families, and gets the ids, masks and logprobs `ctx.chat` records for it. The
other tests run on the default tiny model: token counts, key-addressed sessions, stop reasons,
errors in Anthropic's shape, and the `anthropic_agent` plugin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from family_cases import CASES, TURNS, Case, conversation, expected
from helpers import run_plugin, with_gateway
from test_family_formats import run_ctx_chat
from transformers import AutoTokenizer

from slimish.formats.model import ModelFormat
from slimish.gateway.server import Gateway
from slimish.net import free_port
from slimish.types import Sample, SampleStatus

# Reasoning (Qwen3), Llama 3.1's JSON calls, and GLM-4.6 (reasoning; its turns are closed by the next turn's opener).
GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py): these tests only generate
ANTHROPIC_CASES = [c for c in CASES if c.name in ("qwen3", "llama3.1", "glm4.6")]
RAW_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}
GREEDY = {"temperature": 0.0}
OPENING = [{"role": "user", "content": "What is (2+3)*4?"}]
CALCULATOR = {
    "name": "calculator",
    "description": "Evaluate arithmetic",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}


def sdk(base_url: str, api_key: str = "slimish") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


async def create(
    client: anthropic.AsyncAnthropic, stream: bool, **kw: Any
) -> tuple[anthropic.types.Message, list[str]]:
    """A reply by `messages.create`, or by `messages.stream(...).get_final_message()` with the raw
    event types the stream carried."""
    if not stream:
        return await client.messages.create(**kw), []
    async with client.messages.stream(**kw) as events:
        types = [event.type async for event in events if event.type in RAW_EVENTS]
        return await events.get_final_message(), types


# ---- the acceptance test: one conversation, ctx.chat's exact ids -------------------------------------


@pytest.fixture(scope="module", params=ANTHROPIC_CASES, ids=[c.name for c in ANTHROPIC_CASES])
def case(request) -> Case:
    return request.param


@pytest.fixture(scope="module")
def reference(served: tuple[str, Path], case: Case) -> Sample:
    """What `ctx.chat` records for the case's conversation."""
    url, model = served
    return run_ctx_chat(model, url, case)


def anthropic_tools(case: Case) -> list[dict[str, Any]]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in case.tools
    ]


def event_sequence(reply: anthropic.types.Message) -> list[str]:
    """The raw events a streamed reply comes as: each block opened, filled (a thinking block: its
    text, then its signature) and closed, between the message's start and its stop reason."""
    events = ["message_start"]
    for block in reply.content:
        events += [
            "content_block_start",
            *["content_block_delta"] * (2 if block.type == "thinking" else 1),
            "content_block_stop",
        ]
    return [*events, "message_delta", "message_stop"]


def check_reply(case: Case, k: int, reply: anthropic.types.Message) -> None:
    """The k-th assistant turn as content blocks: thinking (with a signature), text, tool_use."""
    want = conversation(case)[TURNS[k]]
    kinds = ["thinking"] * ("reasoning_content" in want) + ["text"] * bool(want["content"]) + ["tool_use"] * (k == 0)
    assert [b.type for b in reply.content] == kinds
    blocks = {b.type: b for b in reply.content}
    if "thinking" in blocks:
        assert blocks["thinking"].thinking == want["reasoning_content"] and blocks["thinking"].signature
    assert (blocks["text"].text if "text" in blocks else "") == want["content"]
    if k == 0:
        call = blocks["tool_use"]
        assert (call.name, call.input) == (case.tool["function"]["name"], case.call_args) and call.id
    assert reply.stop_reason == ("tool_use" if k == 0 else "end_turn") and reply.stop_sequence is None
    assert reply.role == "assistant" and reply.id.startswith("msg_") and reply.usage.output_tokens > 0


async def anthropic_conversation(gateway: Gateway, case: Case, stream: bool) -> list[Sample]:
    """The case's conversation through `/v1/messages`; each reply sent back as the agent got it
    (the SDK's blocks after the tool call, plain dicts after the answer), thinking included."""
    conv = conversation(case)
    client = sdk(gateway.session_url("s"))
    kw = dict(
        model="m",
        system=conv[0]["content"],
        tools=anthropic_tools(case),
        max_tokens=96,
        extra_body={"temperature": 0, "chat_template_kwargs": case.kwargs},
    )
    messages: list[Any] = [{"role": "user", "content": conv[1]["content"]}]
    counted = await client.messages.count_tokens(
        model="m", system=kw["system"], tools=kw["tools"], messages=messages, extra_body=kw["extra_body"]
    )
    for k in range(3):
        reply, events = await create(client, stream, messages=messages, **kw)
        check_reply(case, k, reply)
        if k == 0:
            assert reply.usage.input_tokens == counted.input_tokens
        if stream:
            assert events == event_sequence(reply)
        echoed = reply.content if k == 0 else [b.model_dump(exclude_none=True) for b in reply.content]
        messages = [*messages, {"role": "assistant", "content": echoed}]
        if k == 0:
            call = next(b for b in reply.content if b.type == "tool_use")
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call.id, "content": conv[3]["content"]}],
                }
            )
        elif k == 1:
            messages.append({"role": "user", "content": conv[5]["content"]})
    return gateway.pop_samples("s", Sample(prompt=conv[:2]))


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_tool_conversation_records_the_ids_ctx_chat_records(
    served: tuple[str, Path], case: Case, reference: Sample, stream: bool
) -> None:
    url, model = served
    tok = AutoTokenizer.from_pretrained(model)
    (captured,) = with_gateway(url, tok, lambda c: anthropic_conversation(c, case, stream))
    captured.check()
    assert captured.metadata["capture"]["how"] == ["start", "continue", "continue"]
    assert captured.tokens == reference.tokens == expected(ModelFormat(tok), case).exact
    assert captured.loss_mask == reference.loss_mask and captured.prompt_length == reference.prompt_length
    assert captured.rollout_logprobs == pytest.approx(reference.rollout_logprobs, abs=1e-5)
    assert captured.status == SampleStatus.COMPLETED


# ---- the tiny model: counts, keys, stop reasons, errors, the plugin -------------------------------------------


def test_count_tokens_and_a_session_named_by_the_key(engine: str, tok: Any) -> None:
    """`count_tokens` is the prompt's length; a client on the plain URL with the session id as its
    key records into that session; `tool_choice: none` offers no tools."""
    fn = {
        "name": CALCULATOR["name"],
        "description": CALCULATOR["description"],
        "parameters": CALCULATOR["input_schema"],
    }
    chat = ModelFormat(tok).chat([{"type": "function", "function": fn}])

    async def agent(gateway: Gateway) -> tuple[list[int], anthropic.types.Message, list[Sample]]:
        client = sdk(gateway.url, api_key="by-key")
        counts = [
            (await client.messages.count_tokens(model="m", system="Be brief.", messages=OPENING, **kw)).input_tokens
            for kw in ({"tools": [CALCULATOR]}, {"tools": [CALCULATOR], "tool_choice": {"type": "none"}}, {})
        ]
        reply = await client.messages.create(
            model="m",
            system="Be brief.",
            messages=OPENING,
            tools=[CALCULATOR],
            max_tokens=3,
            extra_body={"temperature": 0},
        )
        return counts, reply, gateway.pop_samples("by-key", Sample(prompt=OPENING))

    counts, reply, (sample,) = with_gateway(engine, tok, agent)
    prompt = chat.prompt_ids([{"role": "system", "content": "Be brief."}, *OPENING])
    assert counts[0] == len(prompt) == reply.usage.input_tokens and counts[1] == counts[2] < counts[0]
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3
    assert sample.tokens[: sample.prompt_length] == prompt and sample.loss_mask == [1] * 3


def test_a_stop_sequence_is_named(engine: str, tok: Any) -> None:
    """A stop sequence the request set ends the turn (its text left out) and is named.
    (`end_turn` and `tool_use`: the acceptance test; `max_tokens`: the key-addressed session.)"""

    async def agent(gateway: Gateway) -> tuple[str, anthropic.types.Message]:
        client = sdk(gateway.session_url("stops"))
        free = await client.messages.create(model="m", messages=OPENING, max_tokens=12)
        return free.content[0].text, await client.messages.create(
            model="m", messages=OPENING, max_tokens=12, stop_sequences=["\x00never", stop_in(free.content[0].text)]
        )

    text, stopped = with_gateway(engine, tok, agent, default_sampling=GREEDY)
    stop = stop_in(text)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in stopped.content) == text[: text.index(stop)]


def stop_in(text: str) -> str:
    """Two characters from the second half of a greedy reply: a stop sequence it will meet."""
    stop = text[len(text) // 2 :][:2]
    assert stop.strip(), text
    return stop


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": OPENING}, "max_tokens"),
        ({"messages": OPENING, "max_tokens": 0}, "max_tokens"),
        ({"messages": [], "max_tokens": 4}, "messages"),
        ({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 4}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
            "messages.0.content.0",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "calculator", "input": {}}]}
                ],
                "max_tokens": 4,
            },
            "messages.0.content.0.type",
        ),
        ({"messages": OPENING, "max_tokens": 4, "temperature": -1}, "temperature"),
        ({"messages": OPENING, "max_tokens": 4, "top_k": 0}, "top_k"),
        ({"messages": OPENING, "max_tokens": 4, "stop_sequences": "x"}, "stop_sequences"),
        (
            {"messages": OPENING, "max_tokens": 4, "tools": [{"name": "web_search", "type": "web_search_20250305"}]},
            "tools.0.type",
        ),
        (
            {"messages": OPENING, "max_tokens": 4, "tools": [CALCULATOR], "tool_choice": {"type": "tool", "name": "x"}},
            "tool_choice.name",
        ),
        ({"messages": OPENING, "max_tokens": 4, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"messages": OPENING, "max_tokens": 4, "container": "c"}, "container"),
        ({"messages": OPENING, "max_tokens": 4, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(engine: str, tok: Any, body: dict[str, Any], field: str) -> None:
    async def post(gateway: Gateway) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(gateway.session_url("bad") + "/v1/messages", json=body)

    r = with_gateway(engine, tok, post)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(field + ":"), r.json()


def test_errors_in_anthropics_shape(engine: str, tok: Any) -> None:
    """The SDK raises its own errors: 400 for a body, 401 without a session, the upstream's status
    (502 when nothing answers) as an `api_error`; the thinking field is accepted."""

    async def calls(gateway: Gateway) -> list[Any]:
        out: list[Any] = []
        async with httpx.AsyncClient(timeout=60) as http:
            out.append(await http.post(gateway.url + "/v1/messages", json={"messages": OPENING, "max_tokens": 4}))
            out.append(await http.post(gateway.session_url("x") + "/v1/messages", content=b"{not json"))
        try:
            await sdk(gateway.session_url("x")).messages.create(
                model="m", messages=OPENING, max_tokens=4, tool_choice={"type": "tool", "name": "x"}, tools=[CALCULATOR]
            )
        except anthropic.BadRequestError as exc:
            out.append(exc)
        thinking = await sdk(gateway.session_url("x")).messages.create(
            model="m", messages=OPENING, max_tokens=2, thinking={"type": "enabled", "budget_tokens": 1024}
        )
        out.append(thinking.stop_reason)
        return out

    no_session, malformed, bad, thinking = with_gateway(engine, tok, calls)
    assert no_session.status_code == 401 and no_session.json()["error"]["type"] == "authentication_error"
    assert malformed.status_code == 400 and malformed.json()["error"]["message"].startswith("body:")
    assert isinstance(bad, anthropic.BadRequestError) and bad.body["error"]["message"].startswith("tool_choice.name:")
    assert thinking == "max_tokens"

    async def unreachable(gateway: Gateway) -> Any:
        try:
            await sdk(gateway.session_url("y")).messages.create(model="m", messages=OPENING, max_tokens=4)
        except anthropic.APIStatusError as exc:
            return exc

    exc = with_gateway(f"http://127.0.0.1:{free_port()}", tok, unreachable)
    assert exc.status_code == 502 and exc.body["type"] == "error" and exc.body["error"]["type"] == "api_error"


def test_anthropic_agent_plugin_yields_one_exact_sample(engine: str, tok: Any, tiny_model_dir: Path) -> None:
    """rollout_plugins/anthropic_agent.py through ctx: MAX_TURNS model turns (a random model never
    boxes an answer), one sample, each run of model ids what the engine generates from its context."""
    from rollout_plugins.anthropic_agent import MAX_TURNS, rollout, split_system
    from rollout_plugins.openai_agent import TOOLS

    params = {"temperature": 0.0, "max_new_tokens": 6}
    (s,) = run_plugin(
        rollout, tiny_model_dir, engine, tok, Sample(prompt="What is 2 + 3?", label="5", group_id=3), params
    )
    s.check()
    assert s.reward == 0.0 and s.metadata["capture"]["turns"] == MAX_TURNS
    assert s.loss_mask.count(1) == MAX_TURNS * params["max_new_tokens"]
    chat = ModelFormat(tok).chat(TOOLS)  # what the gateway makes of the plugin's Anthropic tools
    system, messages = split_system(s.prompt)
    assert s.tokens[: s.prompt_length] == chat.prompt_ids([{"role": "system", "content": system}, *messages])
    for start in (i for i, m in enumerate(s.loss_mask) if m and (i == 0 or not s.loss_mask[i - 1])):
        at = s.prompt_length + start
        r = httpx.post(
            engine + "/generate",
            timeout=60,
            json={
                "input_ids": s.tokens[:at],
                "return_logprob": True,
                "sampling_params": {**params, "skip_special_tokens": False},
            },
        )
        assert s.tokens[at : at + params["max_new_tokens"]] == r.json()["output_ids"]
