"""Tool-call parsers, selected by SGLang's `--tool-call-parser` names.

Each model family writes a tool call its own way; this module turns a reply back into OpenAI's
`(content, tool_calls)`. Every format is a block of text that a marker opens: `<tool_call>`,
`[TOOL_CALLS]`, `<|python_tag|>`... A format says where its block ends and what calls its body
holds; the rest (streaming, whitespace, call ids and validation) is shared, so that adding a
family is a few lines.

Unlike SGLang, a block that does not parse, or that names a tool the request did not offer,
stays in the content: no model output is silently lost (an RL sample must show what the model
wrote). A block is all or nothing: one bad call keeps the whole block as text.

`parse` is the stream fed the whole reply at once, so streamed and non-streamed replies cannot
disagree: the content deltas add up to `parse`'s content and the calls to its calls.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")
Call = tuple[Any, Any]  # (name, arguments) as a format reads them; checked before they become a call
# What a format's reading raises on a body that is not a call (json, ast, and plain checks).
NOT_A_CALL = (ValueError, TypeError, KeyError, SyntaxError, RecursionError, MemoryError)


class ToolCallParser:
    """One model family's tool-call format: a block opened by `open` and closed by `close`.

    Subclasses set the markers and read one block's body into calls (`_calls`); formats whose
    block ends by its own syntax (a JSON value, a bracket, the end of the reply) override
    `_block_end`.
    """

    names: ClassVar[tuple[str, ...]] = ()
    open: ClassVar[str] = ""
    close: ClassVar[str] = ""

    def parse(self, text: str, tools: Sequence[dict]) -> tuple[str, list[dict]]:
        """(content, calls). `tools` are OpenAI tool dicts ({"type": "function", "function": {"name", "parameters"}})."""
        stream = self.stream(tools)
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        return content + rest, calls + more

    def stream(self, tools: Sequence[dict]) -> ToolCallStream:
        return ToolCallStream(self, tools)

    def _find_open(self, text: str, at_start: bool) -> int:
        """Where the next block opens in `text` (-1: nowhere); `at_start`: `text` begins the reply."""
        return text.find(self.open)

    def _block_end(self, block: str, final: bool) -> int | None:
        """How long the block at the start of `block` is; None while it has not ended (`final`: no more text comes)."""
        end = block.find(self.close, len(self.open))
        return None if end < 0 else end + len(self.close)

    def _calls(self, body: str, tools: dict[str, dict]) -> list[Call]:
        """The calls in a block's body (between the markers). `tools`: name -> parameter properties.
        Raises one of NOT_A_CALL when the body is not a call."""
        raise NotImplementedError


class ToolCallStream:
    """A reply read as it is generated: content is released as soon as no marker can change it."""

    def __init__(self, parser: ToolCallParser, tools: Sequence[dict]) -> None:
        self.parser, self.tools = parser, _properties_by_name(tools)
        self.buf = ""  # text not yet released: a possible marker, or an open block
        self.at_start = True  # nothing but whitespace seen yet
        self.in_block = False  # `buf` starts with a block that has not ended yet
        self.skip_ws = True  # drop whitespace: at the start, and after a parsed block (the newline between calls)
        self.ws = ""  # trailing whitespace of the content, held back: it is dropped if the reply ends here
        self.count = 0

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """Content that can be shown now (never to be taken back), and the calls completed by this delta."""
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """At the end of generation: the rest (held-back text, or a call block that never closed, as content)."""
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, list[dict]]:
        content: list[str] = []
        calls: list[dict] = []
        if self.at_start:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return "", []
        while self.buf:
            start = 0 if self.in_block else self.parser._find_open(self.buf, self.at_start)
            self.at_start = False
            if start < 0:
                keep = 0 if final else marker_tail(self.buf, self.parser.open)
                content.append(self._content(self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
                break
            content.append(self._content(self.buf[:start]))
            self.buf = self.buf[start:]
            end = self.parser._block_end(self.buf, final)
            self.in_block = end is None
            if end is None:
                if final:  # a block that never closed is text
                    content.append(self._content(self.buf))
                    self.buf = ""
                break
            block, self.buf = self.buf[:end], self.buf[end:]
            taken = self._take(block)
            if taken is None:
                content.append(self._content(block))
            else:
                calls += taken
                self.skip_ws = True
        return "".join(content), calls

    def _content(self, text: str) -> str:
        """`text` as it can be released, given that the whole content is stripped."""
        if self.skip_ws:
            text = text.lstrip()
            if not text:
                return ""
            self.skip_ws = False
        text = self.ws + text
        released = text.rstrip()
        self.ws = text[len(released) :]
        return released

    def _take(self, block: str) -> list[dict] | None:
        """The block's OpenAI calls, or None when it stays text."""
        body = block.removeprefix(self.parser.open).removesuffix(self.parser.close)
        try:
            with warnings.catch_warnings():  # ast warns about odd escapes in model-written strings
                warnings.simplefilter("ignore")
                found = self.parser._calls(body, self.tools)
            checked = [self._check(name, args) for name, args in found]
        except NOT_A_CALL:
            return None
        if not checked:
            return None
        calls = []
        for name, arguments in checked:
            fn = {"name": name, "arguments": arguments}
            calls.append(
                {"id": f"call_{uuid.uuid4().hex[:24]}", "index": self.count, "type": "function", "function": fn}
            )
            self.count += 1
        return calls

    def _check(self, name: Any, args: Any) -> tuple[str, str]:
        if not isinstance(name, str) or name not in self.tools:
            raise ValueError(f"not a tool of this request: {name!r}")
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
        return name, json.dumps(args, ensure_ascii=False, allow_nan=False)  # TypeError for sets, bytes...


