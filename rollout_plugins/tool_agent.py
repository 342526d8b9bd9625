"""A multi-turn agent with a calculator tool: the model may call it a few times, then answers.

    slimish train --config C --rollout-fn rollout_plugins.tool_agent:rollout

`ctx.chat` renders the conversation with the chat template (tools included), generates, parses
the model's tool calls with its family's parser (Qwen, Llama 3, DeepSeek, GLM... see the README's
model families) and records exact tokens: the model's own ids (mask 1, with logprobs) and, between
turns, the template's ids of the tool results (mask 0). The reward scores the final answer (the model's last turn). The same agent
written against the `openai` SDK is `openai_agent.py`, whose calculator this one shares.
"""

import json

from rollout_plugins.openai_agent import TOOLS, calculator
from slimish.rollout.rewards import math_reward
from slimish.types import Sample

MAX_TURNS = 4


async def rollout(ctx, sample: Sample) -> Sample:
    messages = list(sample.prompt) if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}]
    for _ in range(MAX_TURNS):
        turn = await ctx.chat(messages, tools=TOOLS)
        messages.append(turn.message)
        if not turn.tool_calls or turn.finish_reason != "stop":
            break  # an answer, or cut off (length / abort): the sample's status says which
        messages += [{"role": "tool", "name": "calculator", "content": run_tool(call)} for call in turn.tool_calls]
    sample.reward = await math_reward(ctx, sample)
    return sample


def run_tool(call: dict) -> str:
    """Bad arguments are reported to the model as text, as a real tool would."""
    try:
        return calculator(str(json.loads(call["function"]["arguments"])["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: bad arguments ({exc})"
