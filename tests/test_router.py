"""The slimish router in front of two real built-in engines: policies, streaming, retries on a
killed engine, registry, fan-out, keys, limits, metrics, and the openai SDK as a client.

The router runs in this process on a real port (its own event loop in a thread), one per test with the
settings it needs; the engines are real child processes shared by the module. Which worker
served a reply is read from the router's `x-slimish-worker` header.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import generate, generate_response, running_engines, running_router, wait_for

from slimish.launch.local import engine_process
from slimish.net import free_port
from slimish.protocol import ROUTING_KEY_HEADER
from slimish.router.proxy import WORKER_HEADER

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    with running_engines(tiny_model_dir, tmp_path_factory, max_running_requests=16) as procs:
        yield procs


@pytest.fixture(scope="module")
def urls(engines) -> list[str]:
    return [p.url for p in engines]


def loads(router: str) -> dict[str, int]:
    return {w["worker"]: w["load"] for w in httpx.get(router + "/get_loads").json()["workers"]}


def worker_states(router: str, key: str | None = None) -> dict[str, bool]:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return {w["url"]: w["is_healthy"] for w in httpx.get(router + "/workers", headers=headers).json()["workers"]}


# ---- policies ------------------------------------------------------------------------------


def test_round_robin_alternates_and_forwards_exactly(urls):
    direct = httpx.post(urls[0] + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    with running_router(worker_urls=urls, policy="round_robin") as router:
        replies = [generate_response(router, input_ids=PROMPT, sampling_params=GREEDY) for _ in range(6)]
    served = [r.headers[WORKER_HEADER] for r in replies]
    assert served == [urls[0], urls[1]] * 3
    assert all(r.json()["output_ids"] == direct["output_ids"] for r in replies)


def test_least_inflight_prefers_the_idle_worker(urls):
    with running_router(worker_urls=urls, policy="least_inflight") as router:
        long = {"input_ids": PROMPT, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 1500}}
        with httpx.stream("POST", router + "/generate", json=long, timeout=60) as stream:
            busy = stream.headers[WORKER_HEADER]
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            assert next(lines).startswith("data: ")  # generating now
            assert loads(router)[busy] == 1
            served = {
                generate_response(router, input_ids=PROMPT, sampling_params=GREEDY).headers[WORKER_HEADER]
                for _ in range(4)
            }
            assert served == set(urls) - {busy}
        # The client left: the router drops the upstream stream and its in-flight count.
        wait_for(lambda: loads(router)[busy] == 0, "the busy worker's load to return to 0")


def test_session_sticks_across_turns_and_repins_when_removed(urls):
    admin = {"Authorization": "Bearer adm"}
    with running_router(worker_urls=urls, policy="session", admin_api_key="adm") as router:
        pinned = {}
        for agent in ("agent-a", "agent-b"):
            ids, seen = list(PROMPT), set()
            for _ in range(4):  # a multi-turn conversation: each turn extends the last one's tokens
                r = generate_response(
                    router,
                    headers={ROUTING_KEY_HEADER: agent},
                    input_ids=ids,
                    sampling_params={**GREEDY, "max_new_tokens": 3},
                )
                seen.add(r.headers[WORKER_HEADER])
                ids += r.json()["output_ids"] + [11]
            assert len(seen) == 1, f"{agent} moved between workers: {seen}"
            pinned[agent] = seen.pop()
        assert pinned["agent-a"] != pinned["agent-b"]  # new keys spread by load
        gone = pinned["agent-a"]
        assert httpx.delete(f"{router}/workers/{gone}", headers=admin).status_code == 202
        for _ in range(2):
            r = generate_response(
                router, headers={ROUTING_KEY_HEADER: "agent-a"}, input_ids=PROMPT, sampling_params=GREEDY
            )
            assert r.headers[WORKER_HEADER] == pinned["agent-b"]


def test_cache_aware_keeps_a_shared_prefix_on_one_worker(urls):
    with running_router(worker_urls=urls, policy="cache_aware", cache_block_size=4) as router:
        owners = {}
        for name, prefix in (("a", list(range(100, 140))), ("b", list(range(600, 640)))):
            served = {
                generate_response(
                    router, input_ids=prefix + [i, i + 1], sampling_params={**GREEDY, "max_new_tokens": 2}
                ).headers[WORKER_HEADER]
                for i in range(5)
            }
            assert len(served) == 1, f"prefix {name} spread over {served}"
            owners[name] = served.pop()
        assert owners["a"] != owners["b"]  # an unseen prefix goes to the least loaded (ties rotate)


# ---- pass-through --------------------------------------------------------------------------


def test_streaming_batch_and_n_pass_through(urls):
    direct_stream = httpx.post(
        urls[1] + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "stream": True}
    )
    with running_router(worker_urls=urls) as router:
        with httpx.stream(
            "POST", router + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "stream": True}
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line]
        batch = {"input_ids": [PROMPT, [300, 301, 302]], "sampling_params": GREEDY}
        routed = generate(router, **batch)
        direct = httpx.post(urls[0] + "/generate", json=batch).json()
        assert [item["output_ids"] for item in routed] == [item["output_ids"] for item in direct]
        n2 = generate(router, input_ids=PROMPT, sampling_params={**GREEDY, "n": 2})
    expected = [line for line in direct_stream.text.split("\n") if line]
    assert events[-1] == "data: [DONE]" and len(events) == len(expected)
    assert _final_ids(events) == _final_ids(expected)
    assert [item["output_ids"] for item in n2] == [_final_ids(expected)] * 2


def _final_ids(events: list[str]) -> list[int]:
    return json.loads(events[-2].removeprefix("data: "))["output_ids"]


# ---- a worker dies mid-run -------------------------------------------------------------------


def test_killed_worker_is_retried_marked_unhealthy_and_comes_back(urls, engines, tiny_model_dir, tmp_path):
    # Long enough (about a second each) that all 7 are still running when the loads are read: at
    # 200 tokens a request could end before the last was dispatched, and the wait below timed out.
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 1000}}
    expected = httpx.post(urls[0] + "/generate", json=body, timeout=60).json()["output_ids"]
    with running_router(worker_urls=urls, policy="round_robin", max_retries=2) as router:
        stream = httpx.Client(timeout=60).send(
            httpx.Request("POST", router + "/generate", json={**body, "stream": True}), stream=True
        )
        victim_url = stream.headers[WORKER_HEADER]
        victim = next(p for p in engines if p.url == victim_url)
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(httpx.post, router + "/generate", json=body, timeout=60) for _ in range(6)]
            # All dispatched (the stream and 3 of 6 on the victim) before the kill, so each failed one
            # is retried exactly once.
            survivor_url = next(u for u in urls if u != victim_url)
            wait_for(lambda: loads(router) == {victim_url: 4, survivor_url: 3}, "all requests in flight")
            victim.kill()
            replies = [f.result() for f in futures]
        # Every non-streamed request succeeded, those on the victim after a retry elsewhere.
        assert [r.status_code for r in replies] == [200] * 6
        assert all(r.json()["output_ids"] == expected for r in replies)
        assert {r.headers[WORKER_HEADER] for r in replies} == set(urls) - {victim_url}
        # The stream had already started: it ends with an error event naming the worker.
        tail = [line for line in stream.iter_lines() if line][-2:]
        stream.close()
        assert victim_url in tail[0] and '"error"' in tail[0] and tail[1] == "data: [DONE]"
        metrics = httpx.get(router + "/metrics").text
        assert f'slimish_router_retries_total{{worker="{victim_url}"}} 3.0' in metrics
        wait_for(lambda: worker_states(router)[victim_url] is False, "the victim to be marked unhealthy")
        assert f'slimish_router_worker_healthy{{worker="{victim_url}"}} 0.0' in httpx.get(router + "/metrics").text

        restarted = engine_process(
            tiny_model_dir, port=victim.port, log_path=tmp_path / "restarted.log", max_running_requests=16
        )
        engines[engines.index(victim)] = restarted.start()
        wait_for(lambda: worker_states(router)[victim_url], "the restarted worker to be healthy again")
        served = [generate_response(router, **body).headers[WORKER_HEADER] for _ in range(2)]
        assert sorted(served) == sorted(urls)


def test_errors_name_the_worker_and_the_cause(urls):
    dead = f"http://127.0.0.1:{free_port()}"
    with running_router(worker_urls=[dead]) as router:
        r = httpx.post(router + "/generate", json={"input_ids": PROMPT})
        assert (
            r.status_code == 503
            and dead in r.json()["error"]["message"]
            and "cannot connect" in r.json()["error"]["message"]
        )
        assert httpx.get(router + "/readiness").json() == {
            "status": "not_ready",
            "healthy_workers": 0,
            "total_workers": 1,
        }
    with running_router(worker_urls=urls[:1], request_timeout=0.3) as router:
        r = httpx.post(
            router + "/generate", json={"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 1500}}
        )
        assert r.status_code == 504, r.text
        assert urls[0] in r.json()["error"]["message"] and "--request-timeout" in r.json()["error"]["message"]
        assert httpx.get(router + "/readiness").json()["status"] == "ready"


# ---- registry, control fan-out, keys, limits, metrics -------------------------------------


def test_worker_registry_current_and_legacy_shapes(urls):
    key = {"Authorization": "Bearer adm"}
    with running_router(worker_urls=urls[:1], admin_api_key="adm") as router:
        listing = httpx.get(router + "/workers", headers=key).json()
        assert listing["total"] == 1 and listing["workers"][0]["url"] == urls[0] and listing["workers"][0]["is_healthy"]
        assert listing["workers"][0]["metadata"]["tp_size"] == 1
        added = httpx.post(router + "/workers", json={"url": urls[1]}, headers=key)
        assert added.status_code == 202 and added.json()["status"] == "accepted"
        wait_for(
            lambda: worker_states(router, "adm") == {urls[0]: True, urls[1]: True}, "the added worker to be healthy"
        )
        assert httpx.post(router + "/workers", json={"url": urls[1]}, headers=key).status_code == 409
        bad = httpx.post(router + "/workers", json={"url": "localhost"}, headers=key)
        assert bad.status_code == 400 and "url: expected" in bad.json()["error"]["message"]
        worker_id = added.json()["worker_id"]
        assert httpx.get(f"{router}/workers/{worker_id}", headers=key).json()["url"] == urls[1]
        assert httpx.delete(f"{router}/workers/{worker_id}", headers=key).status_code == 202
        assert httpx.get(f"{router}/workers/{worker_id}", headers=key).status_code == 404
        # Legacy (sglang-router 0.1/0.2, slime): query-string add/remove, {"urls": [...]}.
        assert httpx.post(f"{router}/add_worker", params={"url": urls[1]}, headers=key).status_code == 200
        assert httpx.get(router + "/list_workers", headers=key).json() == {"urls": urls}
        assert httpx.post(f"{router}/remove_worker", params={"url": urls[1]}, headers=key).status_code == 200
        assert httpx.get(router + "/list_workers", headers=key).json() == {"urls": urls[:1]}


def test_control_fans_out_to_every_worker(urls):
    with running_router(worker_urls=urls) as router:
        for path, body in (
            ("/pause_generation", {"mode": "in_place"}),
            ("/continue_generation", {}),
            ("/abort_request", {"abort_all": True}),
        ):
            r = httpx.post(router + path, json=body)
            assert r.status_code == 200 and r.json()["success"], r.text
            assert sorted(w["url"] for w in r.json()["workers"]) == sorted(urls)
            assert all(w["success"] and w["status_code"] == 200 for w in r.json()["workers"])
        flushed = httpx.post(router + "/flush_cache").json()
        assert [w["body"].startswith("Cache flushed") for w in flushed["workers"]] == [True, True]
        generate(router, input_ids=PROMPT, sampling_params=GREEDY)  # still serving after the round trip


def test_every_engine_admin_route_goes_through_the_router(urls, tiny_model_dir):
    """Fanned out with a result per worker, or to one worker (`?worker=` id or URL) with its reply
    as the engine gave it: versions, weights, disk loads and profiling driven through the router."""
    with running_router(worker_urls=urls) as router:
        one = {"worker": urls[1]}
        r = httpx.post(router + "/update_weight_version", params=one, json={"new_version": "v7"})
        assert r.status_code == 200 and r.json() == {
            "success": True,
            "message": "Weight version updated to v7",
            "new_version": "v7",
        }
        assert [httpx.get(u + "/model_info").json()["weight_version"] for u in urls] == ["default", "v7"]
        r = httpx.post(
            router + "/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "v8"}
        )
        assert r.status_code == 200 and [w["body"]["success"] for w in r.json()["workers"]] == [True, True]
        assert [httpx.get(u + "/model_info").json()["weight_version"] for u in urls] == ["v8", "v8"]
        worker_id = httpx.get(router + "/workers").json()["workers"][0]["id"]
        name = "model.embed_tokens.weight"
        direct = httpx.post(urls[0] + "/get_weights_by_name", json={"name": name, "truncate_size": 3}).json()
        assert (
            httpx.post(
                router + "/get_weights_by_name", params={"worker": worker_id}, json={"name": name, "truncate_size": 3}
            ).json()
            == direct
        )
        assert (
            httpx.post(router + "/start_profile", params=one, json={"output_dir": "/nonexistent/\0"}).status_code == 400
        )
        assert (
            httpx.post(router + "/stop_profile", params=one)
            .json()["error"]["message"]
            .startswith("Profiling is not in progress")
        )
        missing = httpx.post(router + "/flush_cache", params={"worker": "no-such-worker"})
        assert missing.status_code == 404 and "no worker with id" in missing.json()["error"]["message"]


def test_keys_guard_serving_and_admin_routes(urls):
    with running_router(worker_urls=urls, api_key="serve", admin_api_key="adm") as router:
        r = httpx.post(router + "/generate", json={"input_ids": PROMPT})
        assert r.status_code == 401 and "--api-key" in r.json()["error"]["message"]
        assert (
            httpx.post(
                router + "/generate", json={"input_ids": PROMPT}, headers={"Authorization": "Bearer nope"}
            ).status_code
            == 401
        )
        generate(router, headers={"Authorization": "Bearer serve"}, input_ids=PROMPT, sampling_params=GREEDY)
        assert httpx.get(router + "/workers", headers={"Authorization": "Bearer serve"}).status_code == 401
        assert httpx.post(router + "/pause_generation", json={}).status_code == 401
        assert httpx.get(router + "/workers", headers={"Authorization": "Bearer adm"}).status_code == 200
        assert httpx.get(router + "/health").status_code == 200 and httpx.get(router + "/readiness").status_code == 200


def test_body_limit_and_max_new_tokens_cap(urls):
    with running_router(worker_urls=urls, max_body_bytes=2000, max_new_tokens_cap=6) as router:
        big = httpx.post(router + "/generate", json={"input_ids": list(range(1000))})
        assert big.status_code == 413 and "2000" in big.json()["error"]["message"]
        over = httpx.post(router + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 7}})
        assert over.status_code == 400 and "at most 6" in over.json()["error"]["message"]
        filled = generate(router, input_ids=PROMPT, sampling_params={"temperature": 0.0, "ignore_eos": True})
        assert filled["meta_info"]["completion_tokens"] == 6  # default 128 > cap: the cap applies
        assert (
            httpx.post(router + "/generate", content=b"{nope", headers={"content-type": "application/json"}).status_code
            == 400
        )


def test_metrics_count_requests_per_route_and_worker(urls):
    with running_router(worker_urls=urls, policy="round_robin") as router:
        for _ in range(4):
            generate(router, input_ids=PROMPT, sampling_params=GREEDY)
        text = httpx.get(router + "/metrics").text
    assert 'slimish_router_requests_total{route="/generate",status="200"} 4.0' in text
    assert 'slimish_router_request_duration_seconds_count{route="/generate"} 4.0' in text
    for url in urls:
        assert f'slimish_router_upstream_requests_total{{worker="{url}"}} 2.0' in text
        assert f'slimish_router_worker_inflight{{worker="{url}"}} 0.0' in text


# ---- the openai SDK as a client --------------------------------------------------------------


def test_openai_sdk_through_the_router(urls):
    with running_router(worker_urls=urls, api_key="sk-router") as router:
        client = openai.OpenAI(base_url=router + "/v1", api_key="sk-router", max_retries=0)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
        done = client.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0)
        assert done.object == "text_completion" and done.usage.completion_tokens <= 5
        chunks = list(client.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
        parts = list(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True
            )
        )
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=router + "/v1", api_key="wrong", max_retries=0).models.list()
