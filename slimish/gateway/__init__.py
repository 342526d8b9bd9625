"""The agent gateway: model APIs (OpenAI Chat Completions and Responses, Anthropic Messages) in the
rollout process that record the exact tokens of every call an agent makes (`server.Gateway`), the
trajectory tree that turns those calls into training samples, and a runner for black-box agent
programs pointed at it (`harness`). It sits below `slimish.rollout`: it knows the router's client and
the model's format, never the run's config; `ctx` (slimish/rollout/api.py) starts it and hands it the settings."""