def marker_tail(text: str, *markers: str) -> int:
    """Length of the longest end of `text` that may be the start of one of `markers` (to hold back)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _properties_by_name(tools: Sequence[dict]) -> dict[str, dict]:
    """Tool name -> its parameters' JSON-schema `properties` (types the XML formats' values)."""
    out: dict[str, dict] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


# ---- shared readers ------------------------------------------------------------------------------


def _json_calls(value: Any) -> list[Call]:
    """`{"name", "arguments"}` objects (one, or a list of them); Llama writes "parameters"."""
    objs = value if isinstance(value, list) else [value]
    if not all(isinstance(o, dict) for o in objs):
        raise ValueError("a call is a JSON object")
    return [(o.get("name"), o["arguments"] if "arguments" in o else o.get("parameters", {})) for o in objs]


def _sequence(pattern: re.Pattern[str], text: str) -> list[tuple[str, ...]]:
    """The groups of each match, when `text` is nothing but matches of `pattern` and whitespace."""
    found, pos = [], 0
    for m in pattern.finditer(text):
        if text[pos : m.start()].strip():
            raise ValueError("unexpected text between the parts of a call")
        found.append(m.groups())
        pos = m.end()
    if text[pos:].strip():
        raise ValueError("unexpected text after the parts of a call")
    return found


def _typed(value: str, schema: Any) -> Any:
    """A value the XML formats write as text, typed by its JSON schema as SGLang does: strings
    (and parameters the schema does not declare) stay text; anything else is read as JSON, then
    as a Python literal (Qwen3-Coder's template writes `True`), and stays text if neither works."""
    kind = schema.get("type") if isinstance(schema, dict) else "string"
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    for load in (json.loads, ast.literal_eval):
        try:
            parsed = load(value)
            json.dumps(parsed, allow_nan=False)  # sets, bytes, NaN... are no JSON
            return parsed
        except NOT_A_CALL:
            pass
    return value


def _python_call(node: ast.expr) -> Call:
    """`f(a=1)` (pythonic) or `tool.call(a=1)` (Llama's built-in tools): keyword arguments, literals only."""
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("a call with keyword arguments only")
    fn = node.func.value if isinstance(node.func, ast.Attribute) and node.func.attr == "call" else node.func
    if not isinstance(fn, ast.Name) or any(k.arg is None for k in node.keywords):
        raise ValueError("not a plain function call")
    return fn.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}


# ---- formats -------------------------------------------------------------------------------------


