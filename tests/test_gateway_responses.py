"""The gateway's OpenAI Responses API (`/v1/responses`), driven by the real `openai` SDK's Responses
client against a real engine: a 3-turn tool conversation sent as Responses agents send it (the
whole input each turn, or only what is new with `previous_response_id`; plain, streamed as raw
events, streamed through the SDK's accumulator) is recorded with exactly the ids, masks and
logprobs `ctx.chat` records for the same conversation (the fitted family models of
tests/family_cases.py write it greedily).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from family_cases import CASES, Case, conversation
from helpers import with_gateway
from test_family_formats import check_turn, run_ctx_chat
from transformers import AutoTokenizer

from slimish.gateway.server import Gateway
from slimish.types import Sample

GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py): these tests only generate
RESPONSES_CASES = [c for c in CASES if c.name in ("qwen3", "qwen2.5", "deepseek-v3.1")]
GREEDY = {"temperature": 0.0, "max_new_tokens": 96}  # the gateway's defaults in these tests
MODES = [
    ("input", "create"),
    ("input", "events"),
    ("previous", "create"),
    ("previous", "manager"),
]  # (history, how it is read)


@pytest.fixture(scope="module", params=RESPONSES_CASES, ids=[c.name for c in RESPONSES_CASES])
def case(request) -> Case:
    return request.param


def sdk(gateway: Gateway, session: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.session_base_url(session), api_key="x", max_retries=0, timeout=120)


def responses_tools(case: Case) -> list[dict[str, Any]]:
    return [{"type": "function", **case.tool["function"]}]


def expected_event_types(output: list[Any]) -> list[str]:
    """The sequence OpenAI streams for a response with these output items."""
    types = ["response.created", "response.in_progress"]
    for item in output:
        if item.type == "function_call":
            body = ["response.function_call_arguments.delta", "response.function_call_arguments.done"]
        else:
            kind = "output_text" if item.type == "message" else "reasoning_text"
            body = [
                "response.content_part.added",
                f"response.{kind}.delta",
                f"response.{kind}.done",
                "response.content_part.done",
            ]
        types += ["response.output_item.added", *body, "response.output_item.done"]
    return types


async def respond(client: openai.AsyncOpenAI, how: str, **kwargs: Any) -> Any:
    """One response, read as `how`: plain, raw stream events (checked), or the SDK's stream accumulator."""
    if how == "create":
        return await client.responses.create(**kwargs)
    if how == "manager":
        async with client.responses.stream(**kwargs) as stream:
            async for _ in stream:
                pass
            return await stream.get_final_response()
    events = [event async for event in await client.responses.create(**kwargs, stream=True)]
    final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [*expected_event_types(final.output), "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == [
        o.arguments for o in final.output if o.type == "function_call"
    ]
    return final


def check_response(case: Case, k: int, response: Any) -> None:
    """Turn k of the conversation as Response output items (reasoning, message, function calls)."""
    assert response.status == "completed" and response.object == "response"
    reasoning = [c.text for o in response.output if o.type == "reasoning" for c in o.content]
    calls = [
        {"function": {"name": o.name, "arguments": o.arguments}} for o in response.output if o.type == "function_call"
    ]
    check_turn(case, k, response.output_text, "".join(reasoning) or None, calls)
    order = ["reasoning"] * bool(reasoning) + ["message"] * bool(response.output_text) + ["function_call"] * len(calls)
    assert [o.type for o in response.output] == order
    assert (
        response.usage.input_tokens > 0
        and response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    )


async def responses_agent(client: openai.AsyncOpenAI, case: Case, history: str, how: str) -> None:
    """The conversation as a Responses agent has it: `instructions`, the tool's output as a
    `function_call_output`, the follow-up as a user item; the SDK's own output items sent back."""
    conv = conversation(case)
    items: list[Any] = []
    new: list[Any] = [{"role": "user", "content": conv[1]["content"]}]
    previous: str | None = None
    for k in range(3):
        kwargs: dict[str, Any] = {
            "model": "m",
            "instructions": conv[0]["content"],
            "tools": responses_tools(case),
            "extra_body": {"chat_template_kwargs": case.kwargs},
        }
        if history == "previous":
            kwargs |= {"input": new, **({"previous_response_id": previous} if previous else {})}
        else:
            items += new
            kwargs["input"] = items
        response = await respond(client, how, **kwargs)
        check_response(case, k, response)
        previous, items = response.id, [*items, *response.output]
        calls = [o for o in response.output if o.type == "function_call"]
        new = (
            [{"type": "function_call_output", "call_id": c.call_id, "output": "5"} for c in calls]
            if k == 0
            else conv[5:6]
        )


def test_responses_record_what_ctx_chat_records(served: tuple[str, Path], case: Case) -> None:
    url, model = served
    sample = run_ctx_chat(model, url, case)

    async def agents(gateway: Gateway) -> dict[tuple[str, str], list[Sample]]:
        out = {}
        for history, how in MODES:
            session = f"{history}-{how}"
            await responses_agent(sdk(gateway, session), case, history, how)
            out[history, how] = gateway.pop_samples(session, Sample(prompt=conversation(case)[:2]))
        return out

    for mode, samples in with_gateway(
        url, AutoTokenizer.from_pretrained(model), agents, default_sampling=GREEDY
    ).items():
        assert len(samples) == 1, mode  # reasoning items sent back (qwen3) continue the same sample
        (captured,) = samples
        assert captured.tokens == sample.tokens and captured.loss_mask == sample.loss_mask, mode
        assert captured.rollout_logprobs == pytest.approx(sample.rollout_logprobs, abs=1e-5), mode


