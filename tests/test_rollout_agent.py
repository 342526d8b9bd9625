"""Multi-turn rollouts with exact tokens, through the manager, a real engine and the real router.

A random tiny model never writes a valid tool call, so this module's model is the tiny llama
trained for a few seconds to memorise one tool-using conversation (ask -> calculator call ->
tool result -> boxed answer). Greedy decoding then makes the real engine emit the call, the
real `tool_agent` plugin runs the calculator, and the sample must be exactly: the engine's
output ids, the template's ids of the tool turn, the engine's output ids again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_plugins import tool_agent
from slimish.buffer import Buffer
from slimish.client import Client
from slimish.config import RunConfig, load_run_config
from slimish.formats.model import ModelFormat
from slimish.launch.config import LaunchConfig
from slimish.launch.local import Servers, local_servers
from slimish.rollout.api import RolloutContext, RolloutRuntime
from slimish.rollout.data import PromptData
from slimish.rollout.functions import RolloutFunctions
from slimish.rollout.manager import RolloutManager
from slimish.rollout.stats import RolloutStalled
from slimish.tiny_model import make_tiny_model
from slimish.types import Sample, SampleStatus

QUESTION = [{"role": "user", "content": "What is 17 * 3?"}]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": "17 * 3"})}}
    ],
}
TOOL = {"role": "tool", "name": "calculator", "content": "51"}
ANSWER = {"role": "assistant", "content": "\\boxed{51}"}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama, fitted to one conversation until greedy decoding reproduces it."""
    path = make_tiny_model(tmp_path_factory.mktemp("models") / "tool-llama", arch="llama", size="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    chat = ModelFormat(tok).chat(tool_agent.TOOLS)
    prompt = chat.prompt_ids(QUESTION)
    ids = torch.tensor([chat.render([*QUESTION, CALL, TOOL, ANSWER], add_generation_prompt=False)])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(400):
        loss = model(input_ids=ids, labels=labels).loss
        if loss.item() < 0.005:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def servers(tool_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with local_servers(LaunchConfig(engines=1), tool_model, tmp_path_factory.mktemp("logs")) as s:
        yield s


def make_cfg(model: Path, tmp: Path, *overrides: str) -> RunConfig:
    data = tmp / "q.jsonl"
    data.write_text(json.dumps({"prompt": QUESTION[0]["content"], "label": "51"}) + "\n")
    base = [
        f"model={model}",
        f"data.source={data}",
        "rollout.filter_fn=null",
        "rollout.temperature=0.0",
        "rollout.max_new_tokens=48",
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=1",
    ]
    return load_run_config(None, [*base, *overrides])


def one_step(cfg: RunConfig, router: str, rollout_fn: Any) -> tuple[dict[str, Any], list[Sample]]:
    async def main() -> tuple[dict[str, Any], list[Sample]]:
        runtime = await RolloutRuntime.create(cfg, router)
        try:
            manager = RolloutManager(runtime, PromptData(cfg.data), Buffer(), RolloutFunctions(rollout_fn))
            stats = await manager.run_step(0)
            return stats, [s for g in manager.buffer.get_batch(1) for s in g]
        finally:
            await runtime.close()

    return asyncio.run(main())


def engine_turn(url: str, ids: list[int], max_new_tokens: int, **params: Any) -> tuple[list[int], list[float]]:
    """The engine itself on the same ids, greedy: the reference for every model turn."""

    async def main() -> tuple[list[int], list[float]]:
        async with Client(url) as client:
            out = await client.generate(
                input_ids=ids,
                return_logprob=True,
                sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0, **params},
            )
        return out.output_ids, [e[0] for e in out.meta_info.output_token_logprobs]

    return asyncio.run(main())


def test_tool_agent_sample_is_engine_ids_interleaved_with_tool_ids(
    servers: Servers, tool_model: Path, tmp_path: Path
) -> None:
    stats, samples = one_step(make_cfg(tool_model, tmp_path), servers.router_url, tool_agent.rollout)
    tok = AutoTokenizer.from_pretrained(tool_model)
    chat = ModelFormat(tok).chat(tool_agent.TOOLS)
    prompt = chat.prompt_ids(QUESTION)
    call_ids, call_lps = engine_turn(servers.engine_urls[0], prompt, 48, skip_special_tokens=False)
    assert "<tool_call>" in tok.decode(call_ids, skip_special_tokens=False), "the fitted model should call the tool"
    tool_ids = chat.env_ids([TOOL], last_token=call_ids[-1])
    answer_ids, answer_lps = engine_turn(
        servers.engine_urls[0], prompt + call_ids + tool_ids, 48, skip_special_tokens=False
    )

    assert stats["groups_kept"] == 1 and stats["completed"] == 2
    for s in samples:
        s.check()
        assert s.tokens == prompt + call_ids + tool_ids + answer_ids
        assert s.loss_mask == [1] * len(call_ids) + [0] * len(tool_ids) + [1] * len(answer_ids)
        assert s.rollout_logprobs == pytest.approx(call_lps + [0.0] * len(tool_ids) + answer_lps, abs=1e-4)
        assert s.status == SampleStatus.COMPLETED and s.reward == 1.0 and s.weight_versions == [0]
        assert not s.reshaped  # plain sampling: the engine's log-probs are pi_old
    assert "51" in tok.decode(tool_ids)


async def chat_then_follow_up(ctx: RolloutContext, sample: Sample) -> Sample:
    """Two turns without tools: the first runs out of tokens (its turn is closed by env ids),
    then a user follow-up. `min_new_tokens`: the fitted model may end its turn sooner (with one
    dependency set it answered `5<|im_end|>`)."""
    messages = list(sample.prompt)
    first = await ctx.chat(messages, sampling_params={"max_new_tokens": 5, "min_new_tokens": 5})
    assert first.finish_reason == "length" and sample.status == SampleStatus.TRUNCATED
    messages += [first.message, {"role": "user", "content": "Say it again."}]
    await ctx.chat(messages, sampling_params={"max_new_tokens": 6})
    sample.reward = 0.0
    sample.metadata["first_turn"] = first.result.output_ids
    return sample


def test_chat_closes_a_cut_off_turn_and_records_a_user_turn_with_mask_0(
    servers: Servers, tool_model: Path, tmp_path: Path
) -> None:
    _, samples = one_step(make_cfg(tool_model, tmp_path), servers.router_url, chat_then_follow_up)
    tok = AutoTokenizer.from_pretrained(tool_model)
    chat = ModelFormat(tok).chat()
    prompt = chat.prompt_ids(QUESTION)
    first, first_lps = engine_turn(servers.engine_urls[0], prompt, 5, min_new_tokens=5)
    env = chat.env_ids([{"role": "user", "content": "Say it again."}], last_token=first[-1])
    assert env[0] == chat.close_id  # the cut-off turn is closed as the template closes it
    second, second_lps = engine_turn(servers.engine_urls[0], prompt + first + env, 6)
    for s in samples:
        assert s.metadata["first_turn"] == first
        assert s.tokens == prompt + first + env + second
        assert s.loss_mask == [1] * 5 + [0] * len(env) + [1] * len(second)
        assert s.rollout_logprobs == pytest.approx(first_lps + [0.0] * len(env) + second_lps, abs=1e-4)
        assert s.reshaped  # the first turn masked the end token (min_new_tokens): pi_old is the trainer's


async def edits_history(ctx: RolloutContext, sample: Sample) -> Sample:
    turn = await ctx.chat(list(sample.prompt), sampling_params={"max_new_tokens": 2})
    await ctx.chat([{"role": "user", "content": "something else"}, turn.message, {"role": "user", "content": "?"}])
    return sample


def test_chat_refuses_a_conversation_that_does_not_extend_the_last_one(
    servers: Servers, tool_model: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(tool_model, tmp_path, "rollout.max_prompts_factor=1")

    async def main() -> Any:
        runtime = await RolloutRuntime.create(cfg, servers.router_url)
        try:
            manager = RolloutManager(runtime, PromptData(cfg.data), Buffer(), RolloutFunctions(edits_history))
            with pytest.raises(
                RolloutStalled, match="rollout fn: ValueError: ctx.chat: `messages` must be the previous conversation"
            ):
                await manager.run_step(0)
        finally:
            await runtime.close()

    asyncio.run(main())


async def openai_sdk_agent(ctx: RolloutContext, sample: Sample) -> list[Sample]:
    async with openai.AsyncOpenAI(base_url=await ctx.openai_base_url(), api_key="x", max_retries=0) as client:
        await client.chat.completions.create(
            model="m", messages=sample.prompt, tools=tool_agent.TOOLS, temperature=0, max_tokens=48
        )
    samples = ctx.captured_samples()
    for s in samples:
        s.reward = 0.0
    return samples


def test_an_openai_sdk_agent_through_the_context_yields_the_same_tokens(
    servers: Servers, tool_model: Path, tmp_path: Path
) -> None:
    _, samples = one_step(make_cfg(tool_model, tmp_path), servers.router_url, openai_sdk_agent)
    tok = AutoTokenizer.from_pretrained(tool_model)
    prompt = ModelFormat(tok).chat(tool_agent.TOOLS).prompt_ids(QUESTION)
    call_ids, call_lps = engine_turn(servers.engine_urls[0], prompt, 48, skip_special_tokens=False)
    assert [(s.group_id, s.index) for s in samples] == [(0, 0), (0, 1)]
    for s in samples:
        assert s.tokens == prompt + call_ids and s.loss_mask == [1] * len(call_ids)
        assert s.rollout_logprobs == pytest.approx(call_lps, abs=1e-4)
