"""A pydantic-ai agent with structured output, trained as is: `--rollout-fn rollout_plugins.pydantic_ai_agent:rollout`.

The agent answers the `max_digit` task (`data.source: task:max_digit`) with an `Answer`, pydantic-ai's
`output_type`, over its Anthropic model pointed at `await ctx.anthropic_base_url()`. pydantic-ai
asks for structured output the way it does by default for Anthropic: the answer is a tool, `submit`,
and the request forces it (`tool_choice: {"type": "any"}`), which the gateway honours by constrained
decoding over the model's own tool-call syntax. So every reply is a call whose arguments are valid
against `Answer`'s schema; what the model still has to learn is which digit to submit. The reward is
1 when it is the label; the gateway captured the call (the run's one model turn) as the sample.
"""

from __future__ import annotations

from typing import Any

import anthropic
from pydantic import BaseModel, Field
from pydantic_ai import Agent, ToolOutput
from pydantic_ai.exceptions import UnexpectedModelBehavior
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.providers.anthropic import AnthropicProvider

from rollout_plugins.anthropic_agent import TIMEOUT_S
from rollout_plugins.openai_agent import TLS


class Answer(BaseModel):
    digit: int = Field(ge=0, le=9)


# The output tool, named by the agent (pydantic-ai's default is `final_result`).
NAME, DESCRIPTION = "submit", "Submit the answer digit."
agent = Agent(output_type=ToolOutput(Answer, name=NAME, description=DESCRIPTION))


def output_tool() -> dict[str, Any]:
    """The output tool as an OpenAI function tool, for SFT demonstrations to offer. pydantic-ai
    sends the same name, description and properties, its schema without pydantic's `title`s: a
    template that writes a tool's name and parameter names renders both prompts alike."""
    return {
        "type": "function",
        "function": {"name": NAME, "description": DESCRIPTION, "parameters": Answer.model_json_schema()},
    }


async def rollout(ctx, sample):
    sp = ctx.sampling_params  # the run's sampling settings (eval lowers the temperature)
    # anthropic >= 2 sends `anthropic-version: 2026-10-21`, under which pydantic-ai drops `temperature`
    # (that API version rejects sampling parameters); the version before it keeps it.
    client = anthropic.AsyncAnthropic(
        base_url=await ctx.anthropic_base_url(),
        api_key="slimish",
        max_retries=0,
        default_headers={"anthropic-version": "2023-06-01"},
        # Also for the connection, which the SDK's default gives 5 s: a rollout process running hundreds
        # of agents (the gateway serves them on the same event loop) can take longer to accept one.
        timeout=TIMEOUT_S,
        http_client=anthropic.DefaultAsyncHttpxClient(verify=TLS),  # openai_agent.py: one TLS context
    )
    async with client:
        model = AnthropicModel("policy", provider=AnthropicProvider(anthropic_client=client))
        settings = {"max_tokens": sp["max_new_tokens"], "temperature": sp["temperature"]}
        try:
            answer = (await agent.run(sample.prompt[-1]["content"], model=model, model_settings=settings)).output
        except UnexpectedModelBehavior:  # no answer within max_tokens: scores 0
            answer = None
    reward = float(answer is not None and str(answer.digit) == str(sample.label))
    samples = ctx.captured_samples()
    for s in samples:
        s.reward = reward
    return samples
