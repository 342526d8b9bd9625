"""Tool-call and reasoning parsers (slimish/formats): each format on realistic replies, streaming
that adds up to the non-streamed parse under any chunking, and detection from real chat templates."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimish.formats.reasoning import REASONING_PARSERS, detect_reasoning_parser, reasoning_parser
from slimish.formats.tool_parsers import TOOL_CALL_PARSERS, detect_tool_call_parser, tool_call_parser

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


def tool(name: str, **props: str) -> dict:
    properties = {key: {"type": kind} for key, kind in props.items()}
    return {
        "type": "function",
        "function": {"name": name, "description": name, "parameters": {"type": "object", "properties": properties}},
    }


TOOLS = [
    tool(
        "get_weather", city="string", days="integer", metric="boolean", tags="array", options="object", ratio="number"
    ),
    tool("search", query="string"),
    tool("get_time"),
    tool("brave_search", query="string"),
]


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments) of OpenAI calls, after checking their shape."""
    for i, call in enumerate(calls):
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["index"] == i and call["type"] == "function"
        assert set(call) == {"id", "index", "type", "function"} and isinstance(call["function"]["arguments"], str)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def chunkings(text: str, seeds: range = range(6)) -> list[list[str]]:
    """The whole text, one character at a time, and random chunk sizes."""
    out = [[text], list(text)]
    for seed in seeds:
        rng, chunks, pos = random.Random(seed), [], 0
        while pos < len(text):
            size = rng.randint(1, 12)
            chunks.append(text[pos : pos + size])
            pos += size
        out.append(chunks)
    return out


def streamed(stream, chunks: list[str]) -> tuple[str, list[dict]]:
    content, calls = "", []
    for chunk in chunks:
        text, new = stream.feed(chunk)
        content, calls = content + text, calls + new
    text, new = stream.finish()
    return content + text, calls + new


def assert_stream_matches_parse(name: str, reply: str, tools: list[dict] = TOOLS) -> None:
    parser = tool_call_parser(name)
    content, calls = parser.parse(reply, tools)
    for chunks in chunkings(reply):
        got_content, got_calls = streamed(parser.stream(tools), chunks)
        assert got_content == content, chunks
        assert [{**c, "id": None} for c in got_calls] == [{**c, "id": None} for c in calls], chunks


# ---- tool calls: each format ---------------------------------------------------------------------

PARIS = ("get_weather", {"city": "Paris"})
LOUVRE = ("search", {"query": "louvre hours"})
TOKYO = ("search", {"query": '東京の天気 ☀ "quoted"'})
DS3 = "<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>"
DS3_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
DS31_CALL = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
KIMI = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
KIMI_CALL = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"


def ds3(*calls: tuple[str, str]) -> str:
    return DS3.format("\n".join(DS3_CALL.format(n, a) for n, a in calls))


def ds31(*calls: tuple[str, str]) -> str:
    return DS3.format("".join(DS31_CALL.format(n, a) for n, a in calls))


def kimi(*calls: tuple[str, str]) -> str:
    return KIMI.format("".join(KIMI_CALL.format(n, i, a) for i, (n, a) in enumerate(calls)))


