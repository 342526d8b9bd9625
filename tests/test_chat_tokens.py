"""ChatTokens: a conversation built turn by turn in token space equals the template's rendering.

The tiny tokenizers carry a Qwen2.5-style ChatML template; small templates written here cover the
other shapes (a turn closed by the next turn's opener, arguments concatenated as a string). The
real templates of each model family are tested in tests/test_family_formats.py.
"""

from __future__ import annotations

import json

import pytest
from helpers import TOOLS
from transformers import AutoTokenizer

from slimish.formats.model import ModelFormat
from slimish.formats.template import ChatTemplate, TemplateError, end_token_ids
from slimish.formats.tokens import ChatTokens, same_message


def call(expression: str) -> dict:
    """An OpenAI tool call: `arguments` is a JSON string."""
    return {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }


def decoded(message: dict) -> dict:
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in message.get("tool_calls", [])
    ]
    return {**message, "tool_calls": calls} if calls else message


# Three assistant turns: two tool calls, then the answer. Each entry: what comes before the turn.
OPENING = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is (2+3)*4?"}]
TURNS = [
    ({"role": "assistant", "content": "", "tool_calls": [call("2+3")]}, [{"role": "tool", "content": "5"}]),
    (
        {"role": "assistant", "content": "Now multiply.", "tool_calls": [call("5*4")]},
        [{"role": "tool", "content": "20"}],
    ),
    ({"role": "assistant", "content": "The answer is \\boxed{20}."}, [{"role": "user", "content": "Thanks! And 1+1?"}]),
]
# A template whose assistant turn has no closing token: the next turn's opener ends it (GLM's shape).
OPENER_CLOSED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tok(request, tiny_model_dir, tiny_qwen2_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir if request.param == "llama" else tiny_qwen2_dir)


def with_template(tok, template: str):
    other = AutoTokenizer.from_pretrained(tok.name_or_path)
    other.chat_template = template
    return other


def model_turn(chat: ChatTokens, history: list[dict], assistant: dict) -> list[int]:
    """The assistant turn as the template tokenises it, up to and including its closing token:
    what a model that follows the template would output."""
    before = chat.render(history, add_generation_prompt=True)
    after = chat.render([*history, assistant], add_generation_prompt=False)
    assert after[: len(before)] == before
    turn = after[len(before) :]
    return turn[: turn.index(chat.close_id) + 1]


