"""ChatTokens: a conversation built turn by turn in token space equals the template's rendering."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from slimish.rollout.chat import ChatTokens

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]  # fmt: skip


def call(expression: str) -> dict:
    """An OpenAI tool call: `arguments` is a JSON string."""
    return {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}


def decoded(message: dict) -> dict:
    calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls} if calls else message


# Three assistant turns: two tool calls, then the answer. Each entry: what comes before the turn.
OPENING = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is (2+3)*4?"}]
TURNS = [
    ({"role": "assistant", "content": "", "tool_calls": [call("2+3")]}, [{"role": "tool", "content": "5"}]),
    ({"role": "assistant", "content": "Now multiply.", "tool_calls": [call("5*4")]}, [{"role": "tool", "content": "20"}]),
    ({"role": "assistant", "content": "The answer is \\boxed{20}."}, [{"role": "user", "content": "Thanks! And 1+1?"}]),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tok(request, tiny_model_dir, tiny_qwen2_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir if request.param == "llama" else tiny_qwen2_dir)


def model_turn(chat: ChatTokens, history: list[dict], assistant: dict) -> list[int]:
    """The assistant turn as the template tokenises it, up to and including its end-of-turn token:
    what a model that follows the template would output."""
    before = chat.render(history, add_generation_prompt=True)
    after = chat.render([*history, assistant], add_generation_prompt=False)
    assert after[: len(before)] == before
    turn = after[len(before) :]
    return turn[: turn.index(chat.end_of_turn_id) + 1]


def test_end_of_turn_is_im_end(tok):
    assert ChatTokens(tok).end_of_turn_id == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_three_tool_turns_equal_the_template(tok, tools):
    chat = ChatTokens(tok, tools=tools)
    history = list(OPENING)
    ids = chat.prompt_ids(history)
    assert ids == tok.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    for assistant, env in TURNS:
        ids += model_turn(chat, history, assistant)
        ids += chat.env_ids(env, ended_with_eos=True)
        history += [assistant, *env]
    assert ids == chat.render(history, add_generation_prompt=True)
    # and against HF itself, given the arguments as objects (what the engine's normalisation does)
    assert ids == tok.apply_chat_template([decoded(m) for m in history], tools=tools, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)  # fmt: skip


def test_turn_without_eos_is_closed_by_env_ids(tok):
    """A turn cut by a stop string or max tokens: env_ids starts by closing it (mask 0 for the caller)."""
    chat = ChatTokens(tok, tools=TOOLS)
    assistant, env = TURNS[0]
    turn = model_turn(chat, OPENING, assistant)
    closed = chat.env_ids(env, ended_with_eos=False)
    assert closed[0] == chat.end_of_turn_id and closed[1:] == chat.env_ids(env, ended_with_eos=True)
    full = chat.prompt_ids(OPENING) + turn[:-1] + closed
    assert full == chat.render([*OPENING, assistant, *env], add_generation_prompt=True)


def test_empty_new_messages_open_a_new_assistant_turn(tok):
    chat = ChatTokens(tok)
    assert tok.decode(chat.env_ids([], ended_with_eos=True)) == "\n<|im_start|>assistant\n"


def test_template_that_rewrites_the_last_assistant_turn(tok):
    """Qwen3-like: only the last assistant turn gets an empty think block, so "base + new" is not an
    extension of "base"; the suffix after the turn is still what the template renders."""
    think = tok.chat_template.replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
        "{{- '<|im_start|>' + message.role + '\\n' + ('<think></think>' if message.role == 'assistant' and loop.last else '')"
        " + message.content + '<|im_end|>' + '\\n' }}",
    )
    assert think != tok.chat_template
    chat = ChatTokens(tok, chat_template=think)
    env = [{"role": "user", "content": "more"}]
    history = [*OPENING, {"role": "assistant", "content": "ok"}]
    full = chat.render([*history, *env], add_generation_prompt=True)
    assert full[: len(chat.render(history, False))] != chat.render(history, False)  # the naive prefix fails
    ids = chat.env_ids(env, ended_with_eos=True)
    assert full[-len(ids) :] == ids and full[-len(ids) - 1] == chat.end_of_turn_id


def test_template_without_special_end_of_turn_is_refused(tok):
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    with pytest.raises(ValueError, match="not a special token"):
        ChatTokens(tok, chat_template=plain)
