"""Gateway sessions as credentials: ids of 128 random bits, one session's key never reaching
another's trajectory (by any of the three protocols, nor through a stored Responses id), idle
sessions forgotten and their memory freed, live sessions and their token ids bounded by a 429
naming the limit. A real gateway in front of the session's shared engine."""

from __future__ import annotations

import base64
import gc
import weakref

import httpx
import pytest
from helpers import with_gateway

from slimish.config import load_run_config
from slimish.formats.model import ModelFormat
from slimish.gateway.config import GatewayConfig
from slimish.gateway.server import Gateway
from slimish.types import Sample

GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py)
GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
HELLO = [{"role": "user", "content": "Hello there"}]
TEMPLATE = Sample(prompt=HELLO, group_id=1)


def chat(http: httpx.AsyncClient, gateway: Gateway, key: str, messages: list[dict]):
    return http.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "m", "messages": messages},
        headers={"Authorization": f"Bearer {key}"},
    )


def test_session_ids_carry_128_random_bits(tok):
    gateway = Gateway("http://127.0.0.1:1", ModelFormat(tok))
    ids = [gateway.new_session("7-2") for _ in range(1000)]
    assert len(set(ids)) == 1000 and set(gateway.sessions) == set(ids)
    for session_id in ids:
        label, secret = session_id.split("-", 2)[:2], session_id.split("-", 2)[2]
        assert label == ["7", "2"] and len(base64.urlsafe_b64decode(secret + "==")) == 16  # 128 bits


def test_one_sessions_key_never_touches_anothers_trajectory(engine, tok):
    """B's exact continuation sent with A's key, by each protocol (and B's stored response named
    under A's key) lands in A or is refused: B's tree is untouched, and continues as if alone."""

    async def body(gateway: Gateway):
        a, b = gateway.new_session("a"), gateway.new_session("b")
        async with httpx.AsyncClient(timeout=60) as http:
            first = (await chat(http, gateway, b, HELLO)).json()["choices"][0]["message"]
            stored = await http.post(
                gateway.url + "/v1/responses", json={"model": "m", "input": "Hi"}, headers={"x-api-key": b}
            )
            b_turns = [t.ids for t in gateway.sessions[b].turns]
            reply = {"role": "assistant", "content": first["content"]}
            more = [*HELLO, reply, {"role": "user", "content": "More"}]
            as_a = [
                await chat(http, gateway, a, more),
                await http.post(
                    gateway.url + "/v1/responses", json={"model": "m", "input": more}, headers={"x-api-key": a}
                ),
                await http.post(
                    gateway.url + "/v1/messages",
                    json={"model": "m", "max_tokens": 4, "messages": [*HELLO, reply, more[-1]]},
                    headers={"x-api-key": a},
                ),
            ]
            theft = await http.post(
                gateway.session_base_url(a) + "/responses",
                json={"model": "m", "input": "go on", "previous_response_id": stored.json()["id"]},
            )
            assert [t.ids for t in gateway.sessions[b].turns] == b_turns
            assert [t.how for t in gateway.sessions[a].turns] == ["start", "fork", "fork"]
            again = await chat(http, gateway, b, more)
        return as_a, theft, again, gateway.pop_samples(a, TEMPLATE), gateway.pop_samples(b, TEMPLATE)

    as_a, theft, again, samples_a, samples_b = with_gateway(engine, tok, body, default_sampling=GREEDY)
    assert [r.status_code for r in as_a] == [200, 200, 200] and again.status_code == 200, [r.text for r in as_a]
    assert theft.status_code == 400 and theft.json()["error"]["param"] == "previous_response_id", theft.text
    assert [s.metadata["capture"]["how"] for s in samples_b] == [["fork"], ["start", "continue"]]
    assert [s.metadata["capture"]["how"] for s in samples_a] == [["start"], ["fork"], ["fork"]]
    assert {s.metadata["capture"]["session"] for s in samples_a}.isdisjoint(
        s.metadata["capture"]["session"] for s in samples_b
    )


