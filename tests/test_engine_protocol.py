"""The built-in engine against SGLang 0.5.23's protocol beyond generation itself: constrained
decoding (xgrammar, as SGLang), the `/server_info` fields SGLang's clients read, input logprobs,
tokenize / detokenize, the model card, profiling, and JSON 501s for routes left out."""

from __future__ import annotations

import json
import math
import re

import httpx
import jsonschema
import pytest
import torch
from helpers import post
from transformers import AutoModelForCausalLM

from slimish.protocol import RESHAPING_FIELDS, reshapes

GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py): these tests only generate
PROMPT = [5, 17, 42, 99, 7]
REGEX = r"(yes|no|maybe)-[0-9]{2,3}"
SCHEMA = {
    "type": "object",
    # Not `maxLength`: xgrammar 0.2.8 lets control characters into such strings (so would SGLang).
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def samples(url: str, n: int = 100, **grammar: str) -> list[dict]:
    r = post(
        url,
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"temperature": 1.0, "max_new_tokens": 256, "n": n, **grammar}},
    )
    assert r.status_code == 200, r.text
    return r.json()


# ---- constrained decoding ------------------------------------------------------------------


def test_regex_outputs_match_at_temperature_one(engine):
    outs = samples(engine, regex=REGEX)
    assert len(outs) == 100 and all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    assert all(re.fullmatch(REGEX, o["text"]) for o in outs), [
        o["text"] for o in outs if not re.fullmatch(REGEX, o["text"])
    ]
    assert len({o["text"] for o in outs}) > 20  # sampled, not one forced string


def test_json_schema_outputs_validate_at_temperature_one(engine):
    outs = samples(engine, json_schema=json.dumps(SCHEMA))
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    for o in outs:
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
    assert len({json.loads(o["text"])["name"] for o in outs}) > 20


def test_ebnf_and_structural_tag(engine):
    outs = samples(engine, 20, ebnf='root ::= "<" ("ab" | "cd")+ ">"')
    assert all(re.fullmatch(r"<(ab|cd)+>", o["text"]) for o in outs)
    call = {"type": "json_schema", "json_schema": {"type": "integer", "minimum": 0, "maximum": 999}}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<call>", "content": call, "end": "</call>"}}
    outs = samples(engine, 20, structural_tag=json.dumps(tag))  # xgrammar's format: the tag is the whole output
    assert all(re.fullmatch(r"<call>\d{1,3}</call>", o["text"]) for o in outs), [o["text"] for o in outs]
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<call>", "schema": {"type": "integer"}, "end": "</call>"}],
        "triggers": ["<call>"],
    }
    assert (
        len(samples(engine, 2, structural_tag=json.dumps(legacy))) == 2
    )  # free text until a trigger: compiles and runs


