"""The model-family cases shared by tests: one 3-turn tool conversation per family (and mode),
what a model that follows the family's template writes for it, and the family models fitted to
write exactly that (`family_dirs`, built once per test session).

The models are tiny, with the families' real tokenizers (tests/model_families.py), fitted for a
few seconds so that greedy decoding writes exactly what the template renders for each assistant
turn of the conversation: the tool call, the answer after the tool result, the answer after the
user's follow-up. Where the template re-renders history (Qwen3 and GLM drop the reasoning of
turns before the last user message, DeepSeek-V3.1 in thinking mode drops it everywhere), the model
is fitted on both contexts: the chained ids it saw, and the template's rendering.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import model_families
import pytest
from helpers import built_once
from transformers import AutoTokenizer

from slimish.formats.model import ModelFormat
from slimish.launch.local import engine_process

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
BRAVE_SEARCH = {
    "type": "function",
    "function": {
        "name": "brave_search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # a model_families.FAMILIES key
    tool_parser: str  # what the engine detects from the template
    reasoning_parser: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    reasoning: tuple[str | None, str | None, str | None] = (None, None, None)  # per assistant turn
    args: str = "object"  # the form of tool-call arguments the HF template wants
    tool: dict[str, Any] = field(default_factory=lambda: CALCULATOR)
    keeps_history: bool = True  # the template renders earlier turns as they were generated

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [self.tool]

    @property
    def call_args(self) -> dict[str, Any]:
        return {"query": "2+3"} if self.tool is BRAVE_SEARCH else {"expression": "2+3"}


THINKING = ("I should use the calculator.", "The tool says 5.", "5 times 4 is 20.")
CASES = [
    Case("qwen2.5", "qwen2.5", "qwen25", None),
    Case("qwen3", "qwen3", "qwen25", "qwen3", reasoning=THINKING, keeps_history=False),
    Case("qwen3-coder", "qwen3-coder", "qwen3_coder", None),
    Case("llama3.1", "llama3.1", "llama3", None),
    # A built-in tool: `<|python_tag|>brave_search.call(query="2+3")`, ended by `<|eom_id|>`.
    Case("llama3.1-builtin", "llama3.1", "llama3", None, kwargs={"builtin_tools": ["brave_search"]}, tool=BRAVE_SEARCH),
    # Both write a newline after the last tool result that the history rendering does not have.
    Case("hermes3", "hermes3", "qwen25", None, keeps_history=False),
    Case("deepseek-v3", "deepseek-v3", "deepseekv3", None, keeps_history=False),
    Case("deepseek-v3.1", "deepseek-v3.1", "deepseekv31", "deepseek-v3", args="string"),
    # Thinking mode: the generation prompt opens `<think>`, except after a tool result.
    Case(
        "deepseek-v3.1-thinking",
        "deepseek-v3.1",
        "deepseekv31",
        "deepseek-v3",
        kwargs={"thinking": True},
        reasoning=(THINKING[0], None, THINKING[2]),
        args="string",
        keeps_history=False,
    ),
    Case("glm4.6", "glm4.6", "glm45", "glm45", reasoning=THINKING, keeps_history=False),
]
CASE_IDS = [c.name for c in CASES]


def conversation(case: Case) -> list[dict[str, Any]]:
    """The conversation the fitted models reproduce; OpenAI message shapes (arguments a JSON string)."""

    def think(k: int) -> dict[str, Any]:
        return {"reasoning_content": case.reasoning[k]} if case.reasoning[k] is not None else {}

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": case.tool["function"]["name"], "arguments": json.dumps(case.call_args)},
    }
    return [
        {"role": "system", "content": f"You are a careful assistant ({case.name})."},  # one context per case
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [call], **think(0)},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "The answer is 5.", **think(1)},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "20", **think(2)},
    ]


TURNS = (2, 4, 6)  # positions of the assistant messages


@dataclass
class Expected:
    """What the fitted model writes and the ids both paths must record."""

    turns: list[list[int]]  # each assistant turn's ids, through the token that ends it
    envs: list[list[int]]  # the environment's ids after turns 1 and 2 (exact policy)
    prompts: list[list[int]]  # the template's rendering of the history before each turn

    @property
    def exact(self) -> list[int]:
        ids = list(self.prompts[0])
        for turn, env in zip(self.turns, [*self.envs, []]):
            ids += turn + env
        return ids

    def chained_context(self, k: int) -> list[int]:
        ids = list(self.prompts[0])
        for turn, env in list(zip(self.turns, self.envs))[:k]:
            ids += turn + env
        return ids


def expected(fmt: ModelFormat, case: Case) -> Expected:
    chat, conv = fmt.chat(case.tools, **case.kwargs), conversation(case)
    prompts = [chat.prompt_ids(conv[:k]) for k in TURNS]
    turns = []
    for k, at in enumerate(TURNS):
        turn = chat.assistant_ids(conv[:at], conv[at], conv[at + 1] if at + 1 < len(conv) else None)
        if (
            case.reasoning[k]
            and fmt.opens_reasoning(prompts[k])
            and case.reasoning[k] not in fmt.tokenizer.decode(turn)
        ):
            # The template renders no reasoning at all (DeepSeek-V3.1): the model writes it after the
            # prompt's `<think>`, before the `</think>` the template's turn starts with.
            turn = fmt.tokenizer.encode(case.reasoning[k], add_special_tokens=False) + turn
        turns.append(turn)
    envs = [chat.env_ids(conv[k + 1 : k2], turns[i][-1]) for i, (k, k2) in enumerate(zip(TURNS, TURNS[1:]))]
    return Expected(turns, envs, prompts)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family's model, fitted (per vocabulary, shared weights) to every case's turns, in
    the chained context and in the template's rendering where that differs."""
    families = sorted({c.family for c in CASES})
    root = built_once(tmp_path_factory, "families", lambda root: fit_families(root, families))
    return {name: root / name for name in families}


