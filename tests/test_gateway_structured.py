"""The gateway's forced tool calls, structured output and per-protocol fields, through the real
`openai` and `anthropic` SDKs against the session's shared engine (its tokenizer's template
writes qwen2.5 tool calls): every constrained reply is valid and captured as any turn is (prompt
ids equal to HF's rendering of what was sent, mask 1 on exactly the engine's ids); what the
gateway cannot honour is a 400 naming the field; every field of the three APIs is honoured,
refused or listed as ignored in docs/agents.md.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from helpers import with_gateway
from test_engine_protocol import SCHEMA  # bounded, so that a random model at temperature 1 finishes

from slimish.gateway.server import Gateway
from slimish.types import Sample

GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py): these tests only generate
DOCS = Path(__file__).resolve().parent.parent / "docs" / "agents.md"
PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "op": {"enum": ["add", "mul"]}},
    "required": ["a", "op"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": f"The {name} tool.", "parameters": PARAMETERS, "strict": True},
    }
    for name in ("calc", "lookup")
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"], "strict": True}
    for f in (t["function"] for t in CHAT_TOOLS)
]
MESSAGES = [{"role": "user", "content": "Who is it?"}]
TEMPLATE = Sample(prompt=MESSAGES)
FREE = {"temperature": 1.0, "max_tokens": 256}


def openai_sdk(gateway: Gateway, session: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.session_base_url(session), api_key="x", max_retries=0, timeout=120)


def anthropic_sdk(gateway: Gateway, session: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway.session_url(session), api_key="x", max_retries=0, timeout=120)


def hf_prompt(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)


def captured(gateway: Gateway, session: str, tok: Any, tools: list[dict[str, Any]] | None) -> Sample:
    """The session's one sample: HF's rendering of what was sent, then model ids only (mask 1),
    marked as drawn under a grammar (its log-probs are not pi_old: `Sample.reshaped`)."""
    (s,) = gateway.pop_samples(session, TEMPLATE)
    assert s.tokens[: s.prompt_length] == hf_prompt(tok, MESSAGES, tools)
    assert s.loss_mask == [1] * (len(s.tokens) - s.prompt_length) and s.loss_mask
    assert s.reshaped
    return s


# ---- structured output -----------------------------------------------------------------------------


def test_chat_response_format_gives_100_valid_json_replies_each_one_exact_sample(engine: str, tok: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    async def agents(gateway: Gateway) -> list[tuple[Any, Sample]]:
        async def one(i: int) -> Any:
            return await openai_sdk(gateway, f"s{i}").chat.completions.create(
                model="m", messages=MESSAGES, response_format=fmt, extra_body={"return_token_ids": True}, **FREE
            )

        replies = await asyncio.gather(*(one(i) for i in range(100)))
        return [(r, captured(gateway, f"s{i}", tok, None)) for i, r in enumerate(replies)]

    out = with_gateway(engine, tok, agents)
    for reply, sample in out:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert sample.tokens[sample.prompt_length :] == choice.model_extra["response_token_ids"]
    assert len({r.choices[0].message.content for r, _ in out}) > 20  # sampled, not one forced string


def test_responses_text_format_logprobs_truncation_and_metadata(engine: str, tok: Any) -> None:
    """`text.format` constrains the reply and is echoed; the output text's logprobs (with
    `top_logprobs` alternatives) are the captured sample's; `truncation` and `metadata` are echoed."""
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}

    async def agent(gateway: Gateway) -> tuple[Any, list[Any], Sample]:
        client = openai_sdk(gateway, "r")
        kwargs = {
            "model": "m",
            "input": MESSAGES,
            "text": {"format": fmt},
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 3,
            "truncation": "auto",
            "metadata": {"run": "7"},
            "temperature": 1.0,
            "max_output_tokens": 256,
        }
        reply = await client.responses.create(**kwargs)
        events = [e async for e in await client.responses.create(**kwargs, stream=True, store=False)]
        return reply, events, gateway.pop_samples("r", TEMPLATE)[0]

    reply, events, sample = with_gateway(engine, tok, agent)
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    assert reply.text.format.type == "json_schema" and reply.text.format.schema_ == SCHEMA
    assert (reply.truncation, reply.metadata, reply.top_logprobs) == ("auto", {"run": "7"}, 3)
    logprobs = reply.output[0].content[0].logprobs
    first = sample.tokens[sample.prompt_length :][: len(logprobs)]
    assert len(logprobs) == reply.usage.output_tokens == len(first)
    assert [lp.logprob for lp in logprobs] == pytest.approx(sample.rollout_logprobs[: len(logprobs)])
    assert all(len(lp.top_logprobs) == 3 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs).startswith(reply.output_text)  # then the end-of-turn token
    (delta,) = [e for e in events if e.type == "response.output_text.delta"]
    jsonschema.validate(json.loads(delta.delta), SCHEMA)
    assert len(delta.logprobs) == events[-1].response.usage.output_tokens


