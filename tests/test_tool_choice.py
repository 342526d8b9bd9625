"""Forced tool calls (`tool_choice` "required" / a named function), the one tool normalisation and
the `max_tokens` rule (slimish/formats/tool_choice.py), on the engine's `/v1/chat/completions`.

For every model family (tests/model_families.FAMILIES, real tokenizer and template, the fitted
tiny models of tests/family_cases.py), 32 replies sampled at temperature 1 under the constraint
all parse with the family's own tool-call parser as a call to an offered tool, arguments valid
against its JSON schema. Every parser's constraint, those of formats no family here uses
(Kimi-K2, Mistral, pythonic) included, is also checked on the grammar alone: random walks through
it, read back by the parser.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import jsonschema
import model_families
import numpy as np
import pytest
from family_cases import CALCULATOR, CASES, conversation, expected
from transformers import AutoTokenizer

from slimish.engine.grammar import Grammars, matcher
from slimish.formats.model import ModelFormat
from slimish.formats.tool_choice import (
    ForcedTool,
    ToolChoiceError,
    clamp_max_tokens,
    forced_tool,
    normalize_tools,
    tool_call_constraint,
)
from slimish.formats.tool_parsers import PARSER_CLASSES, tool_call_parser
from slimish.launch.local import engine_process
from slimish.protocol import SamplingParams

CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "description": "Convert a distance",
        "parameters": {
            "type": "object",
            "properties": {
                "value": {"type": "integer", "minimum": 0, "maximum": 999},
                "unit": {"type": "string", "enum": ["km", "mi"]},
                "exact": {"type": "boolean"},
            },
            "required": ["value", "unit"],
        },
    },
}
# The calculator with its expression bounded: a free string sampled at temperature 1 from a tiny
# model (or a random walk) ends only by chance; a bounded one shows the bound is kept. (A pattern,
# not maxLength: xgrammar 0.2.9 lets a raw tab into a string with a length bound, which no JSON
# parser reads.)
SHORT_CALCULATOR = {
    "type": "function",
    "function": {
        **CALCULATOR["function"],
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/ ().-]{1,12}$"}},
            "required": ["expression"],
        },
    },
}
TOOLS = [SHORT_CALCULATOR, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CASE_OF = {c.family: c for c in CASES if not c.kwargs}  # a family's plain case (its system prompt was fitted)
SAMPLES = 32  # forced replies per family at temperature 1, each of which must parse and validate


# ---- every family, on its engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def family_url(family_dirs, family_engine, tmp_path_factory):
    """Family name -> engine URL, each started when first asked for. Llama 3.2 (no case of its
    own) shares Llama 3.1's vocabulary and fitted weights: its dir is Llama 3.2's tokenizer and
    template with those weights."""
    with ExitStack() as stack:
        own: dict[str, str] = {}

        def url(family: str) -> str:
            if family in family_dirs:
                return family_engine(family)
            if family not in own:
                d = model_families.build_family(family, tmp_path_factory.mktemp(family) / family)
                shutil.copyfile(family_dirs["llama3.1"] / "model.safetensors", d / "model.safetensors")
                own[family] = stack.enter_context(engine_process(d, log_path=d.parent / "engine.log")).url
            return own[family]

        yield url


def chat(url: str, family: str, **body) -> list[dict]:
    case = CASE_OF.get(family, CASE_OF["llama3.1"])
    messages = [{"role": "system", "content": f"You are a careful assistant ({case.name})."}]
    messages.append({"role": "user", "content": "How far is 12 km in miles, and what is 7*6?"})
    body = {"messages": messages, "tools": TOOLS, "temperature": 1.0, "max_tokens": 160, "seed": 7, **body}
    body["return_token_ids"] = True
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def forced_calls(choices: list[dict], names: set[str]) -> set[tuple[int, ...]]:
    """Each choice is one call (nothing else) to a tool of `names` with schema-valid arguments; the distinct outputs."""
    for choice in choices:
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls", choice
        assert len(message["tool_calls"]) == 1 and not message["content"], message
        call = message["tool_calls"][0]["function"]
        assert call["name"] in names, call
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    return {tuple(c["response_token_ids"]) for c in choices}


@pytest.fixture(scope="module")
def sampled(family_url) -> dict[str, list[dict]]:
    """Family -> 32 replies forced to the named tool at temperature 1. All families' requests are
    in flight at once: each engine decodes on one thread (the suite runs with OMP_NUM_THREADS=1),
    so nine engines keep every core busy where one at a time would not."""
    named = {"type": "function", "function": {"name": "convert"}}
    families = sorted(model_families.FAMILIES)
    urls = {family: family_url(family) for family in families}  # started here, one at a time
    with ThreadPoolExecutor(len(families)) as pool:
        jobs = {family: pool.submit(chat, urls[family], family, tool_choice=named, n=SAMPLES) for family in families}
        return {family: job.result() for family, job in jobs.items()}


@pytest.mark.parametrize("family", sorted(model_families.FAMILIES))
def test_forced_calls_parse_and_validate_for_every_family(family, sampled, family_url, family_dirs):
    """32 samples of a named tool at temperature 1 (the fitted models always pick the calculator
    under "required", with much the same expression: the named tool's integer, enum and boolean
    arguments are where samples differ); "required" greedy below, and sampled through the gateway
    (tests/test_gateway_structured.py, tests/test_agent_frameworks.py)."""
    url = family_url(family)
    named = sampled[family]
    assert len(named) == SAMPLES and len(forced_calls(named, {"convert"})) > 1

    # Where the model would call anyway (a fitted conversation), forcing changes nothing: the
    # greedy forced reply is the family's own call, token for token (markers as single tokens).
    for case in (c for c in CASES if c.family == family and not c.kwargs.get("builtin_tools")):
        e = expected(ModelFormat(AutoTokenizer.from_pretrained(family_dirs[family])), case)
        body = {"messages": conversation(case)[:2], "tools": case.tools, "chat_template_kwargs": case.kwargs}
        body |= {"tool_choice": "required", "temperature": 0, "return_token_ids": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["response_token_ids"] == e.turns[0], case.name


def test_n_copies_with_a_seed_are_seed_plus_j(family_url):
    """`n` choices with a `seed` are the replies to seeds seed, seed+1, ... (as native `/generate`'s
    n), not n clones of one."""
    url, convert = family_url("qwen2.5"), {"type": "function", "function": {"name": "convert"}}
    ids = [tuple(c["response_token_ids"]) for c in chat(url, "qwen2.5", tool_choice=convert, n=3)]
    assert ids[1] == tuple(chat(url, "qwen2.5", tool_choice=convert, seed=8)[0]["response_token_ids"])
    assert len(set(ids)) > 1


def test_bad_tool_choice_is_a_400_naming_the_field(family_url):
    url = family_url("qwen2.5")
    base = {"messages": [{"role": "user", "content": "hi"}]}
    for body, words in [
        ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "Tool 'nope' not found"),
        ({"tools": TOOLS, "tool_choice": "always"}, "expected"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ]:
        r = httpx.post(url + "/v1/chat/completions", json={**base, **body}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (
            error["param"] == "tool_choice"
            and error["message"].startswith("tool_choice: ")
            and words in error["message"]
        )


def test_max_tokens_is_clamped_to_the_room_left(family_url):
    url = family_url("qwen2.5")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6, "return_prompt_token_ids": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# ---- the rules, without an engine --------------------------------------------------------------


def test_clamp_rule():
    assert clamp_max_tokens(None, 100, 4096) == 3996  # nothing asked: the room left
    assert clamp_max_tokens(16384, 100, 4096) == 3996  # pydantic-ai's Anthropic default: clamped, not refused
    assert clamp_max_tokens(50, 100, 4096) == 50
    assert clamp_max_tokens(16384, 100, 4096, cap=256) == 256  # a rollout's max_new_tokens caps it
    assert clamp_max_tokens(None, 100, 4096, cap=256) == 256
    with pytest.raises(ToolChoiceError, match=r"^max_completion_tokens: the prompt \(4096 tokens\) leaves no room"):
        clamp_max_tokens(10, 4096, 4096, field="max_completion_tokens")
    with pytest.raises(ToolChoiceError, match="^max_tokens: must be at least 1, got 0") as info:
        clamp_max_tokens(0, 10, 4096)
    assert info.value.field == "max_tokens"


def test_forced_tool_reads_openai_and_responses_shapes():
    tools = normalize_tools(TOOLS)
    assert (
        forced_tool(None, tools) is None and forced_tool("auto", tools) is None and forced_tool("none", tools) is None
    )
    assert forced_tool("required", tools) == ForcedTool(("calculator", "convert"))
    assert forced_tool({"type": "function", "function": {"name": "convert"}}, tools) == ForcedTool(("convert",))
    assert forced_tool({"type": "function", "name": "convert"}, tools) == ForcedTool(("convert",))  # Responses
    with pytest.raises(ToolChoiceError, match="^tool_choice: Tool 'nope' not found in tools list.$"):
        forced_tool({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(
        ToolChoiceError, match="^tool_choice: Tools cannot be empty if tool choice is set to required.$"
    ):
        forced_tool("required", [])
    with pytest.raises(
        ToolChoiceError, match="^tool_choice: Tools cannot be empty if tool choice is set to a specific"
    ):
        forced_tool({"type": "function", "function": {"name": "convert"}}, None)
    with pytest.raises(ToolChoiceError, match="^tool_choice: expected") as info:
        forced_tool({"type": "allowed_tools"}, tools)
    assert info.value.field == "tool_choice"


def test_one_normalisation_for_every_protocol(family_dirs):
    """A tool sent as Chat's, Responses' or Anthropic's shape is the same canonical tool, rendered
    to the same prompt ids."""
    fn = CONVERT["function"]
    chat_tool = {"type": "function", "function": {**fn, "strict": True}}
    responses_tool = {
        "type": "function",
        "name": fn["name"],
        "description": fn["description"],
        "parameters": fn["parameters"],
        "strict": True,
    }
    anthropic_tool = {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
    canonical = normalize_tools([chat_tool])
    assert normalize_tools([responses_tool]) == canonical
    assert normalize_tools([anthropic_tool]) == normalize_tools([CONVERT])  # Anthropic has no `strict`
    assert canonical[0]["function"]["strict"] is True
    fmt = ModelFormat(AutoTokenizer.from_pretrained(family_dirs["qwen2.5"]))
    messages = [{"role": "user", "content": "hi"}]
    assert fmt.chat(normalize_tools([responses_tool])).prompt_ids(messages) == fmt.chat(canonical).prompt_ids(messages)
    for bad, words in [
        ([{"type": "function"}], "non-empty string name"),
        ([{"type": "web_search"}], "'web_search'"),
        ([CONVERT, CONVERT], "unique"),
        ([{"name": "x", "input_schema": 3}], "JSON-schema object"),
    ]:
        with pytest.raises(ToolChoiceError, match=f"^tools: .*{words}"):
            normalize_tools(bad)


# ---- every parser's constraint, on the grammar alone ----------------------------------------------


@pytest.fixture(scope="module")
def walker(family_dirs):
    """Qwen's tokenizer, its end token, and which of its tokens are only whitespace."""
    tok = AutoTokenizer.from_pretrained(family_dirs["qwen2.5"])
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    blank = np.array([bool(p) and all(c in "ĠĊĉč" for c in p) for p in pieces])
    return tok, tok.convert_tokens_to_ids("<|im_end|>"), blank