def test_idle_sessions_expire_and_free_their_memory(engine, tok):
    async def body(gateway: Gateway):
        now = [0.0]
        gateway.clock = lambda: now[0]
        idle, busy = gateway.new_session(), gateway.new_session()
        async with httpx.AsyncClient(timeout=60) as http:
            for key in (idle, busy):
                assert (await chat(http, gateway, key, HELLO)).status_code == 200
            stored = await http.post(gateway.session_base_url(idle) + "/responses", json={"model": "m", "input": "Hi"})
            tree = weakref.ref(gateway.sessions[idle])
            idle_held = gateway.sessions[idle].held
            now[0] = 50.0
            assert (await chat(http, gateway, busy, HELLO)).status_code == 200  # busy used at t=50
            assert idle in gateway.sessions  # 50 s idle < 60
            now[0] = 70.0
            busy_held = gateway.sessions[busy].held
            late = await http.post(
                gateway.session_base_url(idle) + "/responses",
                json={"model": "m", "input": "go on", "previous_response_id": stored.json()["id"]},
            )
        gc.collect()
        return late, tree, idle_held, busy_held, list(gateway.sessions), gateway.held, busy

    late, tree, idle_held, busy_held, live, held_after, busy = with_gateway(
        engine, tok, body, default_sampling=GREEDY, limits=GatewayConfig(session_idle_s=60.0)
    )
    # At t=70 the idle session (last used at 0) is forgotten, its stored response with it; the
    # busy one (used at 50) is not.
    assert late.status_code == 400 and late.json()["error"]["param"] == "previous_response_id", late.text
    assert tree() is None and idle_held > 0
    assert live == [busy] and held_after == busy_held


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_live_sessions_and_their_tokens_are_bounded_with_a_429(engine, tok, protocol):
    path, shape = {
        "chat": ("/v1/chat/completions", {"messages": HELLO}),
        "responses": ("/v1/responses", {"input": HELLO}),
        "messages": ("/v1/messages", {"messages": HELLO, "max_tokens": 4}),
    }[protocol]

    def message(r: httpx.Response) -> str:
        return r.json()["error"]["message"]

    async def body(gateway: Gateway):
        async with httpx.AsyncClient(timeout=60) as http:

            def post(session: str) -> httpx.Request:
                return http.post(gateway.session_url(session) + path, json={"model": "m", **shape})

            first = await post("one")
            full = gateway.sessions["one"].held
            crowded = await post("two")  # a second session: over max_sessions=1
            gateway.pop_samples("one", TEMPLATE)  # collected: its room is free again
            second = await post("two")
            over = await post("two")  # its second turn would hold twice the tokens: over max_tokens
            return first, full, crowded, second, over

    prompt = len(ModelFormat(tok).chat().prompt_ids(HELLO))
    limit = 2 * prompt + 3  # one turn (prompt + 4) fits; a second prompt beside it does not
    first, full, crowded, second, over = with_gateway(
        engine, tok, body, default_sampling=GREEDY, limits=GatewayConfig(max_sessions=1, max_tokens=limit)
    )
    assert first.status_code == 200 and second.status_code == 200 and full == prompt + 4, (first.text, full)
    assert crowded.status_code == 429 and "gateway.max_sessions" in message(crowded), crowded.text
    assert over.status_code == 429 and f"gateway.max_tokens ({limit})" in message(over), over.text


def test_gateway_limits_are_checked_by_the_schema():
    assert load_run_config(None, ["model=m", "data.source=d.jsonl"]).gateway == GatewayConfig()
    with pytest.raises(SystemExit, match="gateway.max_sessions must be >= 1"):
        load_run_config(None, ["model=m", "data.source=d.jsonl", "gateway.max_sessions=0"])
    with pytest.raises(SystemExit, match="gateway.session_idle_s must be > 0"):
        load_run_config(None, ["model=m", "data.source=d.jsonl", "gateway.session_idle_s=0"])
