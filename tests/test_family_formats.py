"""Real model families: a 3-turn tool conversation recorded token-exactly, tool calls parsed and
reasoning split, through `ctx.chat`, the agent gateway (real `openai` SDK) and the engine's own
`/v1/chat/completions`, on each family's real chat template and vocabulary (the cases and fitted
models: tests/family_cases.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from family_cases import CASE_IDS, CASES, TURNS, Case, conversation, expected
from transformers import AutoTokenizer

from slimish.client import Client
from slimish.config import load_run_config
from slimish.formats.model import ModelFormat
from slimish.gateway.server import Gateway
from slimish.rollout.api import RolloutContext, RolloutRuntime
from slimish.types import Sample, SampleStatus


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def case(request) -> Case:
    return request.param


def runtime_for(model: Path, url: str, *overrides: str) -> RolloutRuntime:
    cfg = load_run_config(
        None,
        [
            f"model={model}",
            "data.source=unused.jsonl",
            "rollout.temperature=0.0",
            "rollout.max_new_tokens=96",
            *overrides,
        ],
    )
    return RolloutRuntime(cfg, Client(url), AutoTokenizer.from_pretrained(model))


def check_turn(case: Case, k: int, content: str, reasoning: str | None, calls: list[dict[str, Any]]) -> None:
    """A reply parsed into OpenAI fields: the tool call, the reasoning, the content."""
    want = conversation(case)[TURNS[k]]
    assert reasoning == want.get("reasoning_content")
    assert content == want["content"]
    if k == 0:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (case.tool["function"]["name"], case.call_args)
        ]
    else:
        assert calls == []


async def chat_agent(ctx: RolloutContext, sample: Sample, case: Case) -> Sample:
    conv = conversation(case)
    messages = conv[:2]
    for k, next_messages in enumerate((conv[3:4], conv[5:6], [])):
        turn = await ctx.chat(messages, tools=case.tools, chat_template_kwargs=case.kwargs)
        check_turn(case, k, turn.content, turn.reasoning_content, turn.tool_calls)
        messages = [*messages, turn.message, *next_messages]
    return sample


def run_ctx_chat(model: Path, url: str, case: Case) -> Sample:
    async def main() -> Sample:
        runtime = runtime_for(model, url)
        try:
            sample = Sample(prompt=conversation(case)[:2], group_id=1)
            return await chat_agent(RolloutContext(runtime, sample), sample, case)
        finally:
            await runtime.close()

    return asyncio.run(main())


def run_capture(model: Path, url: str, case: Case, history: str = "exact") -> list[Sample]:
    """The same conversation from an `openai` SDK agent through the agent gateway."""

    async def main() -> list[Sample]:
        fmt = ModelFormat(AutoTokenizer.from_pretrained(model))
        gateway = Gateway(url, fmt, default_sampling={"temperature": 0.0, "max_new_tokens": 96}, history=history)
        await gateway.start()
        try:
            client = openai.AsyncOpenAI(base_url=gateway.session_base_url("s"), api_key="x", max_retries=0, timeout=120)
            conv = conversation(case)
            messages: list[Any] = conv[:2]
            for k, next_messages in enumerate((conv[3:4], conv[5:6], [])):
                reply = await client.chat.completions.create(
                    model="m", messages=messages, tools=case.tools, extra_body={"chat_template_kwargs": case.kwargs}
                )
                message = reply.choices[0].message
                calls = [c.model_dump() for c in message.tool_calls or []]
                check_turn(case, k, message.content, (message.model_extra or {}).get("reasoning_content"), calls)
                assert reply.choices[0].finish_reason == ("tool_calls" if k == 0 else "stop")
                # The SDK's own message object, as agents do; then a plain dict with reasoning_content,
                # the standard way to pass reasoning back: both continue the same sample.
                echoed = message if k == 0 else message.model_dump(exclude_none=True)
                assert k == 0 or ("reasoning_content" in echoed) == (case.reasoning[k] is not None)
                messages = [*messages, echoed, *next_messages]
            return gateway.pop_samples("s", Sample(prompt=conv[:2]))
        finally:
            await gateway.stop()

    return asyncio.run(main())


def hf_render(tok: Any, case: Case, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    """HF's own rendering, arguments in the form the template wants: the independent reference."""
    if case.args == "object":
        messages = [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ],
            }
            if "tool_calls" in m
            else m
            for m in messages
        ]
    return tok.apply_chat_template(
        messages,
        tools=case.tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        **case.kwargs,
    )