def qwen(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def coder(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def glm(name: str, **args: str) -> str:
    return (
        f"<tool_call>{name}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
        + "</tool_call>"
    )


KEPT = "<the reply, stripped>"  # the expected content when no call is taken: nothing is lost

# (parser, reply, content, calls): for each format a call after content, two calls, a call to an
# unknown tool and a malformed block (both stay in the content), no call, unicode arguments.
CASES = [
    # Qwen2.5 / Qwen3 / Hermes
    ("qwen25", "I will check.\n" + qwen("get_weather", '{"city": "Paris"}'), "I will check.", [PARIS]),
    (
        "qwen25",
        qwen("get_weather", '{"city": "Paris"}') + "\n" + qwen("search", '{"query": "louvre hours"}'),
        "",
        [PARIS, LOUVRE],
    ),
    ("qwen25", "Sure.\n" + qwen("delete_all", "{}"), KEPT, []),
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', KEPT, []),
    ("qwen25", "  The answer is 4.\n\n", "The answer is 4.", []),
    ("qwen25", qwen("search", '{"query": "東京の天気 ☀ \\"quoted\\""}'), "", [TOKYO]),
    ("qwen25", '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>', "", [PARIS]),
    ("qwen25", 'Checking.\n<tool_call>\n{"name": "get_weather", "argu', KEPT, []),  # truncated
    ("qwen25", '<tool_call>\n["not", "a call"]\n</tool_call>', KEPT, []),
    ("qwen25", qwen("get_weather", '"Paris"'), KEPT, []),  # arguments must be an object
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "", [("get_time", {})]),
    # The old single-format parser's test: a bad block stays, the newline after a parsed block goes.
    (
        "qwen",
        "I will compute it.\n"
        + qwen("get_weather", '{"city": "Paris"}')
        + "\n"
        + qwen("search", '{"query": "louvre hours"}')
        + "\n<tool_call>\nnot json\n</tool_call>",
        "I will compute it.\n<tool_call>\nnot json\n</tool_call>",
        [PARIS, LOUVRE],
    ),
    # Qwen3-Coder: values typed by the tool's schema
    ("qwen3_coder", "I will look it up.\n" + coder("get_weather", city="Paris"), "I will look it up.", [PARIS]),
    (
        "qwen3_coder",
        coder("get_weather", city="Paris") + "\n" + coder("search", query="louvre hours"),
        "",
        [PARIS, LOUVRE],
    ),
    ("qwen3_coder", coder("rm", path="/"), KEPT, []),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        KEPT,
        [],
    ),
    ("qwen3_coder", "No tools needed: 2 + 2 = 4.", KEPT, []),
    ("qwen3_coder", coder("search", query='東京の天気 ☀ "quoted"'), "", [TOKYO]),
    (
        "qwen3_coder",
        coder(
            "get_weather", city="2024", days="3", metric="True", tags='["a", "b"]', options='{"unit": "C"}', ratio="0.5"
        ),
        "",
        [
            (
                "get_weather",
                {"city": "2024", "days": 3, "metric": True, "tags": ["a", "b"], "options": {"unit": "C"}, "ratio": 0.5},
            )
        ],
    ),
    (
        "qwen3_coder",
        coder("get_weather", city="line one\nline two\n", days="three", metric="null", extra="7"),
        "",
        [("get_weather", {"city": "line one\nline two\n", "days": "three", "metric": None, "extra": "7"})],
    ),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "", [("get_time", {})]),
    # GLM-4.5 / 4.6
    ("glm45", "Checking the weather.\n" + glm("get_weather", city="Paris"), "Checking the weather.", [PARIS]),
    ("glm45", glm("get_weather", city="Paris") + "\n" + glm("search", query="louvre hours"), "", [PARIS, LOUVRE]),
    ("glm45", glm("rm", path="/"), KEPT, []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", KEPT, []),
    ("glm45", "4", KEPT, []),
    ("glm", glm("search", query='東京の天気 ☀ "quoted"'), "", [TOKYO]),
    (
        "glm45",
        glm("get_weather", city="2024", days="3", metric="true", tags='["a"]', options='{"unit": "C"}'),
        "",
        [("get_weather", {"city": "2024", "days": 3, "metric": True, "tags": ["a"], "options": {"unit": "C"}})],
    ),
    ("glm45", "<tool_call>get_time\n</tool_call>", "", [("get_time", {})]),
    # Llama 3.x
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    (
        "llama3",
        'Let me look.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "Let me look.",
        [PARIS],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "search", "arguments": {"query": "louvre hours"}}',
        "",
        [PARIS, LOUVRE],
    ),
    ("llama3", '{"name": "delete_all", "parameters": {}}', KEPT, []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Pa', KEPT, []),
    ("llama3", 'Here is JSON: {"name": "get_weather", "parameters": {}}', KEPT, []),  # JSON calls are whole replies
    ("llama3", "It is sunny.", KEPT, []),
    ("llama3", '<|python_tag|>{"name": "search", "parameters": {"query": "東京の天気 ☀ \\"quoted\\""}}', "", [TOKYO]),
    (
        "llama3",
        '<|python_tag|>brave_search.call(query="weather in Paris")',
        "",
        [("brave_search", {"query": "weather in Paris"})],
    ),
    ("llama3", '<|python_tag|>wolfram_alpha.call(query="2+2")', KEPT, []),  # a built-in tool the request did not offer
    ("llama3", "<|python_tag|>import math\nprint(math.pi)", KEPT, []),  # code interpreter
    # DeepSeek-V3 (and R1)
    ("deepseekv3", "Let me check." + ds3(("get_weather", '{"city": "Paris"}')), "Let me check.", [PARIS]),
    (
        "deepseekv3",
        ds3(("get_weather", '{"city": "Paris"}'), ("search", '{"query": "louvre hours"}')),
        "",
        [PARIS, LOUVRE],
    ),
    ("deepseekv3", ds3(("get_weather", '{"city": "Paris"}'), ("rm", "{}")), KEPT, []),  # a section is all or nothing
    ("deepseekv3", ds3(("get_weather", '{"city": }')), KEPT, []),
    ("deepseekv3", "4", KEPT, []),
    ("deepseekv3", ds3(("search", '{"query": "東京の天気 ☀ \\"quoted\\""}')), "", [TOKYO]),
    # DeepSeek-V3.1
    ("deepseekv31", "Let me check." + ds31(("get_weather", '{"city": "Paris"}')), "Let me check.", [PARIS]),
    (
        "deepseekv31",
        ds31(("get_weather", '{"city": "Paris"}'), ("search", '{"query": "louvre hours"}')),
        "",
        [PARIS, LOUVRE],
    ),
    ("deepseekv31", ds31(("rm", "{}")), KEPT, []),
    ("deepseekv31", ds31(("get_weather", '{"city": "Paris"')), KEPT, []),
    ("deepseekv31", "Paris is sunny.", KEPT, []),
    ("deepseekv31", ds31(("search", '{"query": "東京の天気 ☀ \\"quoted\\""}')), "", [TOKYO]),
    # Kimi-K2
    ("kimi_k2", "Let me check." + kimi(("get_weather", '{"city": "Paris"}')), "Let me check.", [PARIS]),
    (
        "kimi_k2",
        kimi(("get_weather", '{"city": "Paris"}'), ("search", '{"query": "louvre hours"}')),
        "",
        [PARIS, LOUVRE],
    ),
    ("kimi_k2", kimi(("rm", "{}")), KEPT, []),
    ("kimi_k2", kimi(("get_weather", "{city: Paris}")), KEPT, []),
    ("kimi_k2", "Paris is sunny.", KEPT, []),
    ("kimi_k2", kimi(("search", '{"query": "東京の天気 ☀ \\"quoted\\""}')), "", [TOKYO]),
    # Mistral: the JSON array (Nemo writes no space, v0.3 one), and NAME[ARGS]{...}
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
        "Sure.",
        [PARIS],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "search", "arguments": {"query": "louvre hours"}}]',
        "",
        [PARIS, LOUVRE],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"query": "louvre hours"}',
        "",
        [PARIS, LOUVRE],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "rm", "arguments": {}}]', KEPT, []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', KEPT, []),
    ("mistral", "See [1] and [TOOL", KEPT, []),
    ("mistral", '[TOOL_CALLS]search[ARGS]{"query": "東京の天気 ☀ \\"quoted\\""}', "", [TOKYO]),
    # Pythonic
    ("pythonic", 'Checking. [get_weather(city="Paris")]', "Checking.", [PARIS]),
    ("pythonic", '[get_weather(city="Paris"), search(query="louvre hours")]', "", [PARIS, LOUVRE]),
    ("pythonic", "[delete_all()]", KEPT, []),
    ("pythonic", "[get_weather(city=Paris)]", KEPT, []),  # a variable, not a literal
    ("pythonic", '[get_weather(city="Paris")', KEPT, []),
    ("pythonic", "See item [1] of the list [a, b].", KEPT, []),
    ("pythonic", '[search(query="東京の天気 ☀ \\"quoted\\"")]', "", [TOKYO]),
    (
        "pythonic",
        '[get_weather(city="a]b", days=2, tags=["x"], options={"k": None})]',
        "",
        [("get_weather", {"city": "a]b", "days": 2, "tags": ["x"], "options": {"k": None}})],
    ),
]


