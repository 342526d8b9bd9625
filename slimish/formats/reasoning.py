"""Reasoning parsers, selected by SGLang's `--reasoning-parser` names.

Reasoning models think between two markers (`<think>` ... `</think>`) before they answer; the
OpenAI API returns the thinking as `reasoning_content`. Families differ only in their markers,
in whether a reply always starts inside reasoning, and in which tool-call marker ends reasoning
(Qwen3, GLM and Kimi-K2 may call a tool without closing their thinking, as SGLang knows), so a
parser is a few class attributes.

Where the reply starts inside reasoning because the prompt opened it (the generation prompt ends
with `<think>`), the caller says so with `in_reasoning`: the prompt, not the reply, knows.

Reasoning opens only at the start of a reply; after it closes, everything is content (a later
`<think>` is text). Reasoning is stripped and content left-stripped, as the Qwen3 and GLM templates
re-render `reasoning_content.strip()` and `content.lstrip()`, so a parsed turn renders back the
same. `parse` is the stream fed the whole reply at once, so the two cannot disagree.
"""

from __future__ import annotations

from typing import ClassVar

from slimish.formats.tool_parsers import by_name, marker_tail


class ReasoningParser:
    """A `<think>` ... `</think>` family; subclasses change the class attributes."""

    names: ClassVar[tuple[str, ...]] = ()
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    always_reasoning: ClassVar[bool] = False  # replies begin inside reasoning whatever the prompt
    tool_start: ClassVar[str | None] = None  # a tool-call marker that ends reasoning (the call belongs to the content)

    def parse(self, text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
        """(reasoning_content or None when there is none, content)."""
        stream = self.stream(in_reasoning)
        reasoning, content = stream.feed(text)
        more, rest = stream.finish()
        return (reasoning + more) or None, content + rest

    def stream(self, in_reasoning: bool = False) -> ReasoningStream:
        return ReasoningStream(self, in_reasoning or self.always_reasoning)


class ReasoningStream:
    """A reply read as it is generated: text is released as soon as no marker can change where it goes."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.parser, self.in_reasoning = parser, in_reasoning
        self.state = "start"  # -> "reasoning" -> "content"
        self.buf = ""  # text not yet released: a possible marker
        self.ws = ""  # trailing whitespace of the reasoning, held back: dropped if the reasoning ends here
        self.reasoning_started = self.content_started = False

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta)."""
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end of generation: the held-back rest (an unclosed reasoning block stays reasoning)."""
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        p = self.parser
        while self.buf:
            if self.state == "start":  # a start marker may open the reply (also when the prompt already did)
                self.buf = self.buf.lstrip()  # leading whitespace is stripped wherever it goes
                if not self.buf or (not final and p.start.startswith(self.buf) and self.buf != p.start):
                    break  # wait: the marker may still be coming
                opened = self.buf.startswith(p.start)
                self.buf = self.buf.removeprefix(p.start)
                self.state = "reasoning" if opened or self.in_reasoning else "content"
            elif self.state == "reasoning":
                stops = [p.end] + ([p.tool_start] if p.tool_start else [])
                found = [(i, stop) for stop in stops if (i := self.buf.find(stop)) >= 0]
                if found:
                    i, stop = min(found)
                    reasoning.append(self._reasoning(self.buf[:i]))
                    self.ws = ""  # the reasoning is stripped
                    self.buf = self.buf[i + len(p.end) :] if stop == p.end else self.buf[i:]  # a tool call is content
                    self.state = "content"
                    continue
                keep = 0 if final else marker_tail(self.buf, *stops)
                reasoning.append(self._reasoning(self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
                break
            else:
                if not self.content_started:
                    self.buf = self.buf.lstrip()
                    self.content_started = bool(self.buf)
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def _reasoning(self, text: str) -> str:
        """`text` as it can be released, given that the whole reasoning is stripped."""
        text = self.ws + (text if self.reasoning_started else text.lstrip())
        released = text.rstrip()
        self.ws = text[len(released) :]
        self.reasoning_started = self.reasoning_started or bool(released)
        return released


class Qwen3ReasoningParser(ReasoningParser):
    names = ("qwen3",)
    tool_start = "<tool_call>"


class Qwen3ThinkingReasoningParser(Qwen3ReasoningParser):
    """Qwen3-*-Thinking-2507: the template opens `<think>` in every prompt."""

    names = ("qwen3-thinking",)
    always_reasoning = True


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and Step-3) think from the first token; R1-0528 still writes `<think>` first."""

    names = ("deepseek-r1", "step3")
    always_reasoning = True


class DeepSeekV3ReasoningParser(ReasoningParser):
    """DeepSeek-V3.1: the prompt opens `<think>` when the `thinking=True` template kwarg asks for it,
    and closes it (`<think></think>`) otherwise, so the reply has reasoning only when `in_reasoning`."""

    names = ("deepseek-v3",)


class Glm45ReasoningParser(ReasoningParser):
    names = ("glm45",)
    tool_start = "<tool_call>"


class KimiReasoningParser(ReasoningParser):
    """Kimi-VL-Thinking and Kimi-k1.5."""

    names = ("kimi",)
    start, end = "◁think▷", "◁/think▷"


class KimiK2ReasoningParser(ReasoningParser):
    names = ("kimi_k2",)
    tool_start = "<|tool_calls_section_begin|>"


class MistralReasoningParser(ReasoningParser):
    """Magistral and Mistral-Small reasoning (`reasoning_effort`)."""

    names = ("mistral",)
    start, end = "[THINK]", "[/THINK]"


PARSER_CLASSES: tuple[type[ReasoningParser], ...] = (
    Qwen3ReasoningParser,
    Qwen3ThinkingReasoningParser,
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Glm45ReasoningParser,
    KimiReasoningParser,
    KimiK2ReasoningParser,
    MistralReasoningParser,
)
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {name: cls for cls in PARSER_CLASSES for name in cls.names}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser SGLang's `--reasoning-parser NAME` selects."""
    return by_name("reasoning parser", REASONING_PARSERS, name)


def detect_reasoning_parser(chat_template: str) -> str | None:
    """The SGLang parser name for a chat template, None if its model does not reason (or gpt-oss,
    whose harmony channels are not supported)."""
    if "[THINK]" in chat_template:
        return "mistral"
    if "◁think▷" in chat_template:
        return "kimi"
    if "<think>" not in chat_template:
        return None
    if "<｜Assistant｜>" in chat_template:  # DeepSeek: V3.1 switches thinking with a kwarg, R1 always thinks
        return "deepseek-v3" if "thinking" in chat_template else "deepseek-r1"
    if "<arg_key>" in chat_template or "[gMASK]" in chat_template:
        return "glm45"
    if "<|im_assistant|>" in chat_template:
        return "kimi_k2"
    return "qwen3"
