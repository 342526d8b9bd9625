"""Routing policies and request gating as pure functions (no servers): exact picks."""

from __future__ import annotations

import pytest

from slimish.router.config import RouterConfig
from slimish.router.gate import apply_cap, prompt_of
from slimish.router.policy import CacheAware, LeastInflight, RoundRobin, RouteInfo, Session
from slimish.router.proxy import RouterError
from slimish.router.workers import Worker, normalize_url


def pool(*loads: int) -> list[Worker]:
    return [Worker(f"http://127.0.0.1:{9000 + i}", id=f"w{i}", inflight=n) for i, n in enumerate(loads)]


def test_round_robin_cycles_in_order():
    ws, rr = pool(0, 0, 0), RoundRobin()
    assert [rr.pick(ws, RouteInfo()).id for _ in range(7)] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


def test_least_inflight_takes_the_idlest_and_rotates_ties():
    li = LeastInflight()
    assert {li.pick(pool(3, 0, 5), RouteInfo()).id for _ in range(5)} == {"w1"}
    assert [li.pick(pool(1, 1), RouteInfo()).id for _ in range(4)] == ["w1", "w0", "w1", "w0"]


def test_cache_aware_follows_the_prefix_unless_unbalanced():
    cfg = RouterConfig(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_block_size=4)
    ca, ws = CacheAware(cfg), pool(0, 0)
    a, b = list(range(100, 140)), list(range(500, 540))
    first_a = ca.pick(ws, RouteInfo(a + [1, 2])).id
    first_b = ca.pick(ws, RouteInfo(b + [1])).id
    assert first_a != first_b  # no match: least loaded, ties rotate
    assert [ca.pick(ws, RouteInfo(a + [i])).id for i in range(5)] == [first_a] * 5
    assert [ca.pick(ws, RouteInfo(b + [i, i])).id for i in range(5)] == [first_b] * 5
    # Text prompts are keyed the same way, by characters.
    t = "You are a helpful assistant. " * 4
    owner = ca.pick(ws, RouteInfo(t + "Q1")).id
    assert ca.pick(ws, RouteInfo(t + "Q2, longer")).id == owner
    # Unbalanced (10 vs 0: more than 4 apart and more than 1.5x): the idle worker takes it.
    busy = {"w0": 10, "w1": 0}
    ws = [Worker(w.url, id=w.id, inflight=busy[w.id]) for w in ws]
    assert ca.pick(ws, RouteInfo(a + [9])).id == "w1"


def test_cache_aware_below_threshold_goes_to_least_loaded():
    ca = CacheAware(RouterConfig(cache_block_size=4, cache_threshold=0.5))
    ca.pick(pool(0, 5), RouteInfo(list(range(8))))  # w0 now owns the 2 blocks of this prompt
    # 2 of 6 blocks match (< 0.5): the least loaded worker (w1) takes it, not the owner.
    assert ca.pick(pool(3, 0), RouteInfo(list(range(8)) + list(range(50, 66)))).id == "w1"


def test_session_sticks_repins_and_falls_back():
    s = Session(RouterConfig())
    ws = pool(0, 0)
    pinned = s.pick(ws, RouteInfo(routing_key="agent-1")).id
    other = s.pick(ws, RouteInfo(routing_key="agent-2")).id
    assert pinned != other
    loaded = [Worker(w.url, id=w.id, inflight=50 if w.id == pinned else 0) for w in ws]
    assert [s.pick(loaded, RouteInfo(routing_key="agent-1")).id for _ in range(3)] == [pinned] * 3
    survivors = [w for w in ws if w.id != pinned]
    assert s.pick(survivors, RouteInfo(routing_key="agent-1")).id == other  # re-pinned
    assert s.pick(ws, RouteInfo(routing_key="agent-1")).id == other  # and stays there
    assert s.pick(pool(4, 0), RouteInfo()).id == "w1"  # no key: least in-flight


def test_with_several_processes_session_and_cache_aware_are_pure_functions():
    """`--processes N`: two independent policy instances (two processes) agree, whatever the order
    of the list, the load or what else they routed; a key moves only when its worker leaves."""
    cfg = RouterConfig(processes=2)
    ws = pool(0, 0, 0, 0)
    keys = [f"agent-{i}" for i in range(32)]
    first, second = Session(cfg), Session(cfg)
    picks = {k: first.pick(ws, RouteInfo(routing_key=k)).id for k in keys}
    busy = [Worker(w.url, id=w.id, inflight=9 * i) for i, w in enumerate(reversed(ws))]
    assert {k: second.pick(busy, RouteInfo(routing_key=k)).id for k in keys} == picks
    assert set(picks.values()) == {w.id for w in ws}  # 32 keys spread over all 4
    survivors = [w for w in ws if w.id != "w0"]
    moved = {k: first.pick(survivors, RouteInfo(routing_key=k)).id for k in keys}
    assert all(moved[k] == picks[k] for k in keys if picks[k] != "w0")
    a, b = CacheAware(cfg), CacheAware(cfg)
    b.pick(ws, RouteInfo(prompt=list(range(64))))  # b has seen another prompt, a nothing
    for prompt in ([1] * 40, "a system prompt " * 8):
        assert a.pick(ws, RouteInfo(prompt=prompt)).id == b.pick(list(reversed(ws)), RouteInfo(prompt=prompt)).id


def test_cap_rejects_naming_the_limit_and_fills_defaults():
    with pytest.raises(RouterError, match=r"sampling_params\.max_new_tokens is 500; this router allows at most 100"):
        apply_cap("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 500}}, 100)
    with pytest.raises(RouterError, match=r"sampling_params\[1\]\.max_new_tokens is 101"):
        apply_cap(
            "/generate",
            {"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 101}]},
            100,
        )
    with pytest.raises(RouterError, match="max_tokens is 64"):
        apply_cap("/v1/chat/completions", {"messages": [], "max_tokens": 64}, 32)
    body = {"text": "x"}
    assert apply_cap("/generate", body, 100) and body["sampling_params"] == {"max_new_tokens": 100}  # default 128 > cap
    body = {"text": "x"}
    assert not apply_cap("/generate", body, 1000) and body == {"text": "x"}  # default 128 fits: untouched
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert apply_cap("/v1/chat/completions", body, 50) and body["max_tokens"] == 50
    body = {"prompt": "x", "max_tokens": 8}
    assert not apply_cap("/v1/completions", body, 50) and body["max_tokens"] == 8


def test_prompt_of_each_route():
    assert prompt_of("/generate", {"input_ids": [[1, 2], [3]]}) == [1, 2]
    assert prompt_of("/generate", {"text": "abc"}) == "abc"
    assert prompt_of("/generate", {"input_ids": [1, "x"]}) is None
    assert prompt_of("/v1/completions", {"prompt": ["p", "q"]}) == "p"
    chat = prompt_of("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    longer = prompt_of(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    )
    assert longer.startswith(chat)  # a conversation's key extends its earlier turns' keys


@pytest.mark.parametrize("bad", ["127.0.0.1:8000", "http://127.0.0.1", "ftp://h:1", "http://h:1/generate", 7])
def test_worker_url_must_be_scheme_host_port(bad):
    with pytest.raises(ValueError, match="url: expected"):
        normalize_url(bad)
    assert normalize_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