def test_ctx_chat_and_capture_record_the_same_exact_ids(served: tuple[str, Path], case: Case) -> None:
    url, model = served
    tok = AutoTokenizer.from_pretrained(model)
    e = expected(ModelFormat(tok), case)
    sample = run_ctx_chat(model, url, case)
    sample.check()
    assert sample.tokens == e.exact and sample.status == SampleStatus.COMPLETED
    mask = []
    for turn, env in zip(e.turns, [*e.envs, []]):
        mask += [1] * len(turn) + [0] * len(env)
    assert sample.loss_mask == mask and sample.prompt_length == len(e.prompts[0])
    # HF's rendering: the first prompt always; every later prompt where the template keeps earlier turns.
    conv = conversation(case)
    assert e.prompts[0] == hf_render(tok, case, conv[:2], True)
    for k, at in enumerate(TURNS):
        if e.prompts[k] == e.chained_context(k):
            assert sample.tokens[: len(e.prompts[k])] == hf_render(tok, case, conv[:at], True)
    assert all(e.prompts[k] == e.chained_context(k) for k in range(3)) == case.keeps_history

    (captured,) = run_capture(model, url, case)
    assert captured.tokens == sample.tokens and captured.loss_mask == sample.loss_mask
    assert captured.rollout_logprobs == pytest.approx(sample.rollout_logprobs, abs=1e-5)


def test_template_history_policy_starts_a_segment_where_the_template_rerenders(
    served: tuple[str, Path], case: Case
) -> None:
    """`rollout.history=template`: each turn's prompt is the template's rendering; a turn whose
    rendering does not extend the ids before it starts a new segment."""
    url, model = served
    e = expected(ModelFormat(AutoTokenizer.from_pretrained(model)), case)
    want: list[list[int]] = []
    for k in range(3):
        if want and e.prompts[k][: len(want[-1])] == want[-1]:
            want[-1] = e.prompts[k] + e.turns[k]
        else:
            want.append(e.prompts[k] + e.turns[k])
    samples = run_capture(model, url, case, history="template")
    assert [s.tokens for s in samples] == want
    assert (len(samples) == 1) == case.keeps_history


def test_engine_chat_completions_parse_tool_calls_and_reasoning(served: tuple[str, Path], case: Case) -> None:
    url, model = served
    info = httpx.get(url + "/model_info", timeout=30).json()
    assert (info["tool_call_parser"], info["reasoning_parser"]) == (case.tool_parser, case.reasoning_parser)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    conv = conversation(case)
    for k, at in enumerate(TURNS):
        body = dict(
            model="m",
            messages=conv[:at],
            tools=case.tools,
            temperature=0,
            max_tokens=96,
            extra_body={"chat_template_kwargs": case.kwargs},
        )
        reply = client.chat.completions.create(**body)
        message = reply.choices[0].message
        check_turn(
            case,
            k,
            message.content,
            (message.model_extra or {}).get("reasoning_content"),
            [c.model_dump() for c in message.tool_calls or []],
        )
        assert reply.choices[0].finish_reason == ("tool_calls" if k == 0 else "stop")
        # Streamed: the deltas add up to the same message.
        content, reasoning, calls, reasons = "", "", [], []
        for chunk in client.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                delta = choice.delta
                content += delta.content or ""
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                calls += [c.model_dump() for c in delta.tool_calls or []]
                reasons += [choice.finish_reason] if choice.finish_reason else []
        check_turn(case, k, content, reasoning or None, calls)
        assert reasons == [reply.choices[0].finish_reason]
        assert [c["index"] for c in calls] == list(range(len(calls)))


# ---- single cases ------------------------------------------------------------------------------


def test_glm_single_turn_prompt_and_template_kwargs(
    family_dirs: dict[str, Path], family_engine: Callable[[str], str]
) -> None:
    """GLM's turn has no closing token: a single-turn prompt renders as HF renders it (template
    kwargs included) and generates; `enable_thinking: false` reaches the template."""
    model = family_dirs["glm4.6"]
    tok = AutoTokenizer.from_pretrained(model)
    question = [{"role": "user", "content": "What is 2+3?"}]
    url = family_engine("glm4.6")

    async def main() -> tuple[Sample, list[int]]:
        runtime = runtime_for(
            model, url, "rollout.max_new_tokens=4", "rollout.chat_template_kwargs={enable_thinking: false}"
        )
        try:
            sample = Sample(prompt=question)
            ctx = RolloutContext(runtime, sample)
            await ctx.generate_sample()
            return sample, ctx.prompt_ids(question, {"enable_thinking": True})
        finally:
            await runtime.close()

    sample, thinking = asyncio.run(main())
    no_thinking = tok.apply_chat_template(
        question, add_generation_prompt=True, tokenize=True, return_dict=False, enable_thinking=False
    )
    assert sample.tokens[: sample.prompt_length] == no_thinking and tok.decode(no_thinking).endswith(
        "<|assistant|>\n<think></think>"
    )
    assert thinking == tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert sample.response_length >= 1 and sample.loss_mask == [1] * sample.response_length