def test_anthropic_output_config_format_is_a_valid_json_reply(engine: str, tok: Any) -> None:
    """Anthropic structured outputs, as the SDK sends them (`output_config.format`, and
    `messages.parse(output_format=...)`), constrain the text block."""
    from typing import Literal

    from pydantic import BaseModel

    class Person(BaseModel):  # the SDK moves `pattern` and bounds out of the schema it sends: enums stay
        name: Literal["ann", "bob", "cy"]
        adult: bool

    async def agent(gateway: Gateway) -> tuple[Any, Any]:
        client = anthropic_sdk(gateway, "a")
        fmt = {"type": "json_schema", "schema": SCHEMA}
        plain = await client.messages.create(
            model="m", messages=MESSAGES, max_tokens=256, output_config={"format": fmt}
        )
        parsed = await client.messages.parse(model="m", messages=MESSAGES, max_tokens=256, output_format=Person)
        return plain, parsed

    plain, parsed = with_gateway(engine, tok, agent)
    jsonschema.validate(json.loads(plain.content[0].text), SCHEMA)
    assert plain.stop_reason == "end_turn"
    assert isinstance(parsed.parsed_output, Person)


def test_chat_metadata_is_echoed_beside_the_weight_version(engine: str, tok: Any) -> None:
    async def post(gateway: Gateway) -> httpx.Response:
        body = {"messages": MESSAGES, "max_tokens": 2, "metadata": {"run": "7", "weight_version": "mine"}}
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(gateway.session_base_url("m") + "/chat/completions", json=body)

    r = with_gateway(engine, tok, post)
    assert r.status_code == 200 and r.json()["metadata"] == {"weight_version": "mine", "run": "7"}


# ---- forced tool calls ----------------------------------------------------------------------------


def test_forced_tool_calls_in_every_protocol_parse_validate_and_are_captured(engine: str, tok: Any) -> None:
    """Chat `required` / a named function, Responses `required` / `{"type": "function", "name"}`,
    Anthropic `any` / `tool`: one call each, to the named tool where one is named, its arguments
    valid against the tool's schema; the tools render as the Chat tools do (`strict` kept)."""

    async def agent(gateway: Gateway) -> dict[str, tuple[str, dict[str, Any], Sample]]:
        out = {}
        chat = {"model": "m", "messages": MESSAGES, "tools": CHAT_TOOLS, **FREE}
        for key, choice in (
            ("chat-required", "required"),
            ("chat-named", {"type": "function", "function": {"name": "lookup"}}),
        ):
            reply = await openai_sdk(gateway, key).chat.completions.create(**chat, tool_choice=choice)
            (call,) = reply.choices[0].message.tool_calls
            assert reply.choices[0].finish_reason == "tool_calls"
            out[key] = (
                call.function.name,
                json.loads(call.function.arguments),
                captured(gateway, key, tok, CHAT_TOOLS),
            )
        resp = {"model": "m", "input": MESSAGES, "tools": RESPONSES_TOOLS, "temperature": 1.0, "max_output_tokens": 256}
        for key, choice in (("resp-required", "required"), ("resp-named", {"type": "function", "name": "lookup"})):
            reply = await openai_sdk(gateway, key).responses.create(**resp, tool_choice=choice)
            (call,) = [o for o in reply.output if o.type == "function_call"]
            out[key] = (call.name, json.loads(call.arguments), captured(gateway, key, tok, CHAT_TOOLS))
        msgs = {"model": "m", "messages": MESSAGES, "tools": ANTHROPIC_TOOLS, "max_tokens": 256}
        for key, choice in (
            ("anth-any", {"type": "any"}),
            ("anth-tool", {"type": "tool", "name": "lookup", "disable_parallel_tool_use": True}),
        ):
            reply = await anthropic_sdk(gateway, key).messages.create(**msgs, tool_choice=choice)
            (call,) = [b for b in reply.content if b.type == "tool_use"]
            assert reply.stop_reason == "tool_use"
            out[key] = (call.name, call.input, captured(gateway, key, tok, CHAT_TOOLS))
        return out

    out = with_gateway(engine, tok, agent)
    for key, (name, arguments, _) in out.items():
        assert name == "lookup" if key.endswith(("named", "tool")) else name in ("calc", "lookup"), key
        jsonschema.validate(arguments, PARAMETERS)
    prompts = {tuple(s.tokens[: s.prompt_length]) for _, _, s in out.values()}
    assert len(prompts) == 1  # one tool, one rendering, whichever protocol sent it