def test_close_is_im_end_and_end_tokens_come_from_the_generation_config(tok):
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert ModelFormat(tok).chat().close_id == im_end
    assert end_token_ids(tok) == [im_end, endoftext]  # generation_config.json's list, the tokenizer's EOS already in it


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_three_tool_turns_equal_the_template(tok, tools):
    chat = ModelFormat(tok).chat(tools)
    history = list(OPENING)
    ids = chat.prompt_ids(history)
    assert ids == tok.apply_chat_template(
        history, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for assistant, env in TURNS:
        turn = model_turn(chat, history, assistant)
        ids += turn + chat.env_ids(env, last_token=turn[-1])
        history += [assistant, *env]
    assert ids == chat.render(history, add_generation_prompt=True)
    # and against HF itself, given the arguments as objects (what this template's `tojson` wants)
    assert ids == tok.apply_chat_template(
        [decoded(m) for m in history], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_turn_without_a_stop_token_is_closed_by_env_ids(tok):
    """A turn cut by a stop string or max tokens: env_ids starts by closing it (mask 0 for the caller)."""
    chat = ModelFormat(tok).chat(TOOLS)
    assistant, env = TURNS[0]
    turn = model_turn(chat, OPENING, assistant)
    closed = chat.env_ids(env, last_token=turn[-2])
    assert closed[0] == chat.close_id and closed[1:] == chat.env_ids(env, last_token=chat.close_id)
    full = chat.prompt_ids(OPENING) + turn[:-1] + closed
    assert full == chat.render([*OPENING, assistant, *env], add_generation_prompt=True)


def test_a_secondary_end_token_closes_the_turn(tok):
    """Stopping on `<|endoftext|>` (in generation_config's eos list) ends the turn as `<|im_end|>`
    would: the template's close is not added after it."""
    chat = ModelFormat(tok).chat()
    env = [{"role": "user", "content": "more"}]
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert chat.env_ids(env, last_token=endoftext) == chat.env_ids(env, last_token=chat.close_id)
    assert (
        tok.decode(chat.env_ids(env, last_token=endoftext))
        == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )


def test_empty_new_messages_open_a_new_assistant_turn(tok):
    chat = ModelFormat(tok).chat()
    assert tok.decode(chat.env_ids([], last_token=chat.close_id)) == "\n<|im_start|>assistant\n"


def test_template_that_rewrites_the_last_assistant_turn(tok):
    """Qwen3-like: only the last assistant turn gets an empty think block, so "base + new" is not an
    extension of "base"; the suffix after the turn is still what the template renders."""
    think = tok.chat_template.replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
        "{{- '<|im_start|>' + message.role + '\\n' + ('<think></think>' if message.role == 'assistant' and loop.last else '')"
        " + message.content + '<|im_end|>' + '\\n' }}",
    )
    assert think != tok.chat_template
    chat = ModelFormat(with_template(tok, think)).chat()
    env = [{"role": "user", "content": "more"}]
    history = [*OPENING, {"role": "assistant", "content": "ok"}]
    full = chat.render([*history, *env], add_generation_prompt=True)
    assert full[: len(chat.render(history, False))] != chat.render(history, False)  # the naive prefix fails
    ids = chat.env_ids(env, last_token=chat.close_id)
    assert full[-len(ids) :] == ids and full[-len(ids) - 1] == chat.close_id


def test_turn_closed_by_the_next_turns_opener(tok):
    """No closing token: the model stops on the opener of the turn that follows. When that is the
    opener the template renders next, it is the model's token; otherwise the whole suffix follows."""
    fmt = ModelFormat(with_template(tok, OPENER_CLOSED))
    chat = fmt.chat()
    opener = tok.convert_tokens_to_ids("<|im_start|>")
    assert chat.close_id is None
    env = [{"role": "user", "content": "more"}]
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "ok"}]
    prompt = chat.prompt_ids(history[:1])
    turn = chat.render(history, add_generation_prompt=False)[len(prompt) :] + [
        opener
    ]  # content, then the model stops on the opener
    ids = prompt + turn + chat.env_ids(env, last_token=opener)
    assert ids == chat.render([*history, *env], add_generation_prompt=True)
    assert chat.env_ids(env, last_token=turn[-2])[0] == opener  # cut off: the opener is the environment's
    assert chat.assistant_ids(history[:1], history[1]) == turn  # SFT's target ends on the opener


def test_arguments_take_the_form_the_template_renders_as_json(tok):
    """A template that concatenates `arguments` (DeepSeek-V3.1's shape) gets the JSON string; one
    that applies `tojson` gets the object: both render the call's JSON once."""
    concat = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name + ':' + c.function.arguments }}</tool_call>{% endfor %}"
        "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    history = [OPENING[1], TURNS[0][0]]
    as_string = ChatTemplate(with_template(tok, concat))
    assert as_string.arguments_form == "string"
    assert '<tool_call>calculator:{"expression": "2+3"}</tool_call>' in tok.decode(
        as_string.render(history, TOOLS, False)
    )
    as_object = ChatTemplate(tok)
    assert as_object.arguments_form == "object"
    assert '"arguments": {"expression": "2+3"}' in tok.decode(as_object.render(history, TOOLS, False))


def test_template_kwargs_that_are_call_arguments_are_refused(tok):
    with pytest.raises(TemplateError, match="chat_template_kwargs.tokenize: an argument of apply_chat_template"):
        ChatTemplate(tok).render(OPENING, tokenize=False)


def test_template_without_special_end_of_turn_is_refused(tok):
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    with pytest.raises(ValueError, match="not a special token"):
        ModelFormat(with_template(tok, plain)).chat()


def test_same_message_ignores_what_sdks_add_or_drop():
    ours = {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [call("2+3")]}
    echoed = {"role": "assistant", "content": None, "tool_calls": [{**call("2+3"), "id": "other"}], "refusal": None}
    assert same_message(echoed, ours)
    assert not same_message({**echoed, "content": "edited"}, ours)
    assert same_message({"role": "user", "content": "x", "name": None}, {"role": "user", "content": "x"})
