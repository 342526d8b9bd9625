"""Routes carried on the sample (algorithm.routing_replay=r3): the engine's `routed_experts` rows
merged as tokens are appended (the earliest rows win, no gap), saved as JSON and read back, and
carried through ctx.chat's turns, an abort and its resume, and a gateway session, on a real
built-in engine serving a tiny Qwen3-MoE with `--enable-return-routed-experts`."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from helpers import TOOLS, reference_routes, serving
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimish.buffer import Buffer
from slimish.client import Client
from slimish.config import RunConfig
from slimish.launch.commands import engine_command, routing_replay_launch
from slimish.launch.config import LaunchConfig
from slimish.protocol import GenerateResponse, encode_routed_experts
from slimish.rollout.api import RolloutContext, RolloutRuntime, to_result
from slimish.trainer.config import AlgorithmConfig
from slimish.types import Sample, SampleStatus
from slimish.view import sample_record

L, K = 2, 2  # the tiny qwen3_moe's layers and top-k


def rows(n: int, first: int = 0) -> np.ndarray:
    """`n` distinct rows of routes: row i holds `first + i` everywhere (so a merge's order shows)."""
    return np.repeat(np.arange(first, first + n, dtype=np.int32), L * K).reshape(n, L, K)


# ---- the sample's record ------------------------------------------------------------------------


def test_turns_merge_into_one_row_per_token_but_the_last() -> None:
    s = Sample(prompt="p", tokens=[1, 2, 3])
    s.append_model([4, 5], [-0.1, -0.2], 0, rows(4), 0)  # rows of tokens 0..3 (5 tokens, the last not fed)
    s.append_env([6, 7])  # a tool turn: no rows yet (trailing env tokens need none)
    s.check()
    s.append_model([8], [-0.3], 1, rows(3, first=100), 4)  # turn 2 asked from the 4 rows held
    s.check()
    assert len(s.routed_experts) == len(s.tokens) - 1 == 7
    assert s.routed_experts[:, 0, 0].tolist() == [0, 1, 2, 3, 100, 101, 102]
    assert s.routed_experts.dtype == np.int32


def test_the_earliest_rows_win_over_a_reply_that_routed_them_again() -> None:
    """A reply asked from token 0 (the request did not continue the sample's rows) re-routes the
    history: the rows the tokens were generated with are kept."""
    s = Sample(prompt="p", tokens=[1, 2, 3])
    s.append_model([4], [-0.1], 0, rows(3), 0)
    s.append_env([5])
    s.append_model([6], [-0.2], 0, rows(5, first=50), 0)
    assert s.routed_experts[:, 0, 0].tolist() == [0, 1, 2, 53, 54]


def test_a_gap_a_wrong_end_a_wrong_shape_and_too_many_rows_are_refused_by_name() -> None:
    s = Sample(prompt="p", group_id=3, index=1, tokens=[1, 2, 3])
    s.append_model([4], [-0.1], 0, rows(3), 0)
    s.append_env([5, 6])
    before = copy.deepcopy(s)
    with pytest.raises(ValueError, match=r"sample 3/1: routed_experts from token 5 would leave a gap.*start_len=3"):
        s.append_model([7], [-0.2], 0, rows(1), 5)
    with pytest.raises(ValueError, match="sample 3/1: routed_experts rows 3..4 do not end at token 5"):
        s.append_model([7], [-0.2], 0, rows(2), 3)  # the reply was for other (shorter) tokens
    with pytest.raises(ValueError, match=r"sample 3/1: routed_experts rows of shape \(2, 2, 3\)"):
        s.append_model([7], [-0.2], 0, np.zeros((2, L, 3), np.int32), 4)
    assert s == before  # a refused append leaves the sample as it was
    with pytest.raises(
        ValueError, match="sample 3/1: routed_experts reach token 6, past token 4, the last one fed forward"
    ):
        s.add_routes(rows(4), 3)
    s.routed_experts = rows(len(s.tokens))
    with pytest.raises(ValueError, match=r"sample 3/1: routed_experts of shape \(6, 2, 2\).*at most 5 rows"):
        s.check()


def test_routes_round_trip_as_json_and_copies_do_not_share_them() -> None:
    s = Sample(prompt="p", tokens=[1, 2, 3], reward=1.0, status=SampleStatus.COMPLETED)
    s.append_model([4, 5], [-0.1, -0.2], 0, rows(4, first=2**20), 0)
    d = json.loads(json.dumps(s.to_dict()))  # JSON values only: run state, buffers, `slimish rollout` lines
    assert d["routed_experts"] == {"b64": encode_routed_experts(s.routed_experts), "layers": L, "top_k": K}
    back = Sample.from_dict(d)
    assert back == s and back.routed_experts.dtype == np.int32
    assert back != Sample.from_dict({**d, "routed_experts": {**d["routed_experts"], "b64": ""}})
    assert Sample.from_dict(Sample(prompt="p").to_dict()).routed_experts is None
    twin = copy.deepcopy(s)
    twin.routed_experts[0, 0, 0] = -1
    assert s.routed_experts[0, 0, 0] == 2**20
    buffer, resumed = Buffer(), Buffer()  # async mode: groups wait in the buffer, saved with the run
    buffer.add([s])
    resumed.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert resumed.get_batch(1) == [[s]]


def test_the_viewer_record_leaves_routes_out() -> None:
    s = Sample(prompt="p", tokens=[1, 2, 3])
    s.append_model([4], [-0.1], 0, rows(3), 0)
    record = sample_record(0, s, lambda ids: [str(i) for i in ids])
    assert "routed_experts" not in json.dumps(record)


def test_a_reply_without_routes_where_they_were_asked_names_the_flag() -> None:
    reply = {
        "text": "x",
        "output_ids": [7],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length"},
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "output_token_logprobs": [[-0.5, 7, None]],
        },
    }
    with pytest.raises(RuntimeError, match="request r1: .*start the engines with --enable-return-routed-experts"):
        to_result(GenerateResponse(**reply), (L, K), 0)
    assert to_result(GenerateResponse(**reply)).routed_experts is None  # not asked: none expected
    aborted = {**reply, "meta_info": {**reply["meta_info"], "finish_reason": {"type": "abort"}}}
    assert to_result(GenerateResponse(**aborted), (L, K), 0).routed_experts is None  # aborted in SGLang's queue