def test_a_response_cut_by_max_output_tokens_is_incomplete(served: tuple[str, Path], case: Case) -> None:
    url, model = served

    async def agent(gateway: Gateway) -> tuple[Any, list[Any]]:
        client = sdk(gateway, "cut")
        plain = await client.responses.create(model="m", input="What is 2+3?", max_output_tokens=2)
        events = [
            e
            async for e in await client.responses.create(
                model="m", input="What is 2+3?", max_output_tokens=2, stream=True
            )
        ]
        return plain, events

    plain, events = with_gateway(url, AutoTokenizer.from_pretrained(model), agent, default_sampling=GREEDY)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.output_tokens == 2 and plain.output[-1].status == "incomplete"
    assert (
        events[-1].type == "response.incomplete"
        and events[-1].response.incomplete_details.reason == "max_output_tokens"
    )


def test_stored_responses_are_per_session_and_store_false_keeps_none(served: tuple[str, Path], case: Case) -> None:
    url, model = served

    async def agent(gateway: Gateway) -> list[tuple[str, str]]:
        first = await sdk(gateway, "a").responses.create(model="m", input="Hi.", max_output_tokens=2)
        unstored = await sdk(gateway, "a").responses.create(model="m", input="Hi.", max_output_tokens=2, store=False)
        refused = []
        for session, rid in (("b", first.id), ("a", unstored.id)):
            with pytest.raises(openai.BadRequestError) as err:
                await sdk(gateway, session).responses.create(model="m", input="Go on.", previous_response_id=rid)
            refused.append((err.value.status_code, err.value.body["param"]))
        chained = await sdk(gateway, "a").responses.create(
            model="m", input="Go on.", previous_response_id=first.id, max_output_tokens=2
        )
        assert chained.previous_response_id == first.id
        gateway.pop_samples("a", Sample(prompt="Hi."))
        with pytest.raises(openai.BadRequestError):  # a collected session's responses are gone with it
            await sdk(gateway, "a").responses.create(model="m", input="Go on.", previous_response_id=first.id)
        return refused

    assert (
        with_gateway(url, AutoTokenizer.from_pretrained(model), agent, default_sampling=GREEDY)
        == [(400, "previous_response_id")] * 2
    )


# ---- without an engine: what is refused before any generation -----------------------------------

TOOL = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools.0.name"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
        ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "truncation": "sometimes"}, "truncation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
    ],
)
def test_what_the_gateway_cannot_honour_is_a_400_naming_the_field(tok: Any, body: dict[str, Any], field: str) -> None:
    async def post(gateway: Gateway) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(gateway.session_base_url("bad") + "/responses", json={"model": "m", **body})

    r = with_gateway(
        "http://127.0.0.1:9", tok, post, default_sampling=GREEDY
    )  # nothing listens there: no request may reach an engine
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field + ":"), error


def test_a_request_without_a_session_is_a_401(tok: Any) -> None:
    async def post(gateway: Gateway) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(gateway.url + "/v1/responses", json={"model": "m", "input": "hi"})

    r = with_gateway("http://127.0.0.1:9", tok, post, default_sampling=GREEDY)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"


def test_input_items_fold_into_chat_messages() -> None:
    """A turn's output items sent back (reasoning, text, calls) are one assistant message; the
    tool output a `tool` message; a developer message the system prompt."""
    from slimish.gateway.protocols.openai_responses import chat_messages

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Go."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Think."}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Calling.", "annotations": []}],
        },
        call,
        {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Done."}]},
        {"type": "message", "role": "assistant", "content": "Both ran."},
        {"type": "reasoning", "id": "rs_3", "summary": [], "encrypted_content": "opaque"},
    ]

    def tool_call(i: int) -> dict[str, Any]:
        return {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}

    assert chat_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Go."},
        {
            "role": "assistant",
            "content": "Calling.",
            "reasoning_content": "Think.",
            "tool_calls": [tool_call(1), tool_call(2)],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "assistant", "content": "Both ran.", "reasoning_content": "Done."},
    ]


def test_responses_agent_plugin_chains_turns_into_one_sample(engine: str, tok: Any, tiny_model_dir: Path) -> None:
    """rollout_plugins/responses_agent.py through ctx: `previous_response_id` turns continue one
    exact-token sample (a random model never boxes, so every turn runs)."""
    from rollout_plugins.responses_agent import MAX_TURNS, rollout
    from slimish.client import Client
    from slimish.config import RunConfig
    from slimish.rollout.api import RolloutContext, RolloutRuntime

    async def main() -> list[Sample]:
        runtime = RolloutRuntime(RunConfig(model=str(tiny_model_dir)), Client(engine), tok)
        try:
            sample = Sample(prompt="What is 2 + 3?", label="5", group_id=3)
            return await rollout(
                RolloutContext(runtime, sample, sampling_params={"temperature": 0.0, "max_new_tokens": 6}), sample
            )
        finally:
            await runtime.close()

    (s,) = asyncio.run(main())
    s.check()
    assert s.reward == 0.0 and s.metadata["capture"]["turns"] == MAX_TURNS
    assert s.metadata["capture"]["how"] == ["start"] + ["continue"] * (MAX_TURNS - 1)