@pytest.mark.parametrize("name, reply, content, calls", CASES)
def test_tool_call_formats(name: str, reply: str, content: str, calls: list) -> None:
    got_content, got_calls = tool_call_parser(name).parse(reply, TOOLS)
    assert (got_content, calls_of(got_calls)) == (reply.strip() if content is KEPT else content, calls)


@pytest.mark.parametrize("name, reply", [(c[0], c[1]) for c in CASES])
def test_tool_call_streams_add_up_to_parse(name: str, reply: str) -> None:
    assert_stream_matches_parse(name, reply)
    assert_stream_matches_parse(name, "Intro text.\n\n" + reply + "\n\nOutro [x] <tool_ {\n")


def test_arguments_keep_unicode_and_ids_differ() -> None:
    _, calls = tool_call_parser("qwen25").parse(
        qwen("search", '{"query": "東京"}') + qwen("search", '{"query": "x"}'), TOOLS
    )
    assert calls[0]["function"]["arguments"] == '{"query": "東京"}' and calls[0]["id"] != calls[1]["id"]


def test_content_streams_before_a_possible_marker() -> None:
    stream = tool_call_parser("qwen25").stream(TOOLS)
    assert stream.feed("  Hello wor") == ("Hello wor", [])  # leading whitespace dropped
    assert stream.feed("ld <b> <tool_") == ("ld <b>", [])  # " <tool_" may be a marker
    assert stream.feed('call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_ca') == ("", [])
    text, calls = stream.feed("ll>\n")
    assert text == "" and calls_of(calls) == [PARIS]  # the delta that closes the block brings the call
    assert stream.feed("Bye  ") == (" Bye", [])  # held whitespace comes back before more text
    assert stream.finish() == ("", [])  # trailing whitespace is stripped