def test_max_tokens_is_clamped_to_the_runs_cap_and_a_full_context_is_a_400(engine: str, tok: Any) -> None:
    """pydantic-ai's Anthropic default (`max_tokens: 16384`, beyond the tiny model's 2048 context)
    is clamped: here to the run's `max_new_tokens` (4); a prompt that fills the context is a 400
    naming the field."""

    async def agent(gateway: Gateway) -> tuple[Any, Any]:
        reply = await anthropic_sdk(gateway, "c").messages.create(model="m", messages=MESSAGES, max_tokens=16384)
        long = [{"role": "user", "content": "word " * 4000}]
        try:
            await openai_sdk(gateway, "d").chat.completions.create(model="m", messages=long, max_completion_tokens=8)
        except openai.BadRequestError as exc:
            return reply, exc
        return reply, None

    reply, refused = with_gateway(engine, tok, agent, default_sampling={"temperature": 0.0, "max_new_tokens": 4})
    assert reply.usage.output_tokens <= 4
    assert refused is not None and refused.body["param"] == "max_completion_tokens"
    assert refused.body["message"].startswith("max_completion_tokens: the prompt")


# ---- refused before any generation ----------------------------------------------------------------

CHAT_REFUSED = [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"return_meta_info": True}, "return_meta_info"),
    ({"metadata": {"a": 1}}, "metadata"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
    ({"tools": CHAT_TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
]


@pytest.mark.parametrize("extra, field", CHAT_REFUSED, ids=[f for _, f in CHAT_REFUSED])
def test_chat_fields_the_gateway_cannot_honour_are_a_400_naming_them(
    tok: Any, extra: dict[str, Any], field: str
) -> None:
    async def post(gateway: Gateway) -> httpx.Response:
        body = {"model": "m", "messages": MESSAGES, **extra}
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(gateway.session_base_url("bad") + "/chat/completions", json=body)

    r = with_gateway("http://127.0.0.1:9", tok, post)  # nothing listens there: no request may reach an engine
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error


# ---- the field audit ----------------------------------------------------------------------------


def _fields(module: Any, name: str) -> set[str]:
    return set(getattr(module, name).__annotations__)


def test_every_field_of_the_three_apis_is_in_the_gateways_field_table() -> None:
    """Each request field the SDKs send (their create params) is in docs/agents.md's table, which
    says whether the gateway honours it, refuses it (the adapters' REFUSED) or ignores it and why."""
    from anthropic.types import message_create_params
    from openai.types.chat import completion_create_params
    from openai.types.responses import response_create_params

    from slimish.gateway.protocols import anthropic as anthropic_protocol
    from slimish.gateway.protocols import openai_chat, openai_responses

    text = DOCS.read_text()
    tables = {
        "chat": (_fields(completion_create_params, "CompletionCreateParamsBase"), openai_chat.REFUSED),
        "responses": (_fields(response_create_params, "ResponseCreateParamsBase"), openai_responses.REFUSED),
        "anthropic": (_fields(message_create_params, "MessageCreateParamsBase"), anthropic_protocol.REFUSED),
    }
    for protocol, (fields, refused) in tables.items():
        section = re.search(rf"<!-- fields: {protocol} -->(.*?)<!-- /fields -->", text, re.DOTALL)
        assert section, f"docs/agents.md has no field table for {protocol}"
        rows = {
            field: how
            for cell, how in re.findall(r"^\| ((?:`[a-z_]+`(?:, )?)+) \| (\w+)", section.group(1), re.MULTILINE)
            for field in re.findall(r"`([a-z_]+)`", cell)
        }
        assert fields - rows.keys() == set(), protocol
        assert {f for f, how in rows.items() if how == "refused"} >= set(refused), protocol
        assert set(rows.values()) <= {"honoured", "refused", "ignored", "echoed"}, protocol


def test_a_structured_answer_on_a_prompt_that_opened_reasoning_comes_after_the_reasoning(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """DeepSeek-V3.1 with `thinking`: the generation prompt opens `<think>`, so the grammar lets the
    model finish its reasoning (`</think>`, the marker's own token) and then holds it to the JSON;
    without reasoning, the JSON is the whole reply."""
    import xgrammar
    from model_families import build_family
    from transformers import AutoTokenizer

    from slimish.formats.model import ModelFormat
    from slimish.formats.tool_choice import json_answer_fields

    tok = AutoTokenizer.from_pretrained(build_family("deepseek-v3.1", tmp_path_factory.mktemp("ds31")))
    fmt, schema = ModelFormat(tok), json.dumps(SCHEMA)
    assert json_answer_fields(fmt, fmt.chat().prompt_ids(MESSAGES), schema) == {"json_schema": schema}
    prompt = fmt.chat(thinking=True).prompt_ids(MESSAGES)
    (tag,) = json_answer_fields(fmt, prompt, schema).values()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, stop_token_ids=[tok.eos_token_id]))
    grammar = compiler.compile_structural_tag(tag)

    def accepts(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(grammar)
        ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()

    answer = '{"name": "ann", "age": 3}'
    assert accepts("Easy.</think>" + answer) and accepts("Easy.</think>\n\n" + answer)
    assert not accepts(answer) and not accepts("Easy.</think>Ann, 3.")
    reply = fmt.reply("Easy.</think>" + answer, prompt, None)
    assert (reply.reasoning_content, reply.content) == ("Easy.", answer)
