"""Chat rendering with the tokenizer's own template, and the model's end tokens.

Every path that turns messages into ids (the engine's `/v1/chat/completions`, `ctx.chat`, the
agent gateway, SFT) renders through `ChatTemplate`, so one conversation has one rendering.

Messages arrive in OpenAI's shape and are normalised as SGLang does before the template sees them:
null fields dropped, text parts joined. Tool-call `arguments` are the one field templates disagree
on: OpenAI sends a JSON string, Qwen2.5, Llama 3 and GLM iterate or `tojson` an object, while
DeepSeek-V3.1 concatenates a string (an object there is a TypeError). Which form a template wants
is found once, by rendering a probe call both ways (`_arguments_form`), not by a table of names;
a string the caller sent is passed as it came, so a history renders exactly as HF renders it.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

# The probe conversation that tells which form of tool-call arguments a template renders as JSON.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_fn",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_PROBE_ARGS = {"x": "probe"}


class TemplateError(ValueError):
    """A conversation the template cannot render; `field` names the request field at fault."""

    def __init__(self, message: str, field: str = "messages") -> None:
        super().__init__(message)
        self.field = field


def normalize_message(message: Any, i: int) -> dict[str, Any]:
    """One OpenAI message as templates expect it: null fields dropped, text parts joined."""
    if not isinstance(message, dict) or "role" not in message:
        raise TemplateError(f"messages.{i}.role: field required", f"messages.{i}.role")
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list):
        if any(not (isinstance(p, dict) and p.get("type") == "text") for p in content):
            raise TemplateError(f"messages.{i}.content: only text parts are supported", f"messages.{i}.content")
        out["content"] = " ".join(p.get("text", "") for p in content)
    return out


def _arguments_as(call: Any, form: str, i: int) -> Any:
    """A tool call with its `arguments` as a JSON string (`form` "string") or an object ("object")."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or "arguments" not in fn:
        return call
    args = fn["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise TemplateError(
                f"messages.{i}.tool_calls: function.arguments must be a JSON object", f"messages.{i}.tool_calls"
            ) from None
    if not isinstance(args, dict):
        raise TemplateError(
            f"messages.{i}.tool_calls: function.arguments must be a JSON object", f"messages.{i}.tool_calls"
        )
    if form == "string":  # the caller's own string, as HF would render it; an object is written as JSON
        value = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(args, ensure_ascii=False)
    else:
        value = args
    return {**call, "function": {**fn, "arguments": value}}


class ChatTemplate:
    """A tokenizer's chat template as slimish renders it: normalised messages, tool-call arguments
    in the template's form, template kwargs checked against `apply_chat_template`'s own arguments."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "the tokenizer has no chat_template; chat messages cannot be rendered for this model", "model"
            )
        self.tokenizer = tokenizer
        self._own_args = {
            k
            for k, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        }
        self.arguments_form = self._arguments_form()

    @property
    def source(self) -> str:
        return self.tokenizer.chat_template

    def messages(self, messages: list[Any]) -> list[dict[str, Any]]:
        """Normalised messages, tool-call arguments in this template's form."""
        out = []
        for i, m in enumerate(messages):
            m = normalize_message(m, i)
            if isinstance(m.get("tool_calls"), list):
                m["tool_calls"] = [_arguments_as(c, self.arguments_form, i) for c in m["tool_calls"]]
            out.append(m)
        return out

    def render(
        self, messages: list[Any], tools: list[dict] | None = None, add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """The template's ids for `messages`; `kwargs` are template variables (`enable_thinking`...)."""
        for key in kwargs:
            if key in self._own_args:  # would change the call, not the template
                raise TemplateError(
                    f"chat_template_kwargs.{key}: an argument of apply_chat_template, not a template variable",
                    "chat_template_kwargs",
                )
        normalised = self.messages(messages)
        try:
            ids = self.tokenizer.apply_chat_template(
                normalised,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **kwargs,
            )
        except TemplateError:
            raise
        except Exception as exc:  # jinja errors and the template's raise_exception: caused by the conversation
            raise TemplateError(f"messages: the chat template could not render them: {exc}") from None
        return list(ids)

    def _arguments_form(self) -> str:
        """ "object" or "string": the form of `arguments` this template writes as JSON, probed on
        one call; "object" where both forms render alike or the template has no tool calls."""
        rendered = {form: self._probe(form) for form in ("object", "string")}
        if rendered["object"] is None and rendered["string"] is not None:
            return "string"
        if rendered["object"] is None or rendered["string"] is None:
            return "object"
        double_encoded = json.dumps(json.dumps(_PROBE_ARGS))[1:-1]  # {\"x\": \"probe\"}
        python_repr = str(_PROBE_ARGS)  # {'x': 'probe'}
        return "string" if double_encoded not in rendered["string"] and python_repr in rendered["object"] else "object"

    def _probe(self, form: str) -> str | None:
        call = {"id": "c", "type": "function", "function": {"name": "probe_fn", "arguments": _PROBE_ARGS}}
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [_arguments_as(call, form, 1)]},
            {"role": "tool", "tool_call_id": "c", "content": "r"},
        ]
        try:
            return self.tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False)
        except Exception:
            return None


def end_token_ids(tokenizer: Any, model_path: str | None = None) -> list[int]:
    """The ids a model ends its turn with: `generation_config.json`'s `eos_token_id` (an int or a
    list: Llama 3 stops on `<|eot_id|>`, `<|eom_id|>` and `<|end_of_text|>`; GLM on the next turn's
    `<|user|>` / `<|observation|>`), then the tokenizer's EOS. One source for the engine's stop set,
    `ctx.chat` and the gateway, so every path agrees on where a turn ended."""
    from transformers import GenerationConfig  # here: the router imports this module, and transformers is 1 s

    path = model_path or getattr(tokenizer, "name_or_path", None)
    eos: Any = None
    if path:
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:
            eos = None
    ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
