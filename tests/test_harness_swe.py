"""mini-swe-agent (PyPI `mini-swe-agent`, its unmodified `mini` command line) as a black-box
harness (`rollout_plugins/swe_harness.py`): it fixes a bug in a small repository through the
gateway, with a model fitted to do so, and is captured as one exact-token sample.

The model is the Qwen2.5 family's (tests/model_families.py: the real tokenizer and template, a
tiny network) fitted on the exact conversation mini-swe-agent has with a scripted model doing the
fix: first `mini` runs against the script (a fake OpenAI server) and every request it sends is
kept; the model is fitted to write each of the script's turns after the template's rendering of
what came before; then `mini` runs again, through the rollout function, against a real engine
on the fitted model, with no network (proxies pointing nowhere).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import model_families
import pytest
from helpers import fake_model_server, run_plugin
from transformers import AutoTokenizer

from rollout_plugins.swe_harness import EXAMPLE_ROW, MINI_ENV, mini_argv, passes_check, rollout
from slimish.formats.model import ModelFormat
from slimish.gateway.harness import HarnessLimits, gateway_env, run_harness
from slimish.launch.local import engine_process
from slimish.types import Sample, SampleStatus

# What the fitted model does: read the file, fix it, submit (mini's way of ending a run).
SCRIPT = [
    "cat calc.py",
    "sed -i 's/a - b/a + b/' calc.py",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
]
WALL = HarnessLimits(wall_s=90.0)  # a run is seconds; a stuck one fails the test in bounded time
# Anything that is not the gateway on 127.0.0.1 goes to a port where nothing listens.
OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}


def call(command: str) -> dict[str, Any]:
    """An assistant message calling mini's bash tool with `command`."""
    function = {"name": "bash", "arguments": {"command": command}}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_0", "type": "function", "function": function}],
    }


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    """The requests `mini` sends a model that follows SCRIPT: its tools and the whole conversation
    (the last request's messages and the script's last turn)."""
    with fake_model_server() as model:
        model.script = [[("bash", json.dumps({"command": c}))] for c in SCRIPT]
        env = {**gateway_env(model.url, "record"), **MINI_ENV, **OFFLINE}
        with asyncio.run(run_harness(mini_argv(EXAMPLE_ROW["prompt"]), env, WALL, EXAMPLE_ROW["files"])) as run:
            assert run.exit_code == 0 and run.infra_error is None, run.stderr[-3000:]
            assert asyncio.run(passes_check(run.workdir, EXAMPLE_ROW["files"])) == 1.0  # the script does fix it
    assert len(model.requests) == len(SCRIPT) and not model.script
    last = model.requests[-1]["body"]
    return {"tools": last["tools"], "messages": [*map(arguments_as_dicts, last["messages"]), call(SCRIPT[-1])]}


def arguments_as_dicts(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with its calls' JSON-string arguments parsed (HF's Qwen2.5 template writes them with tojson)."""
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in message.get("tool_calls") or []
    ]
    return {**message, "tool_calls": calls} if calls else message


def model_turns(tok: Any, tools: list[dict], conv: list[dict]) -> tuple[list[int], list[int]]:
    """The token-exact record of `conv` as the gateway builds it from a model that writes each
    assistant turn as the template renders it: (all ids, mask 1 on the model's)."""
    chat = ModelFormat(tok).chat(tools)
    at = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    ids = chat.prompt_ids(conv[: at[0]])
    mask = [0] * len(ids)
    for k, i in enumerate(at):
        turn = chat.assistant_ids(conv[:i], conv[i])
        env = chat.env_ids(conv[i + 1 : at[k + 1]], turn[-1]) if k + 1 < len(at) else []
        ids, mask = ids + turn + env, mask + [1] * len(turn) + [0] * len(env)
    return ids, mask


@pytest.fixture(scope="module")
def fitted(recorded: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = model_families.build_family("qwen2.5", tmp_path_factory.mktemp("swe") / "qwen2.5")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model_families.fit([model_dir], [model_turns(tok, recorded["tools"], recorded["messages"])])
    return model_dir


@pytest.fixture(scope="module")
def swe_engine(fitted: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with engine_process(fitted, log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc.url


def test_mini_swe_agent_fixes_the_repository_and_is_one_exact_sample(
    recorded: dict[str, Any], fitted: Path, swe_engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("rollout_plugins.swe_harness.MINI_ENV", {**MINI_ENV, **OFFLINE})
    monkeypatch.setattr("rollout_plugins.swe_harness.LIMITS", WALL)
    tok = AutoTokenizer.from_pretrained(fitted)
    sample = Sample(prompt=EXAMPLE_ROW["prompt"], metadata={"files": EXAMPLE_ROW["files"]}, group_id=1)
    (s,) = run_plugin(rollout, fitted, swe_engine, tok, sample, {"temperature": 0.0, "max_new_tokens": 64})
    s.check()
    assert (s.status, s.reward, s.error) == (SampleStatus.COMPLETED, 1.0, None)
    assert s.metadata["capture"]["turns"] == len(SCRIPT) and s.metadata["capture"]["segments"] == 1

    # The ids are HF's rendering of the conversation (the recorded one: the fitted model writes the script's
    # turns, so mini sent the same messages), mask 1 on exactly the assistant turns.
    conv, tools = recorded["messages"], recorded["tools"]

    def hf(messages: list[dict], **kw: Any) -> list[int]:
        return tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **kw)

    assert s.tokens == hf(conv)[:-1]  # all but the newline after the last turn's <|im_end|>
    assert s.tokens[: s.prompt_length] == hf(conv[:2], add_generation_prompt=True)
    spans, mask = [], [0] * s.prompt_length + s.loss_mask
    for i in (i for i, m in enumerate(conv) if m["role"] == "assistant"):
        start, end = len(hf(conv[:i], add_generation_prompt=True)), len(hf(conv[: i + 1])) - 1
        spans.append((start, end))
        assert s.tokens[start:end][-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert [k for k, m in enumerate(mask) if m] == [k for a, b in spans for k in range(a, b)]


def test_the_check_is_the_rows_own(tmp_path: Path) -> None:
    """An agent that rewrites the check instead of the code gains nothing; a fixed repository passes."""
    files = EXAMPLE_ROW["files"]
    gamed = {**files, "check.py": "print('ok')\n"}
    fixed = {**files, "calc.py": "def add(a, b):\n    return a + b\n"}
    for name, seeded, want in [("gamed", gamed, 0.0), ("fixed", fixed, 1.0), ("as given", files, 0.0)]:
        with asyncio.run(run_harness(["true"], {}, WALL, seeded, workdir=tmp_path / name)) as run:
            assert asyncio.run(passes_check(run.workdir, files)) == want, name
