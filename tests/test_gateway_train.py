"""`slimish train` with a pydantic-ai agent that answers in structured output over its Anthropic
model, on a toy task: held-out accuracy rises. Every sample is recorded by the gateway from the
framework's calls; nothing in the agent (rollout_plugins/pydantic_ai_agent.py) knows about RL.

The task is the quickstart's (`max_digit`: "Largest digit: 8 7 9 0 6 4 9"), answered as
`Answer(digit=...)`, pydantic-ai's `output_type`. pydantic-ai asks for it as a forced call of its
output tool (Anthropic `tool_choice: {"type": "any"}`), which the gateway honours by constrained
decoding: every reply is a call with arguments valid against the schema, so the reward is about the
digit alone. The SFT warm start teaches the call on demonstrations that submit a random digit of the
list (the format, not the goal); GRPO then has to find "the largest" from the reward.
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
from helpers import ROOT, TRAINER_THREADS
from transformers import AutoTokenizer

from slimish.metrics import read_metrics
from slimish.rollout.tasks import get_task
from slimish.tiny_model import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.learning, pytest.mark.timeout(1500)]

# Tools in one line: `<|im_start|>system\nTools: submit(digit)<|im_end|>` (then the template as it was).
SHORT_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\nTools: ' }}
    {%- for tool in tools %}{{- tool.function.name + '(' + tool.function.parameters.properties | list | join(', ') + ') ' }}{%- endfor %}
    {{- '<|im_end|>\\n' }}
"""


def test_pydantic_ai_agent_learns_a_toy_task_with_structured_output(tmp_path: Path) -> None:
    from rollout_plugins.pydantic_ai_agent import NAME, output_tool  # pydantic-ai takes seconds to import

    task, rng = get_task("max_digit"), random.Random(0)
    with (tmp_path / "sft.jsonl").open("w") as sft, (tmp_path / "rl.jsonl").open("w") as rl:
        for r in task.make("train", 2000, 0):
            guess = int(rng.choice([c for c in r["prompt"] if c.isdigit()]))
            call = {
                "id": "call_0",
                "type": "function",
                "function": {"name": NAME, "arguments": json.dumps({"digit": guess})},
            }
            reply = {"role": "assistant", "content": "", "tool_calls": [call]}
            sft.write(json.dumps({"prompt": r["prompt"], "tools": [output_tool()], "response": reply}) + "\n")
            rl.write(json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n")
    (tmp_path / "held_out.jsonl").write_text(
        "".join(json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n" for r in task.make("test", 64, 0))
    )
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
        "rollout.rollout_fn=rollout_plugins.pydantic_ai_agent:rollout",
        # The call is 26 tokens as the model was taught to write it (EOS included), 30 with the
        # whitespace the grammar allows; the grammar also allows any other split of its fixed text into
        # the tiny vocabulary's tokens, which a T=1 sample takes now and then (27 tokens seen; one reply
        # in ~3000 ran past a limit of 32 in CI, truncated). 64 leaves room for any plausible split.
        "rollout.max_new_tokens=64",
        "rollout.overlong_buffer=0",  # the quickstart's length penalty is for its one-turn answers
        # RL has 12 steps: nothing pulls back to the demonstrations' random digit (the quickstart's
        # ptx, for its 150), and each batch trains as two mini-batches (the trainer idles >90% of a
        # step waiting for rollouts, so a second update is nearly free). Measured: with 100 SFT steps
        # in place of 200 (its loss is flat from ~90), reward stayed at chance for 7 steps in 2 runs.
        "algorithm.ptx_coef=0",
        "trainer.updates_per_step=2",
        "steps=12",
        "eval.every=12",  # the assertions read the first and the last eval
        "checkpoint.every=0",
        TRAINER_THREADS,
    ]
    done = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    accuracy = [r["eval/accuracy"] for r in metrics if "eval/accuracy" in r]
    assert accuracy[0] < 0.3, f"SFT alone should leave held-out accuracy near chance, got {accuracy[0]}"
    assert accuracy[-1] >= accuracy[0] + 0.2, f"held-out accuracy {accuracy} over 12 steps"
    steps = [r for r in metrics if r["step"] >= 1 and "rollout/groups_failed" in r]
    failures = [line for line in done.stderr.splitlines() if "groups failed" in line]
    assert all(r["rollout/groups_failed"] == 0 for r in steps), failures[:3]
    # One model turn per run (the forced call ends it), always a whole call within max_new_tokens.
    odd = [r for r in steps if r["rollout/segments_per_trajectory"] != 1.0 or r["rollout/truncated"] != 0]
    assert not odd, [(r["step"], r["rollout/segments_per_trajectory"], r["rollout/truncated"]) for r in odd]
