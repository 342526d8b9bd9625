"""Tools and `tool_choice` for every protocol: one normalisation of tools, forced tool calls by
constrained decoding in the model family's own call syntax (SGLang's way), and the `max_tokens` rule.

- `normalize_tools`: OpenAI Chat function tools are the canonical form; Responses' flat function
  tools and Anthropic's `input_schema` tools become the same dicts (`function_tool`), so one tool
  renders to the same prompt tokens whatever the protocol.
- `forced_tool`: OpenAI's `tool_choice` ("required", or a named function) checked against the
  tools with SGLang's messages (sglang 0.5.23: python/sglang/srt/entrypoints/openai/serving_chat.py:1144).
- `tool_call_constraint`: the sampling-param grammar that makes the reply one call, written the
  way the family's template writes it (markers, JSON or XML arguments), with arguments valid
  against the tool's JSON schema. As SGLang's `get_structure_constraint` (sglang 0.5.23:
  python/sglang/srt/function_call/function_call_parser.py:324), it is an xgrammar structural tag;
  unlike SGLang's legacy tags, markers that are one token of the model's vocabulary are bound to
  that token, so a forced reply has the token ids the model itself writes (an RL sample must).
  `forcing_fields` fills in a `ModelFormat`'s markers and reasoning.
- `clamp_max_tokens`: the one rule for a reply's length on the engine's OpenAI route and the gateway.

Plain dicts only: the gateway builds these in the rollout process, which never imports the engine
or xgrammar (the engine compiles the structural tag).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slimish.formats.tool_parsers import tool_call_parser
from slimish.protocol import GRAMMAR_FIELDS

if TYPE_CHECKING:
    from slimish.formats.model import ModelFormat

Format = dict[str, Any]  # one xgrammar structural-tag format ({"type": ..., ...})


class ToolChoiceError(ValueError):
    """A `tool_choice` (or `tools`) that cannot be honoured; `field` names the request field (a 400)."""

    def __init__(self, message: str, field: str = "tool_choice") -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# ---- tools ---------------------------------------------------------------------------------------


def function_tool(
    name: Any, parameters: Any = None, description: Any = None, strict: Any = None, field: str = "tools"
) -> dict[str, Any]:
    """One tool in the canonical (OpenAI Chat) form. Only what was given is kept: a field left out
    renders as left out, so the same tool gives the same prompt whichever protocol sent it."""
    if not isinstance(name, str) or not name:
        raise ToolChoiceError("every function tool needs a non-empty string name", field)
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolChoiceError(f"the parameters of tool {name!r} must be a JSON-schema object", field)
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None, field: str = "tools") -> list[dict[str, Any]]:
    """Tools as OpenAI Chat function tools, whichever protocol's shape each is in: Chat's
    `{"type": "function", "function": {...}}`, Responses' flat `{"type": "function", "name", ...}`,
    Anthropic's `{"name", "input_schema", ...}`. Names must be unique (the call names the tool)."""
    out = []
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            raise ToolChoiceError("every tool must be an object", field)
        if isinstance(tool.get("function"), Mapping):
            fn = tool["function"]
            args = (fn.get("name"), fn.get("parameters"), fn.get("description"), fn.get("strict"))
        elif tool.get("type", "function") == "function" and "input_schema" not in tool:
            args = (tool.get("name"), tool.get("parameters"), tool.get("description"), tool.get("strict"))
        elif "input_schema" in tool or tool.get("type") == "custom":
            args = (tool.get("name"), tool.get("input_schema"), tool.get("description"), tool.get("strict"))
        else:
            raise ToolChoiceError(f"tool type {tool.get('type')!r} is not supported (function tools only)", field)
        out.append(function_tool(*args, field=field))
    names = [t["function"]["name"] for t in out]
    if len(names) != len(set(names)):
        raise ToolChoiceError(f"tool names must be unique, got {names}", field)
    return out


# ---- tool_choice ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForcedTool:
    """The reply must be a call to one of `names` ("required": every offered tool; a named
    function: that one)."""

    names: tuple[str, ...]


def forced_tool(
    tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None, field: str = "tool_choice"
) -> ForcedTool | None:
    """OpenAI Chat's `tool_choice` read: None when nothing is forced ("auto", "none", absent).
    `tools` are canonical (`normalize_tools`). Protocols with their own spelling (Responses,
    Anthropic) translate to "required" or a name and pass their field's name."""
    names = tuple(t["function"]["name"] for t in tools or ())
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if isinstance(tool_choice, str) and tool_choice.lower() == "required":
        if not names:
            raise ToolChoiceError("Tools cannot be empty if tool choice is set to required.", field)
        return ForcedTool(names)
    name = _named(tool_choice)
    if name is None:
        raise ToolChoiceError(
            f'expected "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
            field,
        )
    if not names:
        raise ToolChoiceError("Tools cannot be empty if tool choice is set to a specific tool.", field)
    if name not in names:
        raise ToolChoiceError(f"Tool '{name}' not found in tools list.", field)
    return ForcedTool((name,))