def test_unclosed_block_comes_back_as_content_at_finish() -> None:
    stream = tool_call_parser("kimi_k2").stream(TOOLS)
    assert stream.feed("Hi <|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0") == ("Hi", [])
    assert stream.finish() == (" <|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0", [])


def test_llama_calls_come_at_finish_and_indices_count_across_the_stream() -> None:
    stream = tool_call_parser("llama3").stream(TOOLS)
    assert stream.feed('{"name": "get_time", "parameters": {}}') == ("", [])
    _, calls = stream.finish()
    assert calls_of(calls) == [("get_time", {})]
    stream = tool_call_parser("mistral").stream(TOOLS)
    first = stream.feed("[TOOL_CALLS]get_time[ARGS]{} ")[1]
    second = stream.feed("[TOOL_CALLS]get_time[ARGS]{}")[1]
    assert [c["index"] for c in first + second] == [0, 1]


def test_without_tools_nothing_is_a_call() -> None:
    reply = qwen("get_weather", '{"city": "Paris"}')
    assert tool_call_parser("qwen25").parse(reply, []) == (reply, [])
    assert tool_call_parser("qwen25").parse(reply, [None, {}, {"function": None}, {"function": {"name": 3}}]) == (
        reply,
        [],
    )  # type: ignore[list-item]


# Fragments of every format, so that random replies hit markers, partial markers and near misses.
FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "\n",
    " ",
    "{",
    "}",
    "[",
    "]",
    '"name": ',
    '"get_weather"',
    '"search"',
    ", ",
    '"arguments": ',
    '"parameters": ',
    '{"city": "Paris"}',
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    ";",
    "<function=get_weather>",
    "</function>",
    "<parameter=city>",
    "</parameter>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "get_weather",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
    "function",
    "```json",
    "```",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "functions.get_weather:0",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
    "get_weather(",
    'city="Paris"',
    ")",
    "<tool_",
    "<|tool",
    "[TOOL",
    "\\",
    '"',
    "'",
    "é",
    "<think>",
    "</think>",
    "<th",
    "[THINK]",
    "[/THINK]",
    "◁think▷",
    "◁/think▷",
]
replies = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)), max_size=25).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply=replies, seed=st.integers(0, 2**16))
def test_any_text_streams_like_parse_and_never_raises(reply: str, seed: int) -> None:
    for cls in set(TOOL_CALL_PARSERS.values()):
        parser = cls()
        content, calls = parser.parse(reply, TOOLS)
        for chunks in (list(reply), chunkings(reply, range(seed, seed + 1))[-1]):
            got_content, got_calls = streamed(parser.stream(TOOLS), chunks)
            assert got_content == content and [c["function"] for c in got_calls] == [c["function"] for c in calls]
            assert [c["index"] for c in got_calls] == list(range(len(calls)))
        assert content == content.strip()


