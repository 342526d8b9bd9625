"""An agent written against the `openai` SDK's Responses API, trained as is:
`--rollout-fn rollout_plugins.responses_agent:rollout`.

The same calculator agent and reward as rollout_plugins/openai_agent.py, written the way Responses
agents usually are: each call sends only what is new (the function call outputs, a user nudge)
and names the response it continues with `previous_response_id`; the gateway keeps the
conversation. `instructions` are sent on every call, as OpenAI does not carry them over. Every
call is captured token-exactly; `ctx.captured_samples()` returns the training samples.
"""

from __future__ import annotations

import json
from typing import Any

from rollout_plugins.openai_agent import MAX_TURNS, NUDGE, SYSTEM, TOOLS, calculator, gateway_client
from slimish.rollout.rewards import extract_boxed

RESPONSES_TOOLS = [
    {"type": "function", **tool["function"]} for tool in TOOLS
]  # the Responses shape: no `function` wrapper


def run_call(arguments: str) -> str:
    try:
        return calculator(str(json.loads(arguments)["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: bad arguments ({exc})"


async def rollout(ctx, sample):
    prompt = sample.prompt if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}]
    sp = ctx.sampling_params  # the run's sampling settings (eval lowers the temperature)
    new_input: list[Any] = list(prompt)
    previous: str | None = None
    async with await gateway_client(ctx) as client:
        for _ in range(MAX_TURNS):
            response = await client.responses.create(
                model="policy",
                instructions=SYSTEM,
                input=new_input,
                tools=RESPONSES_TOOLS,
                previous_response_id=previous,
                temperature=sp["temperature"],
                max_output_tokens=sp["max_new_tokens"],
            )
            previous = response.id
            calls = [item for item in response.output if item.type == "function_call"]
            if calls:
                new_input = [
                    {"type": "function_call_output", "call_id": c.call_id, "output": run_call(c.arguments)}
                    for c in calls
                ]
            elif extract_boxed(response.output_text) is None:
                new_input = [{"role": "user", "content": NUDGE}]
            else:
                break
    answer = extract_boxed(response.output_text)
    reward = float(answer is not None and " ".join(answer.split()) == str(sample.label))
    samples = ctx.captured_samples()  # one per exact-token segment (more than one only if the history was edited)
    for s in samples:
        s.reward = reward
    return samples
