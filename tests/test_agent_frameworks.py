"""The popular agent frameworks, as people write agents with them, pointed at the agent gateway:
openai-agents (Chat and Responses models), LangChain / LangGraph (langchain-openai on Chat and
Responses, langchain-anthropic), pydantic-ai (OpenAI Chat, OpenAI Responses, Anthropic). Each runs
a calculator tool round trip, a forced tool call, structured output and a streamed round trip
(tests/agent_frameworks.py), and each run is captured as ONE sample whose ids are HF's
`apply_chat_template` of what the framework sent, with mask 1 on exactly the model's tokens.

The model: Qwen2.5's real tokenizer and template on a tiny network fitted (tests/model_families.py)
to write, greedily, what each framework's conversation needs: the calculator call, then the answer;
or the structured answer. What a framework sends (its system prompt, its rendering of the tool's
schema) is its own, so the module first runs every agent once against a gateway whose engine is
replaced by the scripted replies, records the prompts the gateway would send, and fits the model on
exactly those (prompt, reply) pairs; then the same agents run against the real engine.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import model_families
import pytest
from agent_frameworks import Answer, Urls, langchain, openai_agents, pydantic_ai
from transformers import AutoTokenizer

from slimish.formats.model import ModelFormat
from slimish.gateway.server import Gateway
from slimish.launch.local import engine_process
from slimish.loop_thread import LoopThread
from slimish.protocol import GenerateResponse
from slimish.types import Sample

# LangGraph 1.x warns that `create_react_agent` moved to the `langchain` package (not a dependency);
# agents written against LangGraph still use it, so the suite does too.
pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
FAMILY = "qwen2.5"
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")  # SGLang's constrained-decoding params
ANSWER = Answer(answer=5)
UNUSED_URL = "http://127.0.0.1:9"  # the scripted gateway's router: never called (its replies stand in)


def call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as Qwen2.5's template writes one (its `tojson`: json.dumps' default separators)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


CALL_OPEN = "<tool_call>"
CALC = call("calculator", {"expression": "2+3"})
TEXT = "The answer is 5."
JSON = '{"answer": 5}'


@dataclass(frozen=True)
class Scenario:
    framework: str
    protocol: str  # chat | responses | anthropic
    kind: str  # tools | forced | structured | stream
    agent: Callable[[Urls], Any] = field(compare=False)
    replies: tuple[str, ...]  # what the model writes, turn by turn
    output: Any  # what the agent returns

    @property
    def id(self) -> str:
        return f"{self.framework}-{self.protocol}-{self.kind}"

    @property
    def constrained(self) -> tuple[int, ...]:
        """The turns a grammar must constrain: every call where a call is forced (openai-agents
        resets `tool_choice` after one), the answer where structured output is asked for."""
        want = {"forced": CALL_OPEN, "structured": JSON}.get(self.kind)
        return tuple(k for k, r in enumerate(self.replies) if want and r.startswith(want))


KINDS = ("tools", "forced", "structured", "stream")
ROUND_TRIP = ((CALC, TEXT), TEXT)  # (replies, the agent's output)
# A forced call: openai-agents forces the calculator (tool_choice="required"); LangChain's
# function-calling structured output forces its `Answer` tool; pydantic-ai's output tool is forced
# every turn (the calculator first, then its `final_result`).
FORCED = {
    "openai-agents": ROUND_TRIP,
    "langchain": ((call("Answer", {"answer": 5}),), ANSWER),
    "pydantic-ai": ((CALC, call("final_result", {"answer": 5})), ANSWER),
}
FRAMEWORKS = [
    ("openai-agents", openai_agents, ("chat", "responses")),
    ("langchain", langchain, ("chat", "responses", "anthropic")),
    ("pydantic-ai", pydantic_ai, ("chat", "responses", "anthropic")),
]


def scenarios() -> list[Scenario]:
    out = []
    for name, agent, protocols in FRAMEWORKS:
        for protocol in protocols:
            for kind in KINDS:
                replies, want = {"forced": FORCED[name], "structured": ((JSON,), ANSWER)}.get(kind, ROUND_TRIP)
                out.append(Scenario(name, protocol, kind, agent(protocol, kind), replies, want))
    return out


SCENARIOS = scenarios()


@dataclass
class Turn:
    messages: list[dict[str, Any]]  # what the protocol adapter handed the core: OpenAI chat messages
    tools: list[dict[str, Any]] | None
    params: dict[str, Any]  # the native sampling params sent to the engine
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the engine's, of completion_ids


def reply_ids(tok: Any, text: str) -> list[int]:
    """A whole assistant turn as the model writes it: the text, then `<|im_end|>`."""
    return tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]


class Recorded(Gateway):
    """The gateway, recording every turn by session; `replies` (session -> texts) stands in for
    the engine while the fixture learns what each framework sends (it fits the model on it)."""

    def __init__(self, url: str, tok: Any, replies: dict[str, tuple[str, ...]] | None = None) -> None:
        super().__init__(url, ModelFormat(tok), default_sampling={"temperature": 0.0})
        self.tok, self.replies, self.turns = tok, replies, {}
        self.thread = LoopThread("frameworks-gateway")  # the gateway serves, and the agents run, on its loop
        self.current: contextvars.ContextVar[tuple[str, dict[str, Any]]] = contextvars.ContextVar("current")
        self.engine_generate, self.client.generate = self.client.generate, self.generate
        if replies is not None:
            self.client.models = self.models

    async def turn(self, session_id: str, req: Any) -> Any:
        params: dict[str, Any] = {}
        self.current.set((session_id, params))
        result = await super().turn(session_id, req)
        logprobs = [e[0] for e in result.meta.output_token_logprobs]
        turn = Turn(req.messages, req.tools, params, result.prompt_ids, result.completion_ids, logprobs)
        self.turns.setdefault(session_id, []).append(turn)
        return result

    async def generate(self, **body: Any) -> GenerateResponse:
        session, params = self.current.get()
        params |= body["sampling_params"]
        if self.replies is None:
            return await self.engine_generate(**body)
        ids = reply_ids(self.tok, self.replies[session][len(self.turns.get(session, []))])
        meta = {"id": f"{session}-{len(ids)}", "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids)}
        meta |= {
            "finish_reason": {"type": "stop", "matched": ids[-1]},
            "output_token_logprobs": [[0.0, i, None] for i in ids],
        }
        return GenerateResponse(text=self.tok.decode(ids[:-1]), output_ids=ids, meta_info=meta)

    async def models(self) -> dict[str, Any]:
        return {"data": [{"id": "m", "max_model_len": model_families.NETWORK["max_position_embeddings"]}]}

    def run(self, scenario: Scenario) -> tuple[Any, list[Turn], list[Sample]]:
        """The scenario's agent on its own session: its output, its turns, its samples."""
        urls = Urls(self.session_base_url(scenario.id), self.session_url(scenario.id))
        output = self.thread.run(asyncio.wait_for(scenario.agent(urls), 120))
        return output, self.turns.pop(scenario.id, []), self.pop_samples(scenario.id, Sample(prompt="unused"))