# ---- reasoning --------------------------------------------------------------------------------------

REASONING_CASES = [
    # (parser, reply, in_reasoning, reasoning, content)
    (
        "qwen3",
        "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.",
        False,
        "Let me add 2 and 2.",
        "The answer is 4.",
    ),
    ("qwen3", "<think>\nStill thinking about", False, "Still thinking about", ""),  # truncated: all reasoning
    ("qwen3", "Let me add.\n</think>\n\nIt is 4.\n", True, "Let me add.", "It is 4.\n"),  # the prompt opened <think>
    ("qwen3", "It is 4.", False, None, "It is 4."),
    ("qwen3", "<think>\n\n</think>\n\nIt is 4.", False, None, "It is 4."),  # an empty block is no reasoning
    (
        "qwen3",
        "<think>I should look it up.\n<tool_call>\n{}\n</tool_call>",
        False,
        "I should look it up.",
        "<tool_call>\n{}\n</tool_call>",
    ),
    ("qwen3", "Hmm.\n<tool_call>\n{}\n</tool_call>", True, "Hmm.", "<tool_call>\n{}\n</tool_call>"),
    ("qwen3", "  <think>  spaced  </think>  out  ", False, "spaced", "out  "),
    (
        "qwen3",
        "Hello <think>x</think>",
        False,
        None,
        "Hello <think>x</think>",
    ),  # only the start of a reply opens reasoning
    ("qwen3", "<think>a</think>b<think>c</think>", False, "a", "b<think>c</think>"),
    ("qwen3", "<think>x</thi", False, "x</thi", ""),
    ("qwen3", "<thi", False, None, "<thi"),
    ("qwen3-thinking", "Plan.</think>Done.", False, "Plan.", "Done."),
    ("deepseek-r1", "Plan.</think>Done.", False, "Plan.", "Done."),
    ("deepseek-r1", "<think>\nPlan.\n</think>\n\nDone.", False, "Plan.", "Done."),  # R1-0528 writes <think> itself
    ("deepseek-r1", "Plan.<tool_call>", False, "Plan.<tool_call>", ""),  # no tool marker ends R1's reasoning
    ("step3", "Plan.</think>Done.", False, "Plan.", "Done."),
    ("deepseek-v3", "Plan.</think>Done.", True, "Plan.", "Done."),
    ("deepseek-v3", "Done.", False, None, "Done."),
    ("glm45", "\n<think>Plan.</think>\nDone.", False, "Plan.", "Done."),
    ("glm45", "<think>Plan.\n<tool_call>get_time\n</tool_call>", False, "Plan.", "<tool_call>get_time\n</tool_call>"),
    ("kimi", "◁think▷Plan.◁/think▷Done.", False, "Plan.", "Done."),
    ("kimi", "<think>Plan.</think>Done.", False, None, "<think>Plan.</think>Done."),
    ("kimi_k2", "<think>Plan.</think>Done.", False, "Plan.", "Done."),
    ("kimi_k2", "<think>Plan.<|tool_calls_section_begin|>x", False, "Plan.", "<|tool_calls_section_begin|>x"),
    ("mistral", "[THINK]Plan.[/THINK]Done.", False, "Plan.", "Done."),
    ("mistral", "Done.", False, None, "Done."),
]


def streamed_reasoning(stream, chunks: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in chunks:
        r, c = stream.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("name, reply, in_reasoning, reasoning, content", REASONING_CASES)
def test_reasoning_formats(name: str, reply: str, in_reasoning: bool, reasoning: str | None, content: str) -> None:
    parser = reasoning_parser(name)
    assert parser.parse(reply, in_reasoning) == (reasoning, content)
    for chunks in chunkings(reply):
        assert streamed_reasoning(parser.stream(in_reasoning), chunks) == (reasoning or "", content), chunks


def test_reasoning_streams_as_it_comes() -> None:
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("\n<thi") == ("", "")
    assert stream.feed("nk>\nFirst, ") == ("First,", "")  # trailing whitespace waits
    assert stream.feed("add.\n</th") == (" add.", "")  # "</th" may be the end marker
    assert stream.feed("ink>\n\nIt is") == ("", "It is")
    assert stream.feed(" 4. ") == ("", " 4. ")
    assert stream.finish() == ("", "")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply=replies, seed=st.integers(0, 2**16), in_reasoning=st.booleans())