def test_logprobs_are_the_masked_distribution_as_sglang(engine, tiny_model_dir):
    """SGLang masks the logits before taking logprobs: the reported logprob of a token is
    log_softmax over the allowed tokens only, and disallowed alternatives are -inf (null)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    r = post(
        engine,
        "/generate",
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "top_logprobs_num": 40,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "regex": REGEX},
        },
    )
    out = r.json()
    meta, ids = out["meta_info"], out["output_ids"]
    assert re.fullmatch(REGEX, out["text"])
    with torch.no_grad():
        full = torch.log_softmax(hf(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 :].float(), dim=-1)
    for k, (lp, token, _) in enumerate(meta["output_token_logprobs"]):
        allowed = [t for v, t, _ in meta["output_top_logprobs"][k] if v is not None]
        assert token in allowed and math.isclose(
            sum(math.exp(v) for v, _, _ in meta["output_top_logprobs"][k] if v is not None), 1, abs_tol=1e-4
        )
        renormalised = full[k, token] - torch.logsumexp(full[k, allowed], 0)
        assert lp == pytest.approx(float(renormalised), abs=1e-4)


@pytest.mark.parametrize(
    "grammar, words",
    [
        ({"regex": "a("}, "sampling_params.regex: Failed to compile regex grammar"),
        ({"json_schema": "{not json"}, "sampling_params.json_schema: Failed to compile json grammar"),
        ({"ebnf": "root ::= undefined_rule"}, "sampling_params.ebnf: Failed to compile ebnf grammar"),
        ({"structural_tag": "[]"}, "sampling_params.structural_tag: Failed to compile structural_tag grammar"),
        ({"regex": "a\u0000"}, "sampling_params.regex: Invalid regex: NUL bytes"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "Only one of json_schema, regex, ebnf, or structural_tag can be set"),
    ],
)
def test_bad_grammars_are_400s_in_sglang_words(engine, grammar, words):
    r = post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, **grammar}})
    assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_openai_response_format_and_grammar_extras(engine):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 256, "temperature": 1.0, "n": 10}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = post(engine, "/v1/chat/completions", {**chat, "response_format": fmt})
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    r = post(engine, "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})
    done = [c for c in r.json()["choices"] if c["finish_reason"] == "stop"]  # free keys may run to max_tokens
    assert done and all(isinstance(json.loads(c["message"]["content"]), dict) for c in done)
    assert all(c["message"]["content"].lstrip().startswith("{") for c in r.json()["choices"])
    r = post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 16, "n": 10, "regex": REGEX})
    assert all(re.fullmatch(REGEX, c["text"]) for c in r.json()["choices"])
    r = post(
        engine,
        "/v1/chat/completions",
        {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    )
    assert r.status_code == 400 and "json_schema.schema is required" in r.json()["error"]["message"]


# ---- what SGLang's clients read --------------------------------------------------------------


def test_server_info_has_what_bench_one_batch_server_reads(engine):
    info = httpx.get(engine + "/server_info").json()
    state = info["internal_states"][0]
    assert (state["dp_size"] or 1) * (state["attn_dp_size"] or 1) == 1
    assert state["effective_max_running_requests_per_dp"] == info["max_running_requests"] > 0
    assert (
        state["memory_usage"]["token_capacity"] == info["max_total_num_tokens"] > 0
        and state["memory_usage"]["weight"] > 0
    )
    assert info["tokenizer_path"] and "last_gen_throughput" in state and state.get("avg_spec_accept_length") is None
    assert httpx.get(engine + "/get_server_info").json()["internal_states"][0]["dp_size"] == 1


def test_input_logprobs_are_always_present(engine):
    def meta(**body) -> dict:
        r = post(
            engine,
            "/generate",
            {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 2}, **body},
        )
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    assert meta()["input_token_logprobs"] == []  # SGLang: the default start is the prompt's end
    assert meta(logprob_start_len=len(PROMPT), top_logprobs_num=2)["input_top_logprobs"] == []
    two = meta(logprob_start_len=3)["input_token_logprobs"]
    assert [t for _, t, _ in two] == PROMPT[3:] and two[0][0] is not None  # position 3 has a context
    r = post(engine, "/generate", {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": len(PROMPT) + 1})
    assert r.status_code == 400 and "is higher than the number of input tokens 5" in r.json()["error"]["message"]


def test_tokenize_detokenize_round_trip(engine, tok):
    text = "hello world, the cat sat"
    r = post(engine, "/tokenize", {"prompt": text}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    assert post(engine, "/v1/detokenize", {"tokens": r["tokens"]}).json() == {
        "text": tok.decode(r["tokens"], skip_special_tokens=True)
    }
    both = post(engine, "/v1/tokenize", {"prompt": [text, "a"], "add_special_tokens": False}).json()
    assert (
        both["count"] == [len(t) for t in both["tokens"]]
        and post(engine, "/detokenize", {"tokens": both["tokens"]}).json()["text"][1] == "a"
    )
    chat = post(engine, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert chat == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert "Exactly one of 'prompt' or 'messages'" in post(engine, "/tokenize", {}).json()["error"]["message"]
    assert post(engine, "/detokenize", {"tokens": [10**9]}).status_code == 400


def test_model_card_profiling_and_501s(engine, tmp_path):
    name = httpx.get(engine + "/v1/models").json()["data"][0]["id"]
    assert httpx.get(f"{engine}/v1/models/{name}").json()["id"] == name
    missing = httpx.get(engine + "/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    start = post(engine, "/start_profile", {"output_dir": str(tmp_path), "profile_prefix": "t"})
    assert start.status_code == 200 and start.text == "Start profiling.\n"
    post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
    assert httpx.post(engine + "/stop_profile").text == "Stop profiling. This will take some time.\n"
    (trace,) = tmp_path.glob("t-*.trace.json")
    assert json.loads(trace.read_text())["traceEvents"]
    post(engine, "/start_profile", {"output_dir": str(tmp_path), "num_steps": 2, "profile_prefix": "steps"})
    post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
    assert len(list(tmp_path.glob("steps-*.trace.json"))) == 1  # stopped by itself after 2 steps

    for path in (
        "/update_weights_from_tensor",
        "/v1/embeddings",
        "/load_lora_adapter_from_tensors",
        "/v1/responses/abc",
    ):
        r = httpx.post(engine + path, json={})
        assert r.status_code == 501 and r.json()["error"]["message"].startswith(
            f"{path.replace('abc', '{response_id}')}: not implemented"
        )
    assert (
        "/update_weights_from_distributed"
        in httpx.post(engine + "/update_weights_from_tensor", json={}).json()["error"]["message"]
    )


def test_reshapes_names_the_sampling_that_moves_the_distribution() -> None:
    """`protocol.reshapes`: the requests whose log-probs are not the policy's (`Sample.reshaped`)."""
    neutral = {
        "min_new_tokens": 0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "regex": None,
    }
    assert not reshapes({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "stop": ["x"], **neutral})
    moved = {
        "min_new_tokens": 4,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.1,
        "repetition_penalty": 1.1,
        "logit_bias": {"7": 2.0},
        "json_schema": "{}",
        "regex": "a",
        "ebnf": 'root ::= "a"',
        "structural_tag": "{}",
    }
    assert set(moved) == set(RESHAPING_FIELDS)
    for field, value in moved.items():
        assert reshapes({**neutral, field: value}), field