def test_tokens_appended_without_rows_are_routed_by_the_request_that_resumes() -> None:
    s = Sample(prompt="p", tokens=[1, 2, 3])
    s.append_model([4], [-0.1], 0, rows(3), 0)
    s.append_model([5, 6], [-0.2, -0.3], 0)  # an aborted reply without routes
    s.check()
    s.append_model([7], [-0.4], 0, rows(3, first=10), 3)  # resumed: asked from the 3 rows held
    assert s.routed_experts[:, 1, 1].tolist() == [0, 1, 2, 10, 11, 12]


def test_engines_of_an_r3_run_are_started_with_the_flag() -> None:
    r3 = AlgorithmConfig(routing_replay="r3")
    launch = routing_replay_launch(LaunchConfig(), r3)
    assert engine_command(launch, "m", "127.0.0.1", 1)[1][-1] == "--enable-return-routed-experts"
    sglang = routing_replay_launch(LaunchConfig(engine_kind="sglang"), r3)
    assert "--enable-return-routed-experts" in engine_command(sglang, "m", "127.0.0.1", 1)[1]
    assert routing_replay_launch(LaunchConfig(), AlgorithmConfig()) == LaunchConfig()
    user = LaunchConfig(engine_flag=["enable_return_routed_experts=false"])
    assert routing_replay_launch(user, r3).engine_flag == ["enable_return_routed_experts=false"]  # theirs stands


# ---- through a real engine ----------------------------------------------------------------------

GREEDY = {"temperature": 0.0}
QUESTION = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture(scope="module")
def moe_model(tiny_qwen3_moe_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).eval()


