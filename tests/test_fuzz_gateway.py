"""Property-based tests of the agent gateway: its three protocols fuzzed from its own
`/openapi.json` (as tests/test_fuzz.py fuzzes the engine and the router), and the trajectory tree
under any sequence of continue / realign / fork.

The fuzz: valid and invalid bodies for OpenAI Chat, OpenAI Responses and Anthropic Messages
(`SLIMISH_GATEWAY_FUZZ_CASES` each, 300 in the suite; the docs' figure is a run at 1,000), sent under one fuzzing session's key (and a few under generated session
URLs) to a real gateway over the session's shared engine. The properties: no 5xx, every JSON reply
parses, and a session opened before the fuzzing is intact after it: its trajectory (tokens, masks,
logprobs) is exactly that of the same conversation held with no fuzzing in between, and the
fuzzing session's own tree still yields valid samples. Turns are kept short by the gateway's
`max_new_tokens` (the run's cap on what an agent asks).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from fuzzing import BOTH, fuzz
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from slimish.formats.model import ModelFormat
from slimish.gateway.server import Gateway
from slimish.gateway.trajectory import Placement, TrajectoryTree
from slimish.loop_thread import LoopThread
from slimish.types import Sample

GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py)
GREEDY = {"temperature": 0.0, "max_new_tokens": 4}
FUZZ_KEY = "fuzzing-session"
CASES = int(os.environ.get("SLIMISH_GATEWAY_FUZZ_CASES", "300"))  # per protocol, valid and invalid halves
PROTOCOLS = {  # each operation's share of its protocol's cases
    "chat": {("POST", "/v1/chat/completions"): 1.0},
    "responses": {("POST", "/v1/responses"): 1.0},
    "messages": {("POST", "/v1/messages"): 0.8, ("POST", "/v1/messages/count_tokens"): 0.2},
}
HELLO = [{"role": "user", "content": "Hello there"}]
# Chat's schema types a message as any object, so its valid cases would never be a conversation:
# half of them get one of these (the other protocols' schemas type their messages).
CONVERSATIONS = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}),
    min_size=1,
    max_size=4,
)


def with_messages(case: schemathesis.Case, messages: list[dict] | None) -> schemathesis.Case:
    if messages is not None and isinstance(case.body, dict):
        case.body["messages"] = messages
    return case


def conversations(path: str, mode: GenerationMode, cases: st.SearchStrategy) -> st.SearchStrategy:
    if path == "/v1/chat/completions" and mode == GenerationMode.POSITIVE:
        return st.builds(with_messages, cases, st.none() | CONVERSATIONS)
    return cases


def fuzz_gateway(url: str, operations: dict[tuple[str, str], float], cases: int, prefix: str = "") -> int:
    """`cases` split among the operations by their shares, each half valid and half invalid, under
    the fuzzing key; how many went out."""
    ops = {op: (max(1, round(cases * share / 2)), BOTH) for op, share in operations.items()}
    return fuzz(url, ops, prefix, {"Authorization": f"Bearer {FUZZ_KEY}"}, conversations)


@pytest.fixture(scope="module")
def gateway(engine: str, tok) -> Iterator[tuple[Gateway, LoopThread]]:
    """A gateway over the shared engine on its own loop thread (the fuzzer's calls are sync)."""
    loop = LoopThread("fuzz-gateway")
    gw = Gateway(engine, ModelFormat(tok), default_sampling=GREEDY)
    loop.run(gw.start())
    try:
        yield gw, loop
    finally:
        loop.run(gw.stop())
        loop.close()


def two_turns(gw: Gateway, session: str, between=lambda: None) -> None:
    """A two-turn conversation in `session`, `between()` run between its turns."""
    url = gw.session_base_url(session) + "/chat/completions"
    first = httpx.post(url, json={"model": "m", "messages": HELLO}, timeout=60)
    assert first.status_code == 200, first.text
    between()
    reply = {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}
    second = httpx.post(
        url, json={"model": "m", "messages": [*HELLO, reply, {"role": "user", "content": "Go on"}]}, timeout=60
    )
    assert second.status_code == 200, second.text


# Most of the time is schemathesis building the bodies of three large schemas: 3,000 cases took
# 74 s alone on 2 cores (2026-12-06), 160-240 s on busy ones.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gateway_protocols_survive_fuzzing_and_sessions_stay_intact(gateway):
    gw, loop = gateway
    template = Sample(prompt=HELLO, group_id=0)

    async def pop(session: str) -> list[Sample]:
        return gw.pop_samples(session, template)

    reference, kept = gw.new_session("reference"), gw.new_session("kept")
    two_turns(gw, reference)
    sent = {}

    def fuzz_all() -> None:
        for name, operations in PROTOCOLS.items():
            sent[name] = fuzz_gateway(gw.url, operations, CASES)
        sent["session urls"] = fuzz_gateway(
            gw.url, {("POST", "/v1/chat/completions"): 1.0}, 20, "/sessions/{session_id}"
        )

    two_turns(gw, kept, fuzz_all)
    print(f"gateway fuzz cases: {sent}, 5xx: 0")
    assert all(n >= CASES for name, n in sent.items() if name in PROTOCOLS), sent
    (want,), (got,) = loop.run(pop(reference)), loop.run(pop(kept))
    assert got.metadata["capture"]["how"] == ["start", "continue"]
    assert (got.tokens, got.loss_mask, got.rollout_logprobs) == (want.tokens, want.loss_mask, want.rollout_logprobs)
    for s in loop.run(pop(FUZZ_KEY)):  # the fuzzing session's own turns still make valid samples
        s.check()


# ---- the trajectory tree under any sequence of continue / realign / fork ------------------------

WORDS = st.text(alphabet="abc xyz!", min_size=1, max_size=10)
STEPS = st.lists(
    st.tuples(st.sampled_from(["continue", "realign", "fork"]), st.integers(0, 99), WORDS, WORDS, st.booleans()),
    min_size=1,
    max_size=10,
)


def test_trajectory_tree_trains_each_token_at_most_once(tok):
    """Whatever an agent does (continue a turn, send a reply back changed, start over, branch from
    any turn), every mask-1 token of the samples is one the model generated, at its place in its
    turn, trained once; and every generated token some sample keeps in context is trained."""
    chat, seen = ModelFormat(tok).chat(), set()

    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(history=st.sampled_from(["exact", "template"]), steps=STEPS)
    def run(history: str, steps: list[tuple[str, int, str, str, bool]]) -> None:
        tree = TrajectoryTree(history, realign_tokens=8)
        for kind, pick, user, text, truncated in steps:
            messages = [{"role": "user", "content": user}]
            if kind != "fork" and tree.turns:
                turn = tree.turns[pick % len(tree.turns)]
                reply = turn.reply if kind == "continue" else {**turn.reply, "content": turn.reply["content"] + "!"}
                messages = [*turn.messages, reply, {"role": "user", "content": user}]
            at = tree.place(messages, "", chat)
            seen.add(at.how)
            reply = {"role": "assistant", "content": text}
            ids = chat.assistant_ids(messages, reply)[: -1 if truncated else None]
            t = len(tree.turns)
            tree.add(
                at, messages, reply, "", ids, [-(t * 1000 + j + 1.0) for j in range(len(ids))], [0] * len(ids), "stop"
            )
        trained = []
        for s in tree.samples(Sample(prompt="p"), {}):
            for i, (m, lp) in enumerate(zip(s.loss_mask, s.rollout_logprobs)):
                if m:
                    t, j = divmod(int(-lp) - 1, 1000)
                    assert s.tokens[s.prompt_length + i] == tree.turns[t].completion_ids[j]
                    trained.append((t, j))
        kept = {
            (t, j)
            for t, turn in enumerate(tree.turns)
            for j in range(max((c.keep for c in turn.children), default=len(turn.completion_ids)))
        }
        assert len(trained) == len(set(trained)) and set(trained) == kept

    run()
    assert seen >= {"start", "continue", "realign", "fork"}, seen


def test_a_fork_in_a_deep_tree_names_the_turn_without_comparing_turns(tok):
    """Found by the fuzz (a 500): a fork's reason named a turn by `turns.index`, which compared
    turns by value, recursing through their parents: two equal chains of 1,200 turns overflowed the
    stack. Turns are compared by identity, so the reason names the newest turn, not its twin."""
    chat, tree = ModelFormat(tok).chat(), TrajectoryTree(realign_tokens=0)
    hello = [{"role": "user", "content": "hi"}]
    ids = chat.assistant_ids(hello, {"role": "assistant", "content": "hello"})
    for _ in range(2):
        parent = None
        for _ in range(1200):
            at = Placement(parent, len(ids), [], chat.prompt_ids(hello), "continue")
            parent = tree.add(
                at, hello, {"role": "assistant", "content": "hello"}, "", ids, [0.0] * len(ids), [], "stop"
            )
    changed = [*hello, {"role": "assistant", "content": "bye"}, *hello]
    at = tree.place(changed, "", chat)
    assert at.how == "fork" and at.reason.startswith("reply 2399 came back changed"), at.reason


def test_a_repetition_penalty_past_sglangs_bound_is_a_400(gateway):
    """Found by the fuzz (a 500 from the engine): a huge repetition penalty with a huge temperature
    made a logprob non-finite, which JSON cannot carry. SGLang bounds the penalty to (0, 2]
    (sglang 0.5.23: python/sglang/srt/sampling/sampling_params.py:275): so does the protocol."""
    gw, _ = gateway
    body = {"messages": [{"role": "system", "content": ""}], "temperature": 3.4e38, "repetition_penalty": 3.4e38}
    r = httpx.post(gw.session_base_url("penalty") + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