class Qwen25Parser(ToolCallParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, once per call (Qwen2.5, Qwen3, Hermes)."""

    names = ("qwen25", "qwen", "hermes")
    open, close = "<tool_call>", "</tool_call>"

    def _calls(self, body: str, tools: dict[str, dict]) -> list[Call]:
        return _json_calls(json.loads(body))


class Qwen3CoderParser(ToolCallParser):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`."""

    names = ("qwen3_coder",)
    open, close = "<tool_call>", "</tool_call>"
    FUNCTION = re.compile(r"\s*<function=([^>]*)>(.*)</function>\s*", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)

    def _calls(self, body: str, tools: dict[str, dict]) -> list[Call]:
        fn = self.FUNCTION.fullmatch(body)
        if fn is None:
            raise ValueError("no <function=...>")
        name = fn.group(1).strip()
        props, args = tools.get(name, {}), {}
        for key, value in _sequence(self.PARAMETER, fn.group(2)):
            # The template writes each value between newlines: `<parameter=k>\nVALUE\n</parameter>`.
            args[key.strip()] = _typed(value.removeprefix("\n").removesuffix("\n"), props.get(key.strip()))
        return [(name, args)]


class Glm45Parser(ToolCallParser):
    """`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>` (GLM-4.5/4.6)."""

    names = ("glm45", "glm")
    open, close = "<tool_call>", "</tool_call>"
    ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _calls(self, body: str, tools: dict[str, dict]) -> list[Call]:
        split = body.find("<arg_key>") if "<arg_key>" in body else len(body)
        name = body[:split].strip()
        props = tools.get(name, {})
        # The template writes strings as they are and everything else as JSON.
        return [(name, {k.strip(): _typed(v, props.get(k.strip())) for k, v in _sequence(self.ARG, body[split:])})]


class _Sectioned(ToolCallParser):
    """A section (`open` ... `close`) of calls, each `item_open` ... `item_close` (DeepSeek, Kimi);
    `ITEM` reads one call's text into its name (group 1) and JSON arguments (group 2)."""

    item_open: ClassVar[str]
    item_close: ClassVar[str]
    ITEM: ClassVar[re.Pattern[str]]

    def _calls(self, body: str, tools: dict[str, dict]) -> list[Call]:
        item = re.compile(re.escape(self.item_open) + "(.*?)" + re.escape(self.item_close), re.DOTALL)
        return [self._item(text) for (text,) in _sequence(item, body)]

    def _item(self, text: str) -> Call:
        m = self.ITEM.fullmatch(text)
        if m is None:
            raise ValueError(f"not a {type(self).__name__} call")
        return m.group(1).strip(), json.loads(m.group(2))


class DeepSeekV3Parser(_Sectioned):
    """DeepSeek-V3 and R1: `<｜tool▁calls▁begin｜>`, then per call
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`."""

    names = ("deepseekv3",)
    open, close = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    item_open, item_close = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    ITEM = re.compile(r"\s*function<｜tool▁sep｜>([^\n]+)\n```json\n(.*)\n```\s*", re.DOTALL)


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1: V3's markers, each call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""

    names = ("deepseekv31",)
    ITEM = re.compile(r"(.*?)<｜tool▁sep｜>(.*)", re.DOTALL)


class KimiK2Parser(_Sectioned):
    """Kimi-K2: `<|tool_calls_section_begin|>`, then per call
    `<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>`, then `<|tool_calls_section_end|>`."""

    names = ("kimi_k2",)
    open, close = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    item_open, item_close = "<|tool_call_begin|>", "<|tool_call_end|>"
    ITEM = re.compile(r"\s*(?:functions\.)?(.+?):\d+\s*<\|tool_call_argument_begin\|>(.*)", re.DOTALL)


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral-7B-v0.3, Nemo) or
    `[TOOL_CALLS]NAME[ARGS]{...}` (newer templates), once per call."""

    names = ("mistral",)
    open = "[TOOL_CALLS]"

    def _block_end(self, block: str, final: bool) -> int | None:
        start = len(self.open)
        if not block[start:].lstrip().startswith("["):  # the NAME[ARGS]{...} form
            args = block.find("[ARGS]", start)
            if args < 0:
                return None
            start = args + len("[ARGS]")
        return _json_end(block, start)

    def _calls(self, body: str, tools: dict[str, dict]) -> list[Call]:
        name, sep, args = body.partition("[ARGS]")
        if body.lstrip().startswith("[") or not sep:
            return _json_calls(json.loads(body))
        return [(name.strip(), json.loads(args))]


def _json_end(text: str, start: int) -> int | None:
    """End of the JSON object or array at `start` (after whitespace); None while it is incomplete
    (or not JSON: then it never ends, and the text stays content)."""
    pos = len(text) - len(text[start:].lstrip())
    if text[pos : pos + 1] not in ("{", "["):  # a number's end is never certain while text still comes
        return None
    try:
        return json.JSONDecoder().raw_decode(text, pos)[1]
    except (ValueError, RecursionError):
        return None


class Llama3Parser(ToolCallParser):
    """Llama 3.x: `{"name": ..., "parameters": {...}}` as the whole reply, or after `<|python_tag|>`;
    several separated by `;`. After `<|python_tag|>` also Llama 3.1's built-in tools, `brave_search.call(query="...")`.

    The block runs to the end of the reply (the model stops after a call), so calls come with `finish`.
    """

    names = ("llama3",)
    open = "<|python_tag|>"

    def _find_open(self, text: str, at_start: bool) -> int:
        return 0 if at_start and text.startswith("{") else text.find(self.open)

    def _block_end(self, block: str, final: bool) -> int | None:
        return len(block) if final else None

    def _calls(self, body: str, tools: dict[str, dict]) -> list[Call]:
        body = body.strip()
        if not body.startswith("{"):
            return [_python_call(ast.parse(body, mode="eval").body)]
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(body):
            value, pos = decoder.raw_decode(body, pos)
            calls += _json_calls(value)
            rest = body[pos:].lstrip()
            if rest and not rest.startswith(";"):
                raise ValueError("calls are separated by ';'")
            pos = len(body) - len(rest.removeprefix(";").lstrip())
        return calls


class PythonicParser(ToolCallParser):
    """`[get_weather(city="Paris"), get_time()]` (Llama 4, Llama 3.2 with a pythonic prompt): Python
    literals only, read with `ast`, never evaluated. Any `[` may open one, so text after a `[`
    waits for its `]`."""

    names = ("pythonic",)
    open, close = "[", "]"

    # A bracket, or a string literal (unclosed ones run to the end): brackets inside strings do not count.
    TOKEN = re.compile(r"""\[|\]|"[^"\\]*(?:\\.[^"\\]*)*"?|'[^'\\]*(?:\\.[^'\\]*)*'?""", re.DOTALL)

    def _block_end(self, block: str, final: bool) -> int | None:
        depth = 0
        for token in self.TOKEN.finditer(block):
            depth += {"[": 1, "]": -1}.get(token.group(), 0)
            if depth == 0:
                return token.end()
        return None

    def _calls(self, body: str, tools: dict[str, dict]) -> list[Call]:
        node = ast.parse(body, mode="eval").body  # "f(), g()" is a tuple; "f()" a call
        return [_python_call(n) for n in (node.elts if isinstance(node, ast.Tuple) else [node])]


PARSER_CLASSES: tuple[type[ToolCallParser], ...] = (
    Qwen25Parser,
    Qwen3CoderParser,
    Glm45Parser,
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    KimiK2Parser,
    MistralParser,
    Llama3Parser,
    PythonicParser,
)
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {name: cls for cls in PARSER_CLASSES for name in cls.names}


def by_name(kind: str, registry: dict[str, type[T]], name: str) -> T:
    """A new parser of the class `registry` holds under SGLang's name `name`."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]()


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser SGLang's `--tool-call-parser NAME` selects."""
    return by_name("tool-call parser", TOOL_CALL_PARSERS, name)


# Most specific first: Qwen3-Coder's and GLM's templates also write `<tool_call>`.
_TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qwen3_coder", ("<tool_call>", "<function=")),
    ("glm45", ("<tool_call>", "<arg_key>")),
    ("deepseekv3", ("<｜tool▁calls▁begin｜>", "```json")),
    ("deepseekv31", ("<｜tool▁calls▁begin｜>",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("qwen25", ("<tool_call>",)),  # Qwen2.5, Qwen3, Hermes
    ("pythonic", ("[func_name1(",)),  # the instruction in Llama 4's (and pythonic Llama 3.2) templates
    ("llama3", ("<|python_tag|>",)),  # Llama 3.1
    ("llama3", ("<|start_header_id|>", '"parameters": ')),  # Llama 3.2: no python tag, JSON calls only
)


def detect_tool_call_parser(chat_template: str) -> str | None:
    """The SGLang parser name for a chat template, None if it has no tool calls we read.

    gpt-oss is None: its harmony format (`<|channel|>commentary to=functions.NAME`) is not supported.
    """
    for name, markers in _TEMPLATE_MARKERS:
        if all(m in chat_template for m in markers):
            return name
    return None
