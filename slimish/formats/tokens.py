"""Token-exact multi-turn chat: the ids that continue a conversation after the model's own output.

A multi-turn sample is the model's output ids with the environment's turns (tool results, user
replies) spliced in between. Re-tokenising the whole conversation each turn would not give the
model's ids back (a tokenizer may split the same text differently, templates rewrite past turns,
e.g. drop reasoning), so only the environment's part is rendered: `env_ids` returns the ids that,
appended after the model's output, make the context read as the chat template renders the new
messages and the next generation prompt.

How: render a fixed dummy conversation ending with an assistant turn, followed by the new messages
and the generation prompt, twice, with two different dummy assistant contents. Everything after the
content is common to both renderings: the token that closes the assistant turn, then the new turns,
then the generation prompt. That common suffix is the answer, without its first token when the
model already emitted it. Comparing two renderings rather than taking "full minus base" also works
for templates that render the last assistant turn differently from earlier ones (Qwen3 adds an
empty think block to the last one only).

Two kinds of templates:
- a turn closed by its own token (`<|im_end|>`, `<|eot_id|>`, `<｜end▁of▁sentence｜>`): a model
  that stopped on any of its end tokens (Qwen's `<|endoftext|>`, Llama's `<|eom_id|>` too) has
  closed the turn itself; otherwise the template's close comes first, mask 0;
- a turn closed by the next turn's opener (GLM: no closing token; the model stops on
  `<|observation|>` or `<|user|>`): when the model's stop token is the opener the template renders
  next, it is the model's token (mask 1) and the environment's ids start after it.
"""

from __future__ import annotations

import json
from typing import Any

from slimish.formats.template import ChatTemplate, TemplateError

# The dummy conversation the new messages are rendered after; only its assistant content varies.
_DUMMY_USER = {"role": "user", "content": "Hi"}
_DUMMY_CONTENTS = ("A", "B")
HISTORY_POLICIES = ("exact", "template")


class ChatTokens:
    """A chat template rendered in token space, for one tool list and one set of template kwargs:
    first prompts, the environment's ids between model turns, and a model turn's own ids."""

    def __init__(
        self, template: ChatTemplate, end_ids: list[int], tools: list[dict] | None = None, **kwargs: Any
    ) -> None:
        self.template, self.tokenizer = template, template.tokenizer
        self.end_ids = set(end_ids)
        self.tools = tools or None
        self.kwargs = kwargs
        self._special = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
        }
        # The template's own close of an assistant turn, or None where the next turn's opener closes it.
        after = self._after_assistant([], add_generation_prompt=False)
        self.close_id = after[0] if after and after[0] in self._special else None
        if self.close_id is None:
            opener = self._after_assistant([_DUMMY_USER], add_generation_prompt=True)[0]
            if opener not in self._special:
                raise TemplateError(
                    f"chat template: assistant turns end with token {opener} ({self.tokenizer.convert_ids_to_tokens(opener)!r}), "
                    "not a special token; a model cannot signal the end of its turn with it",
                    "model",
                )

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """The template's ids for `messages` (tools and template kwargs as given at construction)."""
        return self.template.render(messages, self.tools, add_generation_prompt, **self.kwargs)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first turn's prompt: `messages` and the generation prompt."""
        if not messages:
            raise TemplateError("messages: need at least one message to render a prompt")
        return self.render(messages, add_generation_prompt=True)

    def env_ids(self, new_messages: list[dict[str, Any]], last_token: int | None) -> list[int]:
        """Ids to append after the model's last output id `last_token` (None: it wrote nothing):
        what the template renders between an assistant turn's content and the next generation
        prompt's end, less the token the model already wrote to end its turn."""
        suffix = self._after_assistant(new_messages, add_generation_prompt=True)
        if self.close_id is None:  # closed by the next turn's opener: the model's stop token, if it is that one
            return suffix[1:] if last_token == suffix[0] else suffix
        if suffix[0] != self.close_id:
            raise TemplateError(
                f"chat template: after the new messages {[m.get('role') for m in new_messages]} the assistant turn "
                f"is no longer closed by token {self.close_id}; the template renders earlier assistant turns "
                "differently and env_ids cannot be token-exact for it"
            )
        return suffix[1:] if last_token in self.end_ids or last_token == self.close_id else suffix

    def assistant_ids(
        self, history: list[dict[str, Any]], message: dict[str, Any], following: dict[str, Any] | None = None
    ) -> list[int]:
        """The ids of `message` as the model writes them after the prompt of `history`, up to and
        including the token that ends the turn: the template's close, or, where the next turn's
        opener closes it, the opener of `following` (default: a user turn). A demonstration's
        target for SFT; what a model that follows the template generates."""
        turn = self._turn(history, message)
        if self.close_id is None:
            return turn + self._after_assistant([following or _DUMMY_USER], add_generation_prompt=True)[:1]
        ends = [i for i, t in enumerate(turn) if t == self.close_id or t in self.end_ids]  # Llama's <|eom_id|> too
        return turn[: ends[0] + 1] if ends else turn + [self.close_id]

    def _turn(self, history: list[dict[str, Any]], message: dict[str, Any]) -> list[int]:
        """What the template renders for `message` after its generation prompt. Some templates
        render the history before it differently once it is no longer last (Hermes 3 adds a
        newline after the last tool result, SGLang's DeepSeek-V3 one after the tool outputs,
        DeepSeek-V3.1 writes `</think>` where its thinking prompt wrote `<think>`): then the turn
        starts after the last occurrence of the generation prompt, or where the two diverge."""
        prompt = self.render(history, add_generation_prompt=True)
        full = self.render([*history, message], add_generation_prompt=False)
        if full[: len(prompt)] == prompt:
            return full[len(prompt) :]
        base = self.render(history, add_generation_prompt=False)
        common = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
        opener = prompt[len(base) :] if prompt[: len(base)] == base else []
        starts = [
            i for i in range(len(full) - len(opener), common - 1, -1) if opener and full[i : i + len(opener)] == opener
        ]
        return full[starts[0] + len(opener) :] if starts else full[common:]

    def _after_assistant(self, new_messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """What the template renders after a dummy assistant turn's content: the common suffix."""
        a, b = (
            self.render([_DUMMY_USER, {"role": "assistant", "content": c}, *new_messages], add_generation_prompt)
            for c in _DUMMY_CONTENTS
        )
        n = 0
        while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
            n += 1
        if n == 0 and (new_messages or add_generation_prompt):
            raise TemplateError(
                "chat template: nothing follows an assistant turn's content, so its end cannot be found", "model"
            )
        return a[len(a) - n :]


def same_message(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a message an agent sent back is one already in the conversation. An assistant
    message counts as the same when its content (None and "" alike) and its calls' names and
    arguments (JSON string or object alike) are; the ids, reasoning and other fields the SDK or the
    agent adds or drops do not count: the tokens behind it are the model's either way."""
    if sent.get("role") != kept.get("role"):
        return False
    if sent.get("role") != "assistant":
        return {k: v for k, v in sent.items() if v is not None} == {k: v for k, v in kept.items() if v is not None}
    return _assistant_key(sent) == _assistant_key(kept)


def _assistant_key(message: dict[str, Any]) -> tuple[str, list[tuple[Any, Any]]]:
    calls = []
    for call in message.get("tool_calls") or []:
        fn = (call.get("function") if isinstance(call, dict) else None) or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append((fn.get("name"), args))
    return (message.get("content") or "").strip(), calls
