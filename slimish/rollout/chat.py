"""Token-exact multi-turn chat: the ids that continue a conversation after the model's own output.

A multi-turn sample is the model's output ids with the environment's turns (tool results, user
replies) spliced in between. Re-tokenising the whole conversation each turn would not give the
model's ids back (a tokenizer may split the same text differently, templates rewrite past turns,
e.g. drop reasoning), so only the environment's part is rendered: `env_ids` returns the ids that,
appended after the model's output, make the context read exactly as the chat template renders the
new messages and the next generation prompt.

How: render a fixed dummy conversation ending with an assistant turn, followed by the new messages
and the generation prompt, twice, with two different dummy assistant contents. Everything after the
content is common to both renderings: the end-of-turn token that closes the assistant turn, then
the new turns, then the generation prompt. That common suffix is the answer, without its first
token when the model already emitted it. Comparing two renderings rather than taking "full minus
base" also works for templates that render the last assistant turn differently from earlier ones
(Qwen3 adds an empty think block to the last one only).
"""

from __future__ import annotations

from typing import Any

from slimish.engine.openai_api import template_message

# The dummy conversation the new messages are rendered after; only its assistant content varies.
_DUMMY_USER = {"role": "user", "content": "Hi"}
_DUMMY_CONTENTS = ("A", "B")


class ChatTokens:
    """A tokenizer's chat template, rendered in token space for prompts and for later turns.

    Messages are normalised as the engine's OpenAI route does (null fields dropped, text parts
    joined, tool-call `arguments` JSON strings decoded), so a prompt rendered here equals the one
    `/v1/chat/completions` would render for the same body.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, **chat_template_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.chat_template_kwargs = chat_template_kwargs
        self.end_of_turn_id = self._end_of_turn_id()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """The template's ids for `messages` (tools and template kwargs as given at construction)."""
        normalised = [template_message(m, i) for i, m in enumerate(messages)]
        ids = self.tokenizer.apply_chat_template(
            normalised,
            tools=self.tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **self.chat_template_kwargs,
        )
        return list(ids)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first turn's prompt: `messages` and the generation prompt."""
        if not messages:
            raise ValueError("messages: need at least one message to render a prompt")
        return self.render(messages, add_generation_prompt=True)

    def env_ids(self, new_messages: list[dict[str, Any]], ended_with_eos: bool) -> list[int]:
        """Ids to append after the model's last output: the close of its turn (only when
        `ended_with_eos` is False, i.e. it stopped on a stop string or ran out of tokens), then
        `new_messages` (tool results, user turns) and the generation prompt, as the template
        renders them after an assistant turn."""
        suffix = self._after_assistant(new_messages, add_generation_prompt=True)
        if suffix[0] != self.end_of_turn_id:
            raise ValueError(
                f"chat template: after the new messages {[m.get('role') for m in new_messages]} the assistant turn "
                f"is no longer closed by end-of-turn token {self.end_of_turn_id}; the template renders earlier "
                "assistant turns differently and env_ids cannot be token-exact for it"
            )
        return suffix if not ended_with_eos else suffix[1:]

    def _after_assistant(self, new_messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """What the template renders after a dummy assistant turn's content: the common suffix."""
        a, b = (
            self.render([_DUMMY_USER, {"role": "assistant", "content": c}, *new_messages], add_generation_prompt)
            for c in _DUMMY_CONTENTS
        )
        n = 0
        while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
            n += 1
        if n == 0:
            raise ValueError("chat template: nothing follows an assistant turn's content, so the turn has no end-of-turn token")
        return a[-n:]

    def _end_of_turn_id(self) -> int:
        """The token the template closes an assistant turn with: what the model emits to stop."""
        eot = self._after_assistant([], add_generation_prompt=False)[0]
        special = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
        }
        if eot not in special:
            raise ValueError(
                f"chat template: assistant turns end with token {eot} ({self.tokenizer.convert_ids_to_tokens(eot)!r}), "
                "not a special token; a model cannot signal the end of its turn with it"
            )
        return eot


def render_prompt(tokenizer: Any, chat: ChatTokens, prompt: str | list[dict[str, Any]]) -> list[int]:
    """A sample's prompt ids: chat messages through the template (with the generation prompt),
    text as is. Rollouts and the SFT warm start both render prompts here, so they agree."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    return chat.prompt_ids(prompt)