@contextmanager
def recorded(url: str, tok: Any, replies: dict[str, tuple[str, ...]] | None = None) -> Iterator[Recorded]:
    """A started `Recorded` gateway, stopped with its loop thread when the block ends."""
    gateway = Recorded(url, tok, replies)
    try:
        gateway.thread.run(gateway.start())
        yield gateway
    finally:
        gateway.thread.run(gateway.stop())
        gateway.thread.close()


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """Qwen2.5 fitted to every scenario's replies in the prompts its framework sends, and why any
    scenario could not be recorded (its test fails with that)."""
    model = model_families.build_family(FAMILY, tmp_path_factory.mktemp("frameworks") / FAMILY)
    tok = AutoTokenizer.from_pretrained(model)
    sequences, failed = {}, {}
    with recorded(UNUSED_URL, tok, {s.id: s.replies for s in SCENARIOS}) as gateway:
        for scenario in SCENARIOS:
            try:
                _, turns, _ = gateway.run(scenario)
            except Exception as exc:  # noqa: BLE001  (reported by the scenario's own test)
                failed[scenario.id] = f"{type(exc).__name__}: {exc}"
                continue
            for t in turns:
                ids = t.prompt_ids + t.completion_ids
                sequences[tuple(ids)] = [0] * len(t.prompt_ids) + [1] * len(t.completion_ids)
    model_families.fit([model], [(list(ids), mask) for ids, mask in sequences.items()])
    return model, failed


@pytest.fixture(scope="module")
def gateway(fitted: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    """One engine on the fitted model and one gateway in front of it, for every scenario."""
    log = tmp_path_factory.mktemp("logs") / "frameworks-engine.log"
    with (
        engine_process(fitted[0], log_path=log) as proc,
        recorded(proc.url, AutoTokenizer.from_pretrained(fitted[0])) as g,
    ):
        yield g


def hf_prompt(tok: Any, turn: Turn) -> list[int]:
    """HF's rendering of what was sent (tool-call arguments as objects, as Qwen2.5's template wants)."""
    messages = []
    for m in turn.messages:
        m = dict(m)
        if isinstance(m.get("content"), list):  # text parts, as the OpenAI SDK may send them
            m["content"] = "".join(p["text"] for p in m["content"])
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        messages.append(m)
    return tok.apply_chat_template(
        messages, tools=turn.tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.id for s in SCENARIOS])
def test_framework_agent_is_one_exact_sample(
    fitted: tuple[Path, dict[str, str]], gateway: Recorded, scenario: Scenario
) -> None:
    assert scenario.id not in fitted[1], fitted[1].get(scenario.id)
    tok = gateway.tok
    output, turns, samples = gateway.run(scenario)

    assert output == scenario.output
    assert [t.completion_ids for t in turns] == [reply_ids(tok, r) for r in scenario.replies]
    for k, t in enumerate(turns):
        assert any(t.params.get(f) is not None for f in GRAMMAR_FIELDS) == (k in scenario.constrained), (k, t.params)
    (s,) = samples
    s.check()
    assert s.metadata["capture"]["how"] == ["start"] + ["continue"] * (len(turns) - 1)
    last = turns[-1]
    assert s.tokens == hf_prompt(tok, last) + last.completion_ids
    mask, logprobs = [0] * len(s.tokens), [0.0] * len(s.tokens)
    for t in turns:
        assert s.tokens[: len(t.prompt_ids)] == t.prompt_ids == hf_prompt(tok, t)
        span = slice(len(t.prompt_ids), len(t.prompt_ids) + len(t.completion_ids))
        mask[span], logprobs[span] = [1] * len(t.completion_ids), t.logprobs
    assert s.prompt_length == len(turns[0].prompt_ids) and s.loss_mask == mask[s.prompt_length :]
    assert s.rollout_logprobs == logprobs[s.prompt_length :]