def expected_rows(model: Any, sample: Sample) -> np.ndarray:
    """What the sample's rows must be: the routers' choices in one fp32 forward of its tokens
    (the engine serves fp32 here, so no route flips), every token but the last."""
    return reference_routes(model, sample.tokens)[:-1]


def in_context(model_dir: Path, url: str, body: Any) -> Any:
    """`body(runtime)` on an r3 run's rollout runtime against `url`, closed afterwards."""

    async def main() -> Any:
        cfg = RunConfig(model=str(model_dir), algorithm=AlgorithmConfig(routing_replay="r3"))
        runtime = RolloutRuntime(cfg, Client(url), AutoTokenizer.from_pretrained(model_dir))
        try:
            return await body(runtime)
        finally:
            await runtime.close()

    return asyncio.run(main())


def test_a_two_turn_chat_with_a_tool_turn_has_a_row_for_every_token_but_the_last(
    moe_routes_engine: str, tiny_qwen3_moe_dir: Path, moe_model: Any
) -> None:
    async def body(runtime: RolloutRuntime) -> tuple[Sample, Any, Any]:
        sample = Sample(prompt=QUESTION)
        ctx = RolloutContext(runtime, sample, sampling_params={**GREEDY, "max_new_tokens": 5})
        first = await ctx.chat(list(QUESTION), tools=TOOLS)
        tool = {"role": "tool", "tool_call_id": "call_0", "content": "42"}
        second = await ctx.chat([*QUESTION, first.message, tool], tools=TOOLS)
        return sample, first.result, second.result

    sample, first, second = in_context(tiny_qwen3_moe_dir, moe_routes_engine, body)
    sample.check()
    turn1 = len(sample.tokens) - sample.response_length + len(first.output_ids)
    assert first.routes_start == 0 and second.routes_start == turn1 - 1  # turn 2 asked from the rows held
    assert len(sample.routed_experts) == len(sample.tokens) - 1
    np.testing.assert_array_equal(sample.routed_experts[: turn1 - 1], first.routed_experts)
    np.testing.assert_array_equal(sample.routed_experts[turn1 - 1 :], second.routed_experts)
    np.testing.assert_array_equal(sample.routed_experts, expected_rows(moe_model, sample))


async def running(url: str, n: int) -> None:
    """Until the engine runs `n` requests (bounded)."""
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(1500):
            state = (await client.get(url + "/server_info")).json()["internal_states"][0]
            if state["#running-req"] >= n:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"{url}: {n} running requests not seen within 30 s")


async def decoded_alongside(url: str, steps: int) -> None:
    """A streamed request's first `steps` chunks: the engine has run that many decode steps of
    every request already running (one batch). A clock for an abort mid-generation."""
    body = {"text": "tick", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}, "stream": True}
    async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", url + "/generate", json=body) as r:
        chunks = 0
        async for line in r.aiter_lines():
            chunks += line.startswith("data: {")
            if chunks == steps:
                return
    raise AssertionError(f"{url}: the clock request ended before {steps} chunks")


def test_an_aborted_sample_resumes_with_contiguous_rows(
    moe_routes_engine: str, tiny_qwen3_moe_dir: Path, moe_model: Any
) -> None:
    """Partial rollout: the aborted reply carries the rows of what it generated; the resumed request
    asks from the rows held and the sample ends with one row per token but the last."""

    async def body(runtime: RolloutRuntime) -> tuple[Sample, int]:
        sample = Sample(prompt="Count: one two three", tokens=[])
        long = {**GREEDY, "max_new_tokens": 1500, "ignore_eos": True}
        task = asyncio.create_task(RolloutContext(runtime, sample, sampling_params=long).generate_sample())
        await running(moe_routes_engine, 1)
        await decoded_alongside(moe_routes_engine, 5)  # the sample's request, in the same batch, has as many
        await runtime.client.abort(abort_all=True)
        await task
        assert sample.status == SampleStatus.ABORTED and 0 < sample.response_length < 1500
        assert len(sample.routed_experts) == len(sample.tokens) - 1
        cut = len(sample.tokens)
        sample.status = SampleStatus.PENDING
        more = {**GREEDY, "max_new_tokens": sample.response_length + 4, "ignore_eos": True}
        await RolloutContext(runtime, sample, sampling_params=more).generate_sample()
        return sample, cut

    sample, cut = in_context(tiny_qwen3_moe_dir, moe_routes_engine, body)
    sample.check()
    assert sample.status == SampleStatus.TRUNCATED and len(sample.tokens) == cut + 4
    assert len(sample.routed_experts) == len(sample.tokens) - 1
    np.testing.assert_array_equal(sample.routed_experts, expected_rows(moe_model, sample))


