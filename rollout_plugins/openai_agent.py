"""An agent written against the `openai` SDK, trained as is: `--rollout-fn rollout_plugins.openai_agent:rollout`.

The agent knows nothing about RL: it is pointed at `await ctx.openai_base_url()` and runs an ordinary
tool loop (a calculator) for up to `MAX_TURNS` model turns. Every chat call goes through slimish's
agent gateway, which records the engine's exact token ids and logprobs; `ctx.captured_samples()`
returns them as training samples (model turns mask 1, tool and user turns mask 0). All the rollout
function adds is the reward. Copy this file and replace the agent loop with your own.
"""

from __future__ import annotations

import ast
import json
import operator
import ssl
from typing import Any

import openai

from slimish.rollout.rewards import extract_boxed

MAX_TURNS = 3
SYSTEM = "Use the calculator tool for arithmetic. Write the final answer as \\boxed{ANSWER}."
NUDGE = "Give the final answer as \\boxed{ANSWER}."
# One TLS context for every client the agents make: by default each SDK client builds its own,
# loading the CA bundle (25-60 ms of CPU), which at hundreds of agents a step costs more than a small
# model's replies. The gateway's URL is plain http; a hosted model's https would use it as is.
TLS = ssl.create_default_context()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Arithmetic only (no names, no calls): model-written input is never executed as code."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            right = ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPERATORS[type(node.op)](ev(node.left), right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else str(value)


def run_tool(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments)
        return calculator(str(args["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: bad arguments ({exc})"


async def gateway_client(ctx) -> openai.AsyncOpenAI:
    """An OpenAI client on the sample's gateway URL, with the shared TLS context."""
    return openai.AsyncOpenAI(
        base_url=await ctx.openai_base_url(),
        api_key="slimish",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
    )


async def rollout(ctx, sample):
    messages = sample.prompt if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}]
    messages = [{"role": "system", "content": SYSTEM}, *messages]
    sp = ctx.sampling_params  # the run's sampling settings (eval lowers the temperature)
    async with await gateway_client(ctx) as client:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=TOOLS,
                temperature=sp["temperature"],
                max_tokens=sp["max_new_tokens"],
            )
            message = reply.choices[0].message
            messages.append(message)
            if message.tool_calls:
                messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tool(c)} for c in message.tool_calls]
            elif extract_boxed(message.content or "") is None:
                messages.append({"role": "user", "content": NUDGE})
            else:
                break
    answer = extract_boxed(message.content or "")
    reward = float(answer is not None and " ".join(answer.split()) == str(sample.label))
    samples = ctx.captured_samples()  # one per exact-token segment (more than one only if the history was edited)
    for s in samples:
        s.reward = reward
    return samples