def test_glm_sft_targets_end_on_the_next_turns_opener(family_dirs: dict[str, Path], tmp_path: Path) -> None:
    """SFT on a template without a closing token: the target is the assistant turn as GLM renders
    it, then `<|user|>` (what GLM stops on); a few SFT steps fit it."""
    from slimish.trainer.sft import sft_batches
    from slimish.trainer.torch_backend import TorchTrainer

    model = family_dirs["glm4.6"]
    tok = AutoTokenizer.from_pretrained(model)
    answers = {f"What is {a}+{a}?": f"It is {2 * a}." for a in range(4)}
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": q, "response": r}) + "\n" for q, r in answers.items()))
    cfg = load_run_config(
        None,
        [
            f"model={model}",
            f"data.source={demos}",
            "sft.steps=8",
            "sft.batch_size=4",
            "sft.lr=1e-2",
            "trainer.cpu_threads=1",
        ],
    )
    batches = list(sft_batches(cfg, tok))
    user = tok.convert_tokens_to_ids("<|user|>")
    for s in batches[0]:
        question = s.prompt[0]["content"]
        conv = [{"role": "user", "content": question}, {"role": "assistant", "content": answers[question]}]
        assert s.tokens == tok.apply_chat_template(conv, tokenize=True, return_dict=False) + [user]
        assert s.prompt_length == len(
            tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        assert s.loss_mask == [1] * s.response_length
    trainer = TorchTrainer(cfg)
    losses = [trainer.sft_step(batch)["sft/loss"] for batch in batches]
    assert losses[-1] < 0.5 * losses[0]


def test_deepseek_v31_history_with_tool_calls_renders_as_hf(
    family_dirs: dict[str, Path], family_engine: Callable[[str], str]
) -> None:
    """The template concatenates `arguments` as a string: the engine renders an OpenAI history
    (arguments a JSON string, as the SDK sends it, spacing kept) exactly as HF renders it."""
    model = family_dirs["deepseek-v3.1"]
    tok = AutoTokenizer.from_pretrained(model)
    case = next(c for c in CASES if c.name == "deepseek-v3.1")
    history = conversation(case)[:6]
    history[2]["tool_calls"][0]["function"]["arguments"] = '{"expression":"2+3"}'  # compact, as some agents write it
    want = tok.apply_chat_template(
        history, tools=case.tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert '<｜tool▁sep｜>{"expression":"2+3"}<｜tool▁call▁end｜>' in tok.decode(want)
    url = family_engine("deepseek-v3.1")
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"messages": history, "tools": case.tools, "max_tokens": 1, "return_prompt_token_ids": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == want


@pytest.mark.parametrize("family, end", [("qwen2.5", "<|endoftext|>"), ("llama3.1", "<|eom_id|>")])
def test_a_secondary_end_token_is_recorded_alike_by_ctx_chat_and_capture(
    family_dirs: dict[str, Path], family_engine: Callable[[str], str], family: str, end: str
) -> None:
    """A turn that ends on an end token other than the template's close (forced by a bias after 2
    tokens): both paths keep the model's token and do not add the template's close after it."""
    model = family_dirs[family]
    tok = AutoTokenizer.from_pretrained(model)
    end_id = tok.convert_tokens_to_ids(end)
    first = {"max_new_tokens": 8, "min_new_tokens": 2, "logit_bias": {str(end_id): 100.0}}
    opening = [{"role": "user", "content": "Say something."}]
    follow_up = {"role": "user", "content": "Again."}
    url = family_engine(family)

    async def via_ctx() -> Sample:
        runtime = runtime_for(model, url, "rollout.max_new_tokens=3")
        try:
            sample = Sample(prompt=opening)
            ctx = RolloutContext(runtime, sample)
            turn = await ctx.chat(opening, sampling_params=first)
            await ctx.chat([*opening, turn.message, follow_up])
            return sample
        finally:
            await runtime.close()

    async def via_capture() -> list[Sample]:
        gateway = Gateway(url, ModelFormat(tok), default_sampling={"temperature": 0.0, "max_new_tokens": 3})
        await gateway.start()
        try:
            client = openai.AsyncOpenAI(base_url=gateway.session_base_url("s"), api_key="x", max_retries=0, timeout=60)
            reply = await client.chat.completions.create(
                model="m",
                messages=opening,
                max_tokens=8,
                logit_bias={str(end_id): 100},
                extra_body={"min_tokens": 2},
            )
            await client.chat.completions.create(model="m", messages=[*opening, reply.choices[0].message, follow_up])
            return gateway.pop_samples("s", Sample(prompt=opening))
        finally:
            await gateway.stop()

    sample, (captured,) = asyncio.run(via_ctx()), asyncio.run(via_capture())
    first_turn = sample.response_ids[:3]
    assert first_turn[-1] == end_id and sample.loss_mask[:3] == [1, 1, 1]
    close = ModelFormat(tok).chat().close_id
    assert sample.response_ids[3] != close  # no close the template would not render after the model's own end token
    assert (captured.tokens, captured.loss_mask) == (sample.tokens, sample.loss_mask)