def test_a_gateway_session_captures_a_row_for_every_token_but_the_last(
    moe_routes_engine: str, tiny_qwen3_moe_dir: Path, moe_model: Any
) -> None:
    """Two turns of an OpenAI SDK agent, then a second branch from the first turn: each captured
    sample (one per leaf) holds its own path's rows."""

    async def body(runtime: RolloutRuntime) -> list[Sample]:
        ctx = RolloutContext(runtime, Sample(prompt=QUESTION), sampling_params={**GREEDY, "max_new_tokens": 4})
        async with openai.AsyncOpenAI(base_url=await ctx.openai_base_url(), api_key="x", max_retries=0) as client:
            first = await client.chat.completions.create(model="m", messages=QUESTION)
            reply = first.choices[0].message.model_dump(exclude_none=True)
            for follow_up in ("Again?", "Why?"):
                messages = [*QUESTION, reply, {"role": "user", "content": follow_up}]
                await client.chat.completions.create(model="m", messages=messages)
        return ctx.captured_samples()

    samples = in_context(tiny_qwen3_moe_dir, moe_routes_engine, body)
    assert len(samples) == 2
    for s in samples:
        s.check()
        assert len(s.routed_experts) == len(s.tokens) - 1
        np.testing.assert_array_equal(s.routed_experts, expected_rows(moe_model, s))


@pytest.fixture(scope="module")
def unflagged_url(moe_routes_engine: str) -> Any:
    """SGLang 0.5.23 started without `--enable-return-routed-experts`: it takes the request's
    `return_routed_experts` and returns no routes (no capturer, so nothing is collected: sglang
    0.5.23: python/sglang/srt/managers/scheduler_components/batch_result_processor.py:149-152).
    Played by the real engine behind a proxy that drops the field, as that server ignores it."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        body.pop("return_routed_experts", None)
        body.pop("routed_experts_start_len", None)
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(moe_routes_engine + "/generate", json=body)
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.get("/v1/models")  # the gateway reads the context length there (its max_tokens rule)
    async def models() -> JSONResponse:
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.get(moe_routes_engine + "/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    with serving(app, "the SGLang-without-the-flag double") as url:
        yield url


def test_a_reply_without_routes_fails_the_sample_naming_the_flag(unflagged_url: str, tiny_qwen3_moe_dir: Path) -> None:
    async def body(runtime: RolloutRuntime) -> tuple[list[Sample], str]:
        sample = Sample(prompt=QUESTION)
        ctx = RolloutContext(runtime, sample, sampling_params={**GREEDY, "max_new_tokens": 3})
        with pytest.raises(RuntimeError, match="start the engines with --enable-return-routed-experts"):
            await ctx.chat(list(QUESTION))
        assert sample.response_length == 0 and sample.routed_experts is None  # nothing recorded without its rows
        agent = RolloutContext(runtime, Sample(prompt=QUESTION), sampling_params={**GREEDY, "max_new_tokens": 3})
        async with openai.AsyncOpenAI(base_url=await agent.openai_base_url(), api_key="x", max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model="m", messages=QUESTION)
        return agent.captured_samples(), str(refused.value)

    captured, refusal = in_context(tiny_qwen3_moe_dir, unflagged_url, body)
    assert "--enable-return-routed-experts" in refusal and captured == []  # the agent is told; no turn without rows