def test_any_text_streams_like_reasoning_parse(reply: str, seed: int, in_reasoning: bool) -> None:
    for cls in set(REASONING_PARSERS.values()):
        parser = cls()
        reasoning, content = parser.parse(reply, in_reasoning)
        assert reasoning is None or reasoning == reasoning.strip() != ""
        assert content == content.lstrip()
        for chunks in (list(reply), chunkings(reply, range(seed, seed + 1))[-1]):
            assert streamed_reasoning(parser.stream(in_reasoning), chunks) == (reasoning or "", content)


# ---- names and detection ----------------------------------------------------------------------------


def test_sglang_names() -> None:
    assert set(TOOL_CALL_PARSERS) == {
        "qwen25",
        "qwen",
        "hermes",
        "qwen3_coder",
        "llama3",
        "deepseekv3",
        "deepseekv31",
        "glm45",
        "glm",
        "kimi_k2",
        "mistral",
        "pythonic",
    }
    assert set(REASONING_PARSERS) == {
        "qwen3",
        "qwen3-thinking",
        "deepseek-r1",
        "deepseek-v3",
        "glm45",
        "kimi",
        "kimi_k2",
        "step3",
        "mistral",
    }
    assert all(name in cls.names for name, cls in TOOL_CALL_PARSERS.items())
    assert REASONING_PARSERS["qwen3-thinking"].always_reasoning and not REASONING_PARSERS["qwen3"].always_reasoning


def test_unknown_names_raise_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'qwen2'.*deepseekv31.*qwen25"):
        tool_call_parser("qwen2")
    with pytest.raises(ValueError, match=r"'r1'.*deepseek-r1.*qwen3"):
        reasoning_parser("r1")


DETECTION = [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen25", None),
    ("Qwen-Qwen3-0.6B.jinja", "qwen25", "qwen3"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "qwen25", None),
    ("Qwen3-Coder.jinja", "qwen3_coder", None),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3", None),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3", None),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseekv31", "deepseek-v3"),
    ("deepseek-ai-DeepSeek-V3.1-hf.jinja", "deepseekv31", "deepseek-v3"),
    ("deepseek-v3-sglang-tool.jinja", "deepseekv3", None),
    ("GLM-4.6.jinja", "glm45", "glm45"),
    ("moonshotai-Kimi-K2.jinja", "kimi_k2", None),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", None),
    ("openai-gpt-oss-120b.jinja", None, None),  # harmony channels: not supported
]


@pytest.mark.parametrize("template, tools, reasoning", DETECTION)
def test_detection_from_real_templates(template: str, tools: str | None, reasoning: str | None) -> None:
    text = (TEMPLATES / template).read_text()
    assert (detect_tool_call_parser(text), detect_reasoning_parser(text)) == (tools, reasoning)


def test_every_fixture_template_is_covered() -> None:
    assert {t for t, _, _ in DETECTION} == {p.name for p in TEMPLATES.glob("*.jinja")}


def test_detection_of_inline_templates() -> None:
    deepseek_v3 = (
        "{%- for tool in message['tool_calls'] %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'"
        " + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
        "{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{{'<｜Assistant｜><think>\\n'}}"
    )
    assert (detect_tool_call_parser(deepseek_v3), detect_reasoning_parser(deepseek_v3)) == ("deepseekv3", "deepseek-r1")
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert (detect_tool_call_parser(plain), detect_reasoning_parser(plain)) == (None, None)
    assert detect_tool_call_parser("Respond as [func_name1(params_name1=params_value1)]. {{ messages }}") == "pythonic"
    assert detect_reasoning_parser("[SYSTEM_PROMPT][THINK]...[/THINK]") == "mistral"
    assert detect_reasoning_parser("<|im_assistant|>assistant<|im_middle|><think>") == "kimi_k2"
