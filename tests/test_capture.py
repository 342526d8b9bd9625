"""Gateway: an `openai` SDK agent against a real engine behind the real router yields samples
whose tokens, masks and logprobs are exactly the engine's, checked against direct `/generate` calls.

The gateway runs on the test's event loop (as in a rollout process); the router runs in a
thread; the engine is the module's real child process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from helpers import TOOLS, run_plugin, running_router, with_gateway

from slimish.formats.model import ModelFormat
from slimish.gateway.server import Gateway
from slimish.types import Sample, SampleStatus

GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py): these tests only generate
OPENING = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is (2+3)*4?"}]
TEMPLATE = Sample(prompt=OPENING, label="20", group_id=7, index=2, metadata={"task": "calc"})


@pytest.fixture(scope="module")
def router(engine) -> Iterator[str]:
    with running_router(worker_urls=[engine], health_check_interval=0.5) as url:
        yield url


def sdk(gateway: Gateway, session: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.session_base_url(session), api_key="slimish", max_retries=0, timeout=60)


def direct(engine: str, ids: list[int], params: dict) -> tuple[list[int], list[float]]:
    """The engine itself, on the same input ids: the reference for every captured turn."""
    r = httpx.post(
        engine + "/generate", json={"input_ids": ids, "sampling_params": params, "return_logprob": True}, timeout=60
    )
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def test_three_turn_tool_session_is_one_exact_sample(engine, router, tok):
    eot = ModelFormat(tok).chat().close_id
    # Turn 1 and 3 run out of tokens (the turn is closed by env ids); turn 2 ends on the
    # end-of-turn token after 3 tokens (forced by a bias, held back by min_tokens).
    turns = [
        ({"max_tokens": 5}, [{"role": "tool", "tool_call_id": "call_1", "content": "5"}]),
        (
            {"max_tokens": 9, "extra_body": {"min_tokens": 3}, "logit_bias": {str(eot): 100}},
            [{"role": "user", "content": "And times 4?"}],
        ),
        ({"max_tokens": 4}, []),
    ]

    async def agent(gateway: Gateway) -> tuple[list[Any], list[Sample]]:
        client, messages, replies = sdk(gateway, "s1"), list(OPENING), []
        for kwargs, env in turns:
            reply = await client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, temperature=0, **kwargs
            )
            replies.append(reply)
            messages += [reply.choices[0].message, *env]  # the SDK's own message object, as agents do
        return replies, gateway.pop_samples("s1", TEMPLATE)

    replies, samples = with_gateway(router, tok, agent)
    assert len(samples) == 1
    s = samples[0]

    # The reference, built from the engine's own outputs and ChatTokens' env ids.
    chat = ModelFormat(tok).chat(TOOLS)
    params = [
        {"temperature": 0.0, "max_new_tokens": 5, "skip_special_tokens": False},
        {
            "temperature": 0.0,
            "max_new_tokens": 9,
            "min_new_tokens": 3,
            "logit_bias": {str(eot): 100.0},
            "skip_special_tokens": False,
        },
        {"temperature": 0.0, "max_new_tokens": 4, "skip_special_tokens": False},
    ]
    prompt = chat.prompt_ids(OPENING)
    context, mask, logprobs, env = list(prompt), [], [], []
    for i, (p, reply) in enumerate(zip(params, replies)):
        context += env
        mask += [0] * len(env)
        logprobs += [0.0] * len(env)
        assert reply.usage.prompt_tokens == len(context)
        out, lps = direct(engine, context, p)
        assert reply.usage.completion_tokens == len(out)
        context += out
        mask += [1] * len(out)
        logprobs += lps
        env = chat.env_ids(turns[i][1], last_token=out[-1])
    assert [r.choices[0].finish_reason for r in replies] == ["length", "stop", "length"]

    assert s.tokens == context and s.prompt_length == len(prompt)
    assert s.loss_mask == mask and s.rollout_logprobs == logprobs
    assert s.status == SampleStatus.TRUNCATED and s.weight_versions == [0]
    assert (s.prompt, s.label, s.group_id, s.index, s.metadata["task"]) == (OPENING, "20", 7, 2, "calc")
    assert s.metadata["capture"] == {
        "session": "s1",
        "segments": 1,
        "realignments": 0,
        "segment": 0,
        "branch": 0,
        "turns": 3,
        "how": ["start", "continue", "continue"],
    }


THREE = {"temperature": 0, "max_tokens": 3, "extra_body": {"ignore_eos": True}}


def test_an_edited_reply_realigns_and_a_rewritten_history_forks(engine, router, tok):
    """A reply sent back with a few ids changed (here: text appended) realigns: the model's ids
    stay trained, the edit is the environment's (mask 0). A history replaced by a summary (what
    context compaction does) starts a new segment, rendered by the template."""

    async def agent(gateway: Gateway) -> list[Sample]:
        client, messages = sdk(gateway, "s2"), list(OPENING)
        first = await client.chat.completions.create(
            model="m", messages=messages, **{**THREE, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content + " (ok)"},
            {"role": "user", "content": "go on"},
        ]
        await client.chat.completions.create(model="m", messages=messages, **THREE)
        compacted = [OPENING[0], {"role": "user", "content": "Summary: we talked. Go on."}]
        await client.chat.completions.create(model="m", messages=compacted, **THREE)
        assert gateway.pop_samples("never-used", TEMPLATE) == []
        return (
            gateway.pop_samples("s2", TEMPLATE),
            messages,
            compacted,
            first.choices[0].model_dump()["response_token_ids"],
        )

    samples, messages, compacted, first_ids = with_gateway(router, tok, agent)
    chat = ModelFormat(tok).chat()
    assert [s.metadata["capture"]["how"] for s in samples] == [["start", "realign"], ["fork"]]
    assert [s.metadata["capture"]["segment"] for s in samples] == [0, 1] and samples[0].metadata["capture"][
        "realignments"
    ] == 1
    realigned, forked = samples
    assert (
        realigned.tokens == chat.prompt_ids(messages) + realigned.response_ids[-3:]
    )  # the context is the template's, edit included
    keep = realigned.loss_mask.index(
        0
    )  # the model's ids up to where the edited reply's tokens differ (BPE may merge across)
    assert 1 <= keep <= 3 and realigned.loss_mask == [1] * keep + [0] * (realigned.response_length - 3 - keep) + [1] * 3
    assert realigned.response_ids[:keep] == first_ids[:keep]
    assert (
        realigned.response_ids[-3:]
        == direct(engine, realigned.tokens[:-3], {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True})[0]
    )
    assert forked.tokens[: forked.prompt_length] == chat.prompt_ids(compacted) and forked.loss_mask == [1] * 3


def test_default_sampling_and_explicit_overrides(engine, router, tok):
    async def agent(gateway: Gateway) -> list[Sample]:
        client = sdk(gateway, "s3")
        await client.chat.completions.create(model="m", messages=OPENING)  # defaults only
        await client.chat.completions.create(model="m", messages=OPENING, max_tokens=2)  # a new segment: same history
        return gateway.pop_samples("s3", TEMPLATE)

    samples = with_gateway(
        router, tok, agent, default_sampling={"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    )
    ids = ModelFormat(tok).chat().prompt_ids(OPENING)
    assert [s.response_ids for s in samples] == [
        direct(engine, ids, {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True})[0] for n in (6, 2)
    ]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_k": 0}, "top_k"),
    ],
)
def test_bad_body_is_a_400_naming_the_field(router, tok, body, field):
    async def post(gateway: Gateway) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(gateway.session_base_url("bad") + "/chat/completions", json=body)

    r = with_gateway(router, tok, post)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field + ":"), error


def test_malformed_json_and_models_route(engine, router, tok):
    async def calls(gateway: Gateway) -> tuple[httpx.Response, Any]:
        async with httpx.AsyncClient(timeout=60) as http:
            bad = await http.post(gateway.session_base_url("x") + "/chat/completions", content=b"{not json")
        return bad, await sdk(gateway, "x").models.list()

    bad, models = with_gateway(router, tok, calls)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
    assert [m.id for m in models.data] == [m["id"] for m in httpx.get(engine + "/v1/models", timeout=60).json()["data"]]


def test_openai_agent_plugin_yields_exact_samples(engine, router, tok, tiny_model_dir):
    """rollout_plugins/openai_agent.py through ctx (H1's api): each run of model tokens is what the
    engine generates greedily from the context before it; everything else is mask 0."""
    from rollout_plugins.openai_agent import MAX_TURNS, calculator, rollout

    params = {"temperature": 0.0, "max_new_tokens": 6}
    (s,) = run_plugin(
        rollout, tiny_model_dir, router, tok, Sample(prompt="What is 2 + 3?", label="5", group_id=3), params
    )
    s.check()
    assert s.reward in (0.0, 1.0) and s.metadata["capture"]["turns"] == MAX_TURNS  # a random model never boxes
    runs, start = [], None
    for i, m in enumerate([*s.loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    assert len(runs) == MAX_TURNS
    offset = s.prompt_length
    for a, b in runs:
        out, lps = direct(engine, s.tokens[: offset + a], {**params, "skip_special_tokens": False})
        assert s.tokens[offset + a : offset + b] == out and s.rollout_logprobs[a:b] == lps
    assert (
        calculator("(2+3)*4") == "20"
        and calculator("7/2") == "3.5"
        and calculator("__import__('os')").startswith("error")
    )


def test_parallel_requests_on_one_turn_branch_and_share_it_once(engine, router, tok):
    """Two requests continuing the same turn at once are two branches of it: each sample holds the
    shared turn, trained (mask 1) in the first only."""

    async def agent(gateway: Gateway) -> list[Sample]:
        client = sdk(gateway, "s4")
        first = await client.chat.completions.create(model="m", messages=OPENING, **THREE)
        history = [*OPENING, first.choices[0].message]
        await asyncio.gather(
            *(
                client.chat.completions.create(model="m", messages=[*history, {"role": "user", "content": q}], **THREE)
                for q in ("left", "right")
            )
        )
        return gateway.pop_samples("s4", TEMPLATE)

    samples = with_gateway(router, tok, agent)
    assert [s.metadata["capture"]["turns"] for s in samples] == [2, 2] and [
        s.metadata["capture"]["branch"] for s in samples
    ] == [0, 1]
    assert samples[0].tokens[: samples[0].prompt_length + 3] == samples[1].tokens[: samples[1].prompt_length + 3]
    assert samples[0].loss_mask[:3] == [1, 1, 1] and samples[1].loss_mask[:3] == [0, 0, 0]
    greedy = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
    for s in samples:
        assert s.response_ids[-3:] == direct(engine, s.tokens[:-3], greedy)[0] and s.loss_mask[-3:] == [1, 1, 1]