@pytest.mark.parametrize("parser", [cls.names[0] for cls in PARSER_CLASSES])
def test_every_parser_constraint_reads_back(parser, walker):
    """Random walks through the constraint (seeded; any token the grammar allows, whitespace-only
    tokens avoided when another is allowed) parse with the family's parser as a call to an offered
    tool with schema-valid arguments."""
    import xgrammar

    tok, end, blank = walker
    tools = normalize_tools(TOOLS)
    compiled = Grammars(tok, len(tok), {end}).compile(
        SamplingParams(**tool_call_constraint(parser, tools, forced_tool("required", tools)))
    )
    rng, seen = np.random.default_rng(0), set()
    for _ in range(10):
        m, ids = matcher(compiled), []
        while not m.is_terminated() and len(ids) < 400:
            mask = xgrammar.allocate_token_bitmask(1, len(tok))
            m.fill_next_token_bitmask(mask)
            allowed = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[: len(tok)].astype(bool)
            if (allowed & ~blank).any():
                allowed &= ~blank
            t = int(rng.choice(np.flatnonzero(allowed)))
            assert m.accept_token(t)
            ids.append(t)
        assert m.is_terminated() and ids[-1] == end, tok.decode(ids)
        text = tok.decode(ids[:-1])
        content, calls = tool_call_parser(parser).parse(text, tools)
        assert content == "" and len(calls) == 1, text
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[calls[0]["function"]["name"]]
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)
        seen.add(text)
    assert len(seen) > 1
