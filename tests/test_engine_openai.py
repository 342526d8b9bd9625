"""The engine's OpenAI-compatible routes, driven by the real `openai` SDK against a real engine.

Every reply is checked against the native `/generate` output for the same prompt ids, so the
OpenAI layer is shown to add shape only, never different tokens, text or logprobs.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers import TOOLS, post

from slimish.engine.openai_api import _settled

GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py): these tests only generate
PROMPT_IDS = [5, 17, 42, 99, 7]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def url(engine):
    return engine


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def native(url: str, ids: list[int], max_new_tokens: int, **params) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens, **params},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---- /v1/completions ----------------------------------------------------------------------------


def test_completion_greedy_equals_native(url, client, tok):
    ref = native(url, PROMPT_IDS, 12)
    out = client.completions.create(
        model="any",
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = out.model_dump()["choices"][0]
    assert choice["token_ids"] == ref["output_ids"] and choice["prompt_token_ids"] == PROMPT_IDS
    assert choice["text"] == ref["text"]
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
    assert out.object == "text_completion" and out.model == "any"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 12, 17)
    # A text prompt is tokenised once, as /generate does.
    text_out = client.completions.create(
        model="m", prompt="Hello world", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text_out.choices[0].text == native(url, tok.encode("Hello world"), 6)["text"]


def test_completion_logprobs_equal_native(url, client, tok):
    ref = native(url, PROMPT_IDS, 8)["meta_info"]
    out = client.completions.create(
        model="m", prompt=PROMPT_IDS, max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == [e[0] for e in ref["output_token_logprobs"]]
    assert lp.tokens == [tok.decode([e[1]]) for e in ref["output_token_logprobs"]]
    assert lp.top_logprobs == [{tok.decode([t]): v for v, t, _ in e} for e in ref["output_top_logprobs"]]
    assert lp.text_offset == [-1] * 8  # as SGLang


def test_completion_echo_prepends_prompt_and_its_logprobs(url, client, tok):
    out = client.completions.create(
        model="m",
        prompt=PROMPT_IDS,
        max_tokens=4,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    r = post(
        url,
        "/generate",
        {
            "input_ids": PROMPT_IDS,
            "sampling_params": {**GREEDY, "max_new_tokens": 4},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    ref = r.json()
    choice = out.choices[0]
    assert choice.text == tok.decode(PROMPT_IDS, skip_special_tokens=True) + ref["text"]  # as SGLang echoes ids
    meta = ref["meta_info"]
    assert choice.logprobs.token_logprobs == [
        e[0] for e in meta["input_token_logprobs"] + meta["output_token_logprobs"]
    ]
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == 9
    assert choice.logprobs.top_logprobs[0] is None and len(choice.logprobs.top_logprobs) == 9


def test_completion_n_and_batch_are_prompt_major(client):
    prompts = [PROMPT_IDS, [300, 301, 302]]
    out = client.completions.create(
        model="m",
        prompt=prompts,
        n=2,
        max_tokens=5,
        temperature=1.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choices = out.model_dump()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in choices] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert choices[0]["token_ids"] != choices[1]["token_ids"]  # two samples, not one copied
    assert out.usage.prompt_tokens == 5 + 3 and out.usage.completion_tokens == 20  # each prompt counted once
    single = client.completions.create(
        model="m", prompt=PROMPT_IDS, n=2, max_tokens=3, temperature=1.0, extra_body={"ignore_eos": True}
    )
    assert len(single.choices) == 2


def test_completion_stream_adds_up_to_the_reply(client):
    kw = dict(
        model="m",
        prompt=[PROMPT_IDS, [300, 301]],
        max_tokens=10,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    full = client.completions.create(**kw).model_dump()["choices"]
    chunks = [
        c.model_dump() for c in client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    for i, ref in enumerate(full):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == ref["text"]
        assert sum((c["token_ids"] for c in mine), []) == ref["token_ids"]
        assert mine[0]["prompt_token_ids"] == ref["prompt_token_ids"]
        assert sum((c["logprobs"]["token_logprobs"] for c in mine), []) == ref["logprobs"]["token_logprobs"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]


def test_stop_string_is_cut_in_reply_and_stream(url, client, tok):
    ref = native(url, PROMPT_IDS, 16)
    text, ids = ref["text"], ref["output_ids"]
    edge = len(tok.decode(ids[:5]))
    stop = text[edge - 1 : edge + 1]  # spans a token boundary, so a stream must hold its first half
    kw = dict(model="m", prompt=PROMPT_IDS, max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    out = client.completions.create(**kw).choices[0]
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.model_extra["matched_stop"]) == ("stop", stop)
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == out.text


def test_abort_mid_stream_finishes_with_abort(url):
    body = {"prompt": PROMPT_IDS, "max_tokens": 1500, "ignore_eos": True, "stream": True, "rid": "oa-abort"}
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 2:
                    assert post(url, "/abort_request", {"rid": "oa-abort"}).status_code == 200
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert len(chunks) < 1500


# ---- /v1/chat/completions -----------------------------------------------------------------------


def test_chat_prompt_is_the_chat_template_and_reply_equals_native(url, client, tok):
    out = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_meta_info": True},
    )
    choice = out.model_dump()["choices"][0]
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert choice["prompt_token_ids"] == prompt
    ref = native(url, prompt, 10)
    assert choice["response_token_ids"] == ref["output_ids"]
    assert choice["message"]["content"] == ref["text"] and choice["message"]["role"] == "assistant"
    assert choice["message"]["tool_calls"] is None and choice["finish_reason"] == "length"
    assert choice["meta_info"]["completion_tokens"] == 10 and choice["meta_info"]["weight_version"] == "default"
    assert out.object == "chat.completion" and out.usage.prompt_tokens == len(prompt)


def test_chat_logprobs_equal_native(url, client, tok):
    out = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ref = native(url, out.model_dump()["choices"][0]["prompt_token_ids"], 6)["meta_info"]
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == [e[0] for e in ref["output_token_logprobs"]]
    assert [c.token for c in content] == [tok.decode([e[1]]) for e in ref["output_token_logprobs"]]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [(tok.decode([t]), v) for v, t, _ in e] for e in ref["output_top_logprobs"]
    ]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_stream_adds_up_to_the_reply(client, tools):
    kw = dict(
        model="m", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, n=2, extra_body={"ignore_eos": True}
    )
    if tools:
        kw["tools"] = tools
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    for ref in full.choices:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == ref.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == ref.message.content
        assert [t for c in mine if c.logprobs for t in c.logprobs.content] == ref.logprobs.content
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
        assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_with_tools_renders_them_and_history_tool_calls(client, tok):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    out = client.chat.completions.create(
        model="m",
        messages=history,
        tools=TOOLS,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    # OpenAI sends arguments as a JSON string; the template gets the object (SGLang does the same).
    as_template_wants = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "2+3"}},
                }
            ],
        },
        history[-1],
    ]
    expected = tok.apply_chat_template(
        as_template_wants, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.model_dump()["choices"][0]["prompt_token_ids"] == expected
    assert "<tools>" in tok.decode(expected) and '"arguments": {"expression": "2+3"}' in tok.decode(expected)


def test_settled_holds_back_what_later_tokens_may_change():
    assert _settled("abc\n", ["\n\n"]) == "abc"  # may become a stop string
    assert _settled("abc\n", []) == "abc\n"
    assert _settled("ab<tool_", ["<tool_call>"]) == "ab"
    assert _settled("ab\ufffd", []) == "ab"  # an unfinished UTF-8 character


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions", {"model": "m"}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": True, "return_token_ids": True}, "return_token_ids"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "tool_choice": {"type": "function"}, "tools": TOOLS},
            "tool_choice",
        ),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [5000]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "top_k": 0}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_input_is_400_naming_the_field(url, path, body, field):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] and error["code"] == 400


def test_sdk_surfaces_the_error_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, stream=True, extra_body={"return_token_ids": True})
    assert info.value.status_code == 400 and "return_token_ids" in info.value.body["message"]
    assert len(client.completions.create(model="m", prompt="ok", max_tokens=2).choices) == 1
