"""Interop both ways: two built-in engines behind the real sglang-router 0.3.2 (docs/protocol.md 5),
and the slimish router in front of the same engines.

The router is the one slimish uses on clusters, so this checks on loopback that our engine is a
worker it accepts: it registers through the 0.3.x `POST /workers` API, balances round-robin,
re-serialises our `/generate` bodies without losing the sampling keys RL relies on, passes
streams through, and fans `/flush_cache` out to every engine.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from helpers import generate, metric_total, post, running_engines

from slimish.client import Client
from slimish.net import free_port

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[5, 17, 42, 99, 7], [300, 301, 302], list(range(60, 90))]


def wait_for(what: str, ok: Callable[[], bool], proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll `ok()` until true; failing, say what was awaited and show the router's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if ok():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    state = f"router exited with {proc.returncode}" if proc.poll() is not None else f"not within {timeout:.0f}s"
    raise RuntimeError(f"{what}: {state}; router log tail:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory) -> list[str]:
    with running_engines(tiny_model_dir, tmp_path_factory, max_running_requests=8) as procs:
        yield [p.url for p in procs]


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory) -> str:
    """A router started with no workers; the engines join through `POST /workers`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("router-log") / "router.log"
    argv = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "info",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for("router /health", lambda: httpx.get(url + "/health", timeout=2).status_code == 200, proc, log, 60)
        for e in engines:
            r = httpx.post(url + "/workers", json={"url": e}, timeout=10)
            assert r.status_code == 202, r.text
            assert r.json()["status"] == "accepted" and r.json()["url"] == e

        def all_healthy() -> bool:
            workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
            return sorted(w["url"] for w in workers if w["is_healthy"]) == sorted(engines)

        wait_for("both engines healthy in GET /workers", all_healthy, proc, log, 30)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def requests_finished(engine: str) -> float:
    """The engine's `sglang:num_requests_total` counter (one per generated sequence)."""
    return metric_total(engine, "sglang:num_requests_total")


def test_workers_listed_with_engine_metadata(router, engines, tiny_model_dir):
    body = httpx.get(router + "/workers", timeout=10).json()
    assert body["total"] == 2
    for w in body["workers"]:
        assert w["worker_type"] == "regular" and w["connection_mode"] == "HTTP"
        assert w["model_id"] == str(Path(tiny_model_dir).resolve())
        assert w["metadata"]["model_path"] == str(Path(tiny_model_dir).resolve())
        assert (w["metadata"]["tp_size"], w["metadata"]["dp_size"]) == ("1", "1")
    ready = httpx.get(router + "/readiness", timeout=10).json()
    assert ready == {"status": "ready", "healthy_workers": 2, "total_workers": 2}


def test_round_robin_alternates_engines(router, engines):
    before = [requests_finished(e) for e in engines]
    for prompt in PROMPTS + PROMPTS[:1]:
        generate(router, input_ids=prompt, sampling_params=GREEDY)
    after = [requests_finished(e) for e in engines]
    assert [a - b for a, b in zip(after, before)] == [2, 2]


def test_single_with_logprobs_equals_direct(router, engines):
    body = {"input_ids": PROMPTS[2], "sampling_params": GREEDY, "return_logprob": True}
    direct = generate(engines[0], **body)
    for _ in engines:  # round robin: one call lands on each engine
        out = generate(router, **body)
        assert out["output_ids"] == direct["output_ids"]
        lps = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == out["output_ids"]
        assert [lp for lp, _, _ in lps] == pytest.approx(
            [lp for lp, _, _ in direct["meta_info"]["output_token_logprobs"]], abs=1e-5
        )
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_seeded_sampling_params_survive_reserialisation(router, engines):
    """The router drops sampling keys it does not know; these must all reach the engine."""
    params = {
        "temperature": 0.9,
        "top_k": 50,
        "top_p": 0.95,
        "min_p": 0.01,
        "max_new_tokens": 10,
        "ignore_eos": True,
        "sampling_seed": 7,
    }
    direct = generate(engines[1], input_ids=PROMPTS[0], sampling_params=params)
    out = generate(router, input_ids=PROMPTS[0], sampling_params=params)
    assert out["output_ids"] == direct["output_ids"]
    assert len(out["output_ids"]) == 10


