"""An agent written against the `anthropic` SDK, trained as is: `--rollout-fn rollout_plugins.anthropic_agent:rollout`.

The same agent as `openai_agent.py` (its calculator, prompts and reward), speaking Anthropic's
Messages API: it is pointed at `await ctx.anthropic_base_url()`, and slimish's gateway turns every
`messages.create` into a native generate call whose exact token ids and logprobs it records;
`ctx.captured_samples()` returns them as training samples (model turns mask 1, tool results and
user turns mask 0). Copy this file and replace the agent loop with your own.
"""

from __future__ import annotations

from typing import Any

import anthropic

from rollout_plugins.openai_agent import MAX_TURNS, NUDGE, SYSTEM, TLS, calculator
from rollout_plugins.openai_agent import TOOLS as OPENAI_TOOLS
from slimish.rollout.rewards import extract_boxed

# The calculator as an Anthropic tool.
TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in OPENAI_TOOLS
]
# An explicit timeout: with the SDK's default one, it refuses a non-streaming call whose
# `max_tokens` could take over 10 minutes on Anthropic's servers (over ~21k tokens).
TIMEOUT_S = 600.0


def run_tool(block: Any) -> str:
    try:
        return calculator(str(block.input["expression"]))
    except (KeyError, TypeError) as exc:
        return f"error: bad arguments ({exc})"


def split_system(prompt: str | list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Anthropic takes the system prompt apart from the messages: a dataset's system messages join ours."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    system = [SYSTEM, *(m["content"] for m in messages if m["role"] == "system")]
    return "\n\n".join(system), [m for m in messages if m["role"] != "system"]


async def rollout(ctx, sample):
    system, messages = split_system(sample.prompt)
    sp = ctx.sampling_params  # the run's sampling settings (eval lowers the temperature)
    text = ""
    base_url = await ctx.anthropic_base_url()
    async with anthropic.AsyncAnthropic(
        base_url=base_url,
        api_key="slimish",
        max_retries=0,
        timeout=TIMEOUT_S,
        http_client=anthropic.DefaultAsyncHttpxClient(verify=TLS),  # openai_agent.py: one TLS context
    ) as client:
        for _ in range(MAX_TURNS):
            # The SDK (2.16) has no temperature argument; the gateway reads it from the body.
            reply = await client.messages.create(
                model="policy",
                system=system,
                messages=messages,
                tools=TOOLS,
                max_tokens=sp["max_new_tokens"],
                extra_body={"temperature": sp["temperature"]},
            )
            messages.append({"role": "assistant", "content": reply.content})
            calls = [b for b in reply.content if b.type == "tool_use"]
            text = "".join(b.text for b in reply.content if b.type == "text")
            if calls:
                results = [{"type": "tool_result", "tool_use_id": c.id, "content": run_tool(c)} for c in calls]
                messages.append({"role": "user", "content": results})
            elif extract_boxed(text) is None:
                messages.append({"role": "user", "content": NUDGE})
            else:
                break
    answer = extract_boxed(text)
    reward = float(answer is not None and " ".join(answer.split()) == str(sample.label))
    samples = ctx.captured_samples()  # one per exact-token segment (more than one only if the history was edited)
    for s in samples:
        s.reward = reward
    return samples