def _named(choice: Any) -> str | None:
    """The name in `{"type": "function", "function": {"name"}}` (Chat) or `{"type": "function", "name"}` (Responses)."""
    if not isinstance(choice, Mapping) or choice.get("type") != "function":
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
    return name if isinstance(name, str) and name else None


# ---- the constraint ------------------------------------------------------------------------------


def _const(text: str) -> Format:
    return {"type": "const_string", "value": text}


def _seq(*elements: Format) -> Format:
    return {"type": "sequence", "elements": list(elements)}


def _or(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _schema(parameters: Any) -> Format:
    """JSON valid against `parameters`, with at most one whitespace character between its tokens:
    templates write `json.dumps`-style JSON, and unbounded whitespace lets a sampled reply run to
    its length limit in blanks (SGLang has `--constrained-json-disable-any-whitespace` for this)."""
    schema = parameters if parameters else {"type": "object"}
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def _is_string(schema: Any) -> bool:
    """A property the XML formats write as bare text (as the parsers read it back: `_typed`)."""
    kind = schema.get("type") if isinstance(schema, dict) else "string"
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _text_value(schema: Any, end: str) -> Format:
    """A string written bare, up to `end`: one of its `enum`/`const`, its `pattern`, or any text
    without `end` (xgrammar's XML styles also allow whitespace around a value, which the parsers
    keep in a string: a value must be exactly what the schema allows)."""
    schema = schema if isinstance(schema, dict) else {}
    options = [o for o in schema.get("enum", [schema["const"]] if "const" in schema else []) if isinstance(o, str)]
    if options:
        return _or([_const(o) for o in options])
    if "pattern" in schema:  # the whole value matches it (xgrammar's regexes are anchored)
        return {"type": "regex", "pattern": schema["pattern"].removeprefix("^").removesuffix("$")}
    if "minLength" in schema or "maxLength" in schema:
        return {"type": "regex", "pattern": f"[^<]{{{schema.get('minLength', 0)},{schema.get('maxLength', '')}}}"}
    return {"type": "any_text", "excludes": [end]}


def _arguments(parameters: Any, pair: Callable[[str, Format, bool], Format], value: Callable[[Any], Format]) -> Format:
    """Keyword arguments written one by one (XML, pythonic): required properties first, in order,
    then the optional ones, each left out or given. `pair(key, value, first)` writes one."""
    props = (parameters or {}).get("properties") or {}
    required = [k for k in (parameters or {}).get("required", []) if k in props]
    optional = [k for k in props if k not in required]
    elements = [pair(k, value(props[k]), i == 0) for i, k in enumerate(required)]
    if required:
        elements += [{"type": "optional", "content": pair(k, value(props[k]), False)} for k in optional]
    elif optional:  # the first one given is the first written
        firsts = [
            _seq(
                pair(k, value(props[k]), True),
                *({"type": "optional", "content": pair(o, value(props[o]), False)} for o in optional[i + 1 :]),
            )
            for i, k in enumerate(optional)
        ]
        elements = [{"type": "optional", "content": _or(firsts)}]
    return _seq(*elements) if elements else {"type": "regex", "pattern": ""}


def _python_value(schema: Any) -> Format:
    """A Python literal: JSON's, with booleans and null spelled as Python's."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "boolean":
        return _or([_const("True"), _const("False")])
    if kind == "null":
        return _const("None")
    return _schema(schema)


def _xml(key_open: str, key_close: str, end: str) -> Callable[[Any], Format]:
    """Qwen3-Coder's and GLM's arguments: `key_open KEY key_close VALUE end` per argument, a
    string bare, anything else JSON (as their templates write them)."""

    def pair(key: str, value: Format, first: bool) -> Format:
        return _seq(_const(key_open + key + key_close), value, _const(end))

    def value(schema: Any) -> Format:
        return _text_value(schema, end.strip()) if _is_string(schema) else _schema(schema)

    return lambda parameters: _arguments(parameters, pair, value)


def _pythonic(parameters: Any) -> Format:
    return _arguments(parameters, lambda k, v, first: _seq(_const(("" if first else ", ") + k + "="), v), _python_value)


_QWEN_XML = _xml("<parameter=", ">\n", "\n</parameter>\n")
_GLM_XML = _xml("<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n")

# One call per family, as its template writes it (the parsers in tool_parsers.py read them back):
# (name, parameters) -> the pieces of the call; a str is literal text (markers in it become tokens).
_Pieces = Callable[[str, Any], list["str | Format"]]
_CALLS: dict[str, _Pieces] = {
    "qwen25": lambda n, p: [
        '<tool_call>\n{"name": ' + json.dumps(n) + ', "arguments": ',
        _schema(p),
        "}\n</tool_call>",
    ],
    "qwen3_coder": lambda n, p: [f"<tool_call>\n<function={n}>\n", _QWEN_XML(p), "</function>\n</tool_call>"],
    "glm45": lambda n, p: [f"<tool_call>{n}\n", _GLM_XML(p), "</tool_call>"],
    "deepseekv3": lambda n, p: [
        f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n",
        _schema(p),
        "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ],
    "deepseekv31": lambda n, p: [
        f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{n}<｜tool▁sep｜>",
        _schema(p),
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ],
    "kimi_k2": lambda n, p: [
        f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{n}:0<|tool_call_argument_begin|>",
        _schema(p),
        "<|tool_call_end|><|tool_calls_section_end|>",
    ],
    "mistral": lambda n, p: ['[TOOL_CALLS][{"name": ' + json.dumps(n) + ', "arguments": ', _schema(p), "}]"],
    "llama3": lambda n, p: ['{"name": ' + json.dumps(n) + ', "parameters": ', _schema(p), "}"],
    "pythonic": lambda n, p: [f"[{n}(", _pythonic(p), ")]"],
}
_CALLS.update(qwen=_CALLS["qwen25"], hermes=_CALLS["qwen25"], glm=_CALLS["glm45"])
# What an argument may not contain: the markers that end a call's parts, where the parser looks for them.
_CLOSES: dict[str, list[str]] = {
    "qwen25": ["</tool_call>"],
    "qwen3_coder": ["</parameter>", "</function>", "</tool_call>"],
    "glm45": ["</arg_value>", "</tool_call>"],
    "deepseekv3": ["<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"],
    "deepseekv31": ["<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"],
    "kimi_k2": ["<|tool_call_end|>", "<|tool_calls_section_end|>"],
}
_CLOSES.update(qwen=_CLOSES["qwen25"], hermes=_CLOSES["qwen25"], glm=_CLOSES["glm45"])


def _literal(text: str, markers: Mapping[str, int]) -> list[Format]:
    """`text` as const strings, with each marker that is one token of the model as that token."""
    out: list[Format] = []
    while text:
        found = [(text.find(m), m) for m in markers if m in text]
        if not found:
            out.append(_const(text))
            break
        at, marker = min(found, key=lambda f: (f[0], -len(f[1])))
        if at:
            out.append(_const(text[:at]))
        out.append({"type": "token", "token": markers[marker]})
        text = text[at + len(marker) :]
    return out


def _bind(fmt: Format, markers: Mapping[str, int], closes: list[str]) -> Format:
    """`fmt` with every marker in its literal text held to the marker's token, and `closes` kept
    out of its free text (JSON strings, bare values)."""
    if fmt["type"] == "const_string":
        parts = _literal(fmt["value"], markers)
        return parts[0] if len(parts) == 1 else _seq(*parts)
    if fmt["type"] == "json_schema" and any(k in json.dumps(fmt["json_schema"]) for k in ("minLength", "maxLength")):
        return fmt  # xgrammar drops a string's length bounds where it filters the string: the schema wins
    if fmt["type"] in ("json_schema", "any_text") and closes:
        return {**fmt, "excludes": list(dict.fromkeys([*fmt.get("excludes", []), *closes]))}
    if "elements" in fmt:
        return {**fmt, "elements": [_bind(e, markers, closes) for e in fmt["elements"]]}
    if fmt["type"] == "optional":
        return {**fmt, "content": _bind(fmt["content"], markers, closes)}
    return fmt


def tool_call_constraint(
    parser_name: str,
    tools: Sequence[Mapping[str, Any]],
    forced: ForcedTool,
    markers: Mapping[str, int] | None = None,
    reasoning: tuple[str, str] | None = None,
    in_reasoning: bool = False,
) -> dict[str, str]:
    """The sampling-param fields (`{"structural_tag": ...}`) that make the reply one call to a tool
    of `forced`, in the syntax of the `parser_name` family, arguments valid against its schema.

    `markers`: marker text -> token id, for the markers that are single tokens of the model (see
    `forcing_fields`). `reasoning`: the family's (start, end) reasoning markers: a reply may think
    first (a reasoning block, or reasoning the prompt opened when `in_reasoning`), then calls."""
    if parser_name not in _CALLS:
        raise ToolChoiceError(f"forcing a tool is not supported for the {parser_name!r} tool-call format")
    call = _CALLS[parser_name]
    params = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    calls = _or([_seq(*(_const(p) if isinstance(p, str) else p for p in call(n, params[n]))) for n in forced.names])
    fmt = calls = _bind(calls, markers or {}, _CLOSES.get(parser_name, []))
    if reasoning is not None:  # thinking first, as the reasoning parser reads it (the newlines templates write)
        start, end = reasoning
        # No call marker inside the thinking: Qwen3's and GLM's reasoning ends at one.
        think = {"type": "any_text", "excludes": [start, end, tool_call_parser(parser_name).open]}
        thought = _bind(_seq(think, _const(end), {"type": "regex", "pattern": r"\n{0,2}"}), markers or {}, [])
        opened = _bind(_seq({"type": "regex", "pattern": r"\n?"}, _const(start)), markers or {}, [])
        fmt = _seq(thought, calls) if in_reasoning else _or([calls, _seq(opened, thought, calls)])
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)}


def marker_tokens(tokenizer: Any, parser_name: str, extra: Sequence[str] = ()) -> dict[str, int]:
    """The markers of the family's call syntax (and `extra`, e.g. reasoning markers) that are one
    added token of `tokenizer`: marker text -> id."""
    probe = {"properties": {"k": {"type": "string"}}, "required": ["k"]}  # a call with an argument: every marker
    text = json.dumps([_CALLS[parser_name]("f", probe) if parser_name in _CALLS else [], *extra], ensure_ascii=False)
    return {tok: i for tok, i in tokenizer.get_added_vocab().items() if len(tok) > 1 and tok in text}


def forcing_fields(
    fmt: ModelFormat, prompt: list[int], tools: Sequence[Mapping[str, Any]], forced: ForcedTool
) -> dict[str, str]:
    """`tool_call_constraint` for a model's format and a prompt (which may have opened reasoning)."""
    if fmt.tool_call_parser is None:
        raise ToolChoiceError("forcing a tool needs a tool-call parser; this model's chat template has none")
    reasoning = (fmt.reasoning.start, fmt.reasoning.end) if fmt.reasoning is not None else None
    markers = marker_tokens(fmt.tokenizer, fmt.tool_call_parser, reasoning or ())
    opened = fmt.opens_reasoning(prompt)
    return tool_call_constraint(fmt.tool_call_parser, tools, forced, markers, reasoning, opened)


def json_answer_fields(fmt: ModelFormat, prompt: list[int], json_schema: str) -> dict[str, str]:
    """A structured answer's grammar (`json_schema` text). Where the prompt opened the model's
    reasoning, the JSON from the first token would be read back as reasoning, so the reasoning
    goes first, free, to its end marker, then the JSON; elsewhere the JSON is the whole reply."""
    if fmt.reasoning is None or not fmt.opens_reasoning(prompt):
        return {"json_schema": json_schema}
    end = fmt.reasoning.end
    markers = marker_tokens(fmt.tokenizer, fmt.tool_call_parser or "", (fmt.reasoning.start, end))
    thought = _bind(_seq({"type": "any_text", "excludes": [end]}, _const(end)), markers, [])
    answer = _seq(thought, {"type": "regex", "pattern": r"\n{0,2}"}, _schema(json.loads(json_schema)))
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": answer}, ensure_ascii=False)}


def check_forced_alone(forced: ForcedTool | None, sampling: Mapping[str, Any], structured: str) -> None:
    """Forcing a tool is itself a grammar: a request that also asks for structured output
    (`structured`: the protocol's name for it) is refused naming `tool_choice`, as SGLang does."""
    if forced is not None and any(sampling.get(name) is not None for name in GRAMMAR_FIELDS):
        raise ToolChoiceError(f"forcing a tool cannot be combined with {structured}")


# ---- max_tokens ----------------------------------------------------------------------------------


def clamp_max_tokens(
    requested: int | None, prompt_len: int, context_len: int, cap: int | None = None, field: str = "max_tokens"
) -> int:
    """How many tokens a reply may have: what was asked (None: as many as fit), clamped to the room
    the prompt leaves in the context, and to `cap` (a rollout's `rollout.max_new_tokens`) when given.
    Clamping, not refusing: SDKs send large defaults (pydantic-ai's Anthropic model: 16384) that
    mean "up to the limit". A prompt that leaves no room is an error naming `field`."""
    room = context_len - prompt_len
    if room < 1:
        raise ToolChoiceError(
            f"the prompt ({prompt_len} tokens) leaves no room for a reply in the model's context length ({context_len} tokens)",
            field,
        )
    if requested is not None and requested < 1:
        raise ToolChoiceError(f"must be at least 1, got {requested}", field)
    limits = [room] + ([requested] if requested is not None else []) + ([cap] if cap is not None else [])
    return min(limits)