def fit_families(root: Path, families: list[str]) -> None:
    dirs = {name: model_families.build_family(name, root / name) for name in families}
    by_vocab: dict[str, list[str]] = {}
    for name in dirs:
        by_vocab.setdefault(model_families.FAMILIES[name].vocab, []).append(name)
    for names in by_vocab.values():
        sequences = []
        for case in (c for c in CASES if c.family in names):
            e = expected(ModelFormat(AutoTokenizer.from_pretrained(dirs[case.family])), case)
            mask = [0] * len(e.prompts[0])
            for turn, env in zip(e.turns, [*e.envs, []]):
                mask += [1] * len(turn) + [0] * len(env)
            sequences.append((e.exact, mask))
            for k, prompt in enumerate(e.prompts):
                if prompt != e.chained_context(k):  # the template re-renders history: fit that context too
                    sequences.append((prompt + e.turns[k], [0] * len(prompt) + [1] * len(e.turns[k])))
        model_families.fit([dirs[n] for n in names], sequences)


@pytest.fixture(scope="session")
def family_engine(
    family_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], str]]:
    """The URL of a real engine on a family's fitted model, started the first time the family is
    asked for and kept for the session: the cases of one family and the modules that take the same
    cases share it (each engine start is seconds; the tests only generate, so a shared engine
    serves them as a fresh one would). All are stopped when the session ends."""
    logs, urls = tmp_path_factory.mktemp("family-engines"), {}
    with ExitStack() as stack:

        def url(family: str) -> str:
            if family not in urls:
                proc = engine_process(family_dirs[family], log_path=logs / f"{family}.log")
                urls[family] = stack.enter_context(proc).url
            return urls[family]

        yield url


@pytest.fixture(scope="module")
def served(case: Case, family_dirs: dict[str, Path], family_engine: Callable[[str], str]) -> tuple[str, Path]:
    """A real engine on the fitted model of the module's `case` (a parametrized fixture each
    module defines): its URL and the model dir."""
    return family_engine(case.family), family_dirs[case.family]
