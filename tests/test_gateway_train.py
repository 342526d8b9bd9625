"""`slimish train` with an agent written against the `anthropic` SDK, on a toy tool task: the
reward rises. Every sample is recorded by the gateway from the SDK's calls; nothing in the agent
knows about RL.

The task is the quickstart's (`max_digit`: "Largest digit: 8 7 9 0 6 4 9"), answered with a tool
call, `submit(digit)`. The SFT warm start teaches the call on demonstrations that submit a random
digit of the list (the format, not the goal); GRPO then has to find "the largest" from the reward.
The tiny model's template writes the tools in one short system line: its Qwen2.5 preamble (about
300 tokens) is more context than a 2-layer, 64-wide model learns to look past in a few steps
(measured: the quickstart itself stays at chance for 10 steps behind a system prompt that long).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from transformers import AutoTokenizer

from slimish.metrics import read_metrics
from slimish.rollout.tasks import get_task
from slimish.tiny_model import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.learning, pytest.mark.timeout(1500)]

SUBMIT = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "Submit the answer digit.",
        "parameters": {"type": "object", "properties": {"digit": {"type": "string"}}, "required": ["digit"]},
    },
}

# Tools in one line: `<|im_start|>system\nTools: submit(digit)<|im_end|>` (then the template as it was).
SHORT_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\nTools: ' }}
    {%- for tool in tools %}{{- tool.function.name + '(' + tool.function.parameters.properties | list | join(', ') + ') ' }}{%- endfor %}
    {{- '<|im_end|>\\n' }}
"""

PLUGIN = """
import anthropic

TOOLS = [{"name": "submit", "description": "Submit the answer digit.",
          "input_schema": {"type": "object", "properties": {"digit": {"type": "string"}}, "required": ["digit"]}}]

async def rollout(ctx, sample):
    sp = ctx.sampling_params
    async with anthropic.AsyncAnthropic(base_url=await ctx.anthropic_base_url(), api_key="slimish", max_retries=0) as client:
        reply = await client.messages.create(model="policy", max_tokens=sp["max_new_tokens"], tools=TOOLS,
                                             messages=[{"role": "user", "content": sample.prompt[-1]["content"]}],
                                             extra_body={"temperature": sp["temperature"]})  # this SDK has no temperature argument
    digits = [b.input.get("digit") for b in reply.content if b.type == "tool_use" and b.name == "submit"]
    reward = float(digits == [str(sample.label)])
    samples = ctx.captured_samples()
    for s in samples:
        s.reward = reward
    return samples
"""


def test_anthropic_sdk_agent_learns_a_toy_tool_task(tmp_path: Path) -> None:
    task, rng = get_task("max_digit"), random.Random(0)
    with (tmp_path / "sft.jsonl").open("w") as sft, (tmp_path / "rl.jsonl").open("w") as rl:
        for r in task.make("train", 2000, 0):
            call = {
                "id": "call_0",
                "type": "function",
                "function": {
                    "name": "submit",
                    "arguments": json.dumps({"digit": rng.choice([c for c in r["prompt"] if c.isdigit()])}),
                },
            }
            sft.write(
                json.dumps(
                    {
                        "prompt": r["prompt"],
                        "tools": [SUBMIT],
                        "response": {"role": "assistant", "content": "", "tool_calls": [call]},
                    }
                )
                + "\n"
            )
            rl.write(json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n")
    (tmp_path / "held_out.jsonl").write_text(
        "".join(json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n" for r in task.make("test", 64, 0))
    )
    (tmp_path / "agent.py").write_text(PLUGIN)
    model = make_tiny_model(tmp_path / "model", arch="llama", size="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = (
        SHORT_TOOLS + tok.chat_template[tok.chat_template.index("\n{%- else %}") :]
    )  # the top-level else: no tools
    tok.save_pretrained(model)
    argv = [
        sys.executable,
        "-m",
        "slimish.train",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        f"model={model}",
        f"run_dir={tmp_path / 'run'}",
        f"data.source={tmp_path / 'rl.jsonl'}",
        f"eval.source={tmp_path / 'held_out.jsonl'}",
        f"sft.source={tmp_path / 'sft.jsonl'}",
        f"rollout.rollout_fn={tmp_path / 'agent.py'}:rollout",
        "rollout.max_new_tokens=32",
        "rollout.overlong_buffer=0",  # the quickstart's length penalty is for its one-turn answers
        "steps=12",
        "eval.every=12",  # the assertions read the first and the last eval
        "checkpoint.every=0",
    ]
    done = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    accuracy = [r["eval/accuracy"] for r in metrics if "eval/accuracy" in r]
    assert accuracy[0] < 0.3, f"SFT alone should leave held-out accuracy near chance, got {accuracy[0]}"
    assert accuracy[-1] >= accuracy[0] + 0.1, f"held-out accuracy {accuracy} over 12 steps"
    steps = [r for r in metrics if r["step"] >= 1 and "rollout/groups_failed" in r]
    failures = [line for line in done.stderr.splitlines() if "groups failed" in line]
    assert all(r["rollout/groups_failed"] == 0 for r in steps), failures[:3]
    assert all(r["rollout/segments_per_trajectory"] == 1.0 for r in steps)