def test_batch_input_ids_in_order(router, engines):
    direct = [generate(engines[0], input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    out = generate(router, input_ids=PROMPTS, sampling_params=GREEDY)
    assert isinstance(out, list) and [o["output_ids"] for o in out] == direct
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(p) for p in PROMPTS]


def test_n_copies(router, engines):
    direct = generate(engines[0], input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
    out = generate(router, input_ids=PROMPTS[1], sampling_params={**GREEDY, "n": 3})
    assert [o["output_ids"] for o in out] == [direct] * 3


def test_streaming_passes_through(router, engines):
    direct = generate(engines[0], input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]

    async def chunks() -> list:
        async with Client(router) as c:
            return [ch async for ch in c.generate_stream(input_ids=PROMPTS[0], sampling_params=GREEDY)]

    got = asyncio.run(chunks())
    assert [len(ch.output_ids) for ch in got] == list(range(1, 13))  # cumulative, one per token
    assert got[-1].output_ids == direct
    assert [ch.meta_info.finish_reason is None for ch in got] == [True] * 11 + [False]


def test_flush_cache_fans_out(router, engines):
    r = post(router, "/flush_cache")
    assert r.status_code == 200, r.text
    assert (r.json()["status"], r.json()["workers_flushed"]) == ("success", 2)
    # An engine refuses to flush while it generates, so a fan-out that reached it reports it failed.
    with httpx.stream(
        "POST",
        engines[0] + "/generate",
        timeout=60,
        json={
            "input_ids": PROMPTS[0],
            "rid": "busy",
            "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        },
    ) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")  # it runs now
        try:
            r = post(router, "/flush_cache")
        finally:
            assert post(engines[0], "/abort_request", {"rid": "busy"}).status_code == 200
        list(lines)
    assert r.status_code == 206, r.text
    body = r.json()
    assert (body["status"], body["workers_flushed"], body["successful"]) == ("partial_success", 1, [engines[1]])
    assert [f["worker"] for f in body["failed"]] == [engines[0]]


def test_chat_completions_forwarded(router, engines):
    body = {
        "model": httpx.get(engines[0] + "/v1/models", timeout=10).json()["data"][0]["id"],
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    direct = post(engines[0], "/v1/chat/completions", body)
    if direct.status_code == 404:
        pytest.skip("the engine serves no /v1/chat/completions yet (slimish/engine/openai_api.py)")
    assert direct.status_code == 200, direct.text
    out = post(router, "/v1/chat/completions", body)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["message"]["content"] == direct.json()["choices"][0]["message"]["content"]
    assert out.json()["usage"]["completion_tokens"] == direct.json()["usage"]["completion_tokens"]


def test_slimish_router_in_front_of_the_same_engines(router, engines, tmp_path_factory):
    """The other direction: slimish's router over the engines sglang-router also serves; the two
    routers return the same greedy tokens and logprobs."""
    from slimish.processes import ServerProcess

    port = free_port()
    log = tmp_path_factory.mktemp("slimish-router-log") / "router.log"
    with ServerProcess(
        ["router", "--port", str(port), "--policy", "round_robin", "--worker-urls", *engines], port=port, log_path=log
    ) as ours:
        for prompt in PROMPTS:
            body = {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True}
            a, b = generate(ours.url, **body), generate(router, **body)
            assert a["output_ids"] == b["output_ids"]
            assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
        workers = httpx.get(ours.url + "/workers", timeout=10).json()["workers"]
        assert sorted(w["url"] for w in workers) == sorted(engines)
