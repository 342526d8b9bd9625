"""`ModelFormat`: everything a model family decides about chat, in one object per model.

The engine builds one for the model it serves, the rollout process one for the run's model; both
render prompts with the same `ChatTemplate`, stop on the same end tokens and split replies with
the same parsers, so `/v1/chat/completions`, `ctx.chat` and the agent gateway agree.

Parsers are chosen by SGLang's names (`--tool-call-parser`, `--reasoning-parser`; the same keys in
the run config). Not given, they are detected from the chat template; "none" turns one off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from slimish.formats.reasoning import ReasoningParser, detect_reasoning_parser, reasoning_parser
from slimish.formats.template import ChatTemplate, end_token_ids
from slimish.formats.tokens import ChatTokens
from slimish.formats.tool_parsers import ToolCallParser, detect_tool_call_parser, tool_call_parser

OFF = "none"


@dataclass
class ParsedReply:
    """A model reply split as OpenAI's chat message wants it."""

    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation (null fields left out)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class ReplyStream:
    """A reply parsed as it is generated: reasoning first, then tool calls in the rest. The
    parts of all deltas add up to what `ModelFormat.reply` gives for the whole text."""

    def __init__(self, fmt: "ModelFormat", prompt: list[int], tools: list[dict] | None, reasoning: bool) -> None:
        self._reasoning = fmt.reasoning.stream(fmt.opens_reasoning(prompt)) if fmt.reasoning and reasoning else None
        self._tools = fmt.tools.stream(tools) if fmt.tools and tools else None

    def feed(self, delta: str, last: bool = False) -> ParsedReply:
        """The parts of `delta` that can be shown now; with `last`, everything held back too."""
        reasoning, content = self._reasoning.feed(delta) if self._reasoning else ("", delta)
        if last and self._reasoning:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[dict[str, Any]] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if last:
                rest, more = self._tools.finish()
                content, calls = content + rest, calls + more
        return ParsedReply(content, reasoning or None, calls)


class ModelFormat:
    """A model's chat template, end tokens, tool-call parser and reasoning parser."""

    def __init__(
        self,
        tokenizer: Any,
        model_path: str | None = None,
        tool_call_parser_name: str | None = None,
        reasoning_parser_name: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.end_ids = end_token_ids(tokenizer, model_path)
        self._template: ChatTemplate | None = None
        source = getattr(tokenizer, "chat_template", None) or ""
        self.tool_call_parser = _resolve(tool_call_parser_name, detect_tool_call_parser(source) if source else None)
        self.reasoning_parser = _resolve(reasoning_parser_name, detect_reasoning_parser(source) if source else None)
        self.tools: ToolCallParser | None = tool_call_parser(self.tool_call_parser) if self.tool_call_parser else None
        self.reasoning: ReasoningParser | None = (
            reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
        )
        self._chats: dict[str, ChatTokens] = {}

    @property
    def template(self) -> ChatTemplate:
        """Built on first use: a model served only by token ids needs no chat template."""
        if self._template is None:
            self._template = ChatTemplate(self.tokenizer)
        return self._template

    def parses(self, tools: list[dict] | None, reasoning: bool = True) -> bool:
        """Whether a reply to a request offering `tools` (and splitting reasoning) is parsed: then
        markers that are special tokens must stay in its text (`skip_special_tokens` false)."""
        return (self.tools is not None and bool(tools)) or (self.reasoning is not None and reasoning)

    def chat(self, tools: list[dict] | None = None, **kwargs: Any) -> ChatTokens:
        """The token-space renderer for a tool list and template kwargs, built once (building one renders the template)."""
        key = json.dumps([tools, kwargs], sort_keys=True, default=str)
        if key not in self._chats:
            self._chats[key] = ChatTokens(self.template, self.end_ids, tools, **kwargs)
        return self._chats[key]

    def prompt_ids(self, prompt: str | list[dict[str, Any]], chat: ChatTokens | None = None) -> list[int]:
        """A sample's prompt ids: chat messages through the template (with the generation prompt),
        text as is. Rollouts and the SFT warm start both render prompts here, so they agree."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return (chat or self.chat()).prompt_ids(prompt)

    def opens_reasoning(self, prompt: list[int]) -> bool:
        """Whether the reply to `prompt` starts inside reasoning: the generation prompt opened the
        block (DeepSeek-V3.1 with `thinking`), or the parser's model always starts that way."""
        if self.reasoning is None:
            return False
        if self.reasoning.always_reasoning:
            return True
        tail = self.tokenizer.decode(prompt[-32:], skip_special_tokens=False)
        i = tail.rfind(self.reasoning.start)
        return i >= 0 and tail.find(self.reasoning.end, i) < 0

    def reply(self, text: str, prompt: list[int], tools: list[dict] | None, reasoning: bool = True) -> ParsedReply:
        """A whole reply: reasoning split out (unless `reasoning` is False: SGLang's
        `separate_reasoning`), then tool calls parsed from the rest when the request offered tools."""
        split = self.reasoning is not None and reasoning
        thought, content = self.reasoning.parse(text, self.opens_reasoning(prompt)) if split else (None, text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None and tools:
            content, calls = self.tools.parse(content, tools)
        return ParsedReply(content, thought, calls)

    def reply_stream(self, prompt: list[int], tools: list[dict] | None, reasoning: bool = True) -> ReplyStream:
        return ReplyStream(self, prompt, tools, reasoning)


def _resolve(name: str | None, detected: str | None) -> str | None:
    if name is None:
        return detected
    return None if name == OFF else name
