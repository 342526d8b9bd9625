"""Model formats: how each model family writes a conversation in tokens and how to read its replies.

One place, imported by the engine's OpenAI routes, `ctx.chat`, the agent gateway and SFT alike
(the rollout side never imports `slimish.engine` for this):

- `template.py`: chat rendering with the tokenizer's template (message normalisation, tool-call
  arguments in the form each template expects, template kwargs) and the model's end tokens.
- `tokens.py`: `ChatTokens`, a conversation continued in token space after the model's own ids.
- `tool_parsers.py`: tool-call parsers by SGLang's `--tool-call-parser` names, streaming included.
- `reasoning.py`: reasoning parsers by SGLang's `--reasoning-parser` names, streaming included.
- `tool_choice.py`: one tool normalisation for every protocol, forced tool calls as constraints in
  each family's own call syntax, and the `max_tokens` rule.
"""
