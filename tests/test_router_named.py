"""Named workers in the slimish router: an engine registered under a model id (`POST /workers
{"url", "model_id"}`) serves only requests naming it, and admin fan-outs skip it unless they
name it. Two real engines with distinct weights (the policy's tiny model and another seed's), so
which one answered shows in the output ids as well as in each engine's own request counter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import generate, generate_response, metric_total, post, running_router, wait_for

from slimish.launch.local import engine_process
from slimish.processes import start_all
from slimish.router.proxy import WORKER_HEADER

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
PROMPT = [5, 17, 42, 99, 7]
ASK = {"input_ids": PROMPT, "sampling_params": GREEDY}
REQUESTS = "sglang:num_requests_total"


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, tiny_model_dir_other_seed: Path, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(the policy's engine, the teacher's engine): real processes, the teacher on other weights."""
    logs = tmp_path_factory.mktemp("named-logs")
    procs = [
        engine_process(tiny_model_dir, log_path=logs / "policy.log"),
        engine_process(tiny_model_dir_other_seed, log_path=logs / "teacher.log"),
    ]
    try:
        start_all(procs, timeout=120)
        yield procs[0].url, procs[1].url
    finally:
        for p in procs:
            p.stop()


@pytest.fixture()
def router(pair: tuple[str, str]) -> Iterator[str]:
    """The policy's engine by URL, the teacher's registered as `teacher` and healthy."""
    policy, teacher = pair
    with running_router(worker_urls=[policy]) as url:
        assert post(url, "/workers", {"url": teacher, "model_id": "teacher"}).status_code == 202
        wait_for(
            lambda: all(w["is_healthy"] for w in httpx.get(url + "/workers").json()["workers"]), "both workers healthy"
        )
        yield url


def test_only_requests_naming_the_model_reach_the_named_worker(pair, router) -> None:
    policy, teacher = pair
    listed = {w["url"]: w["model_id"] for w in httpx.get(router + "/workers").json()["workers"]}
    assert listed[teacher] == "teacher" and listed[policy] != "teacher"
    direct = {u: generate(u, **ASK)["output_ids"] for u in pair}
    assert direct[policy] != direct[teacher]  # distinct weights: the output says who answered
    before = {u: metric_total(u, REQUESTS) for u in pair}

    plain = [generate_response(router, **ASK) for _ in range(6)]
    assert {r.headers[WORKER_HEADER] for r in plain} == {policy}
    assert all(r.json()["output_ids"] == direct[policy] for r in plain)
    named = [generate_response(router, **ASK, model="teacher") for _ in range(3)]
    assert {r.headers[WORKER_HEADER] for r in named} == {teacher}
    assert all(r.json()["output_ids"] == direct[teacher] for r in named)
    served = {u: metric_total(u, REQUESTS) - before[u] for u in pair}  # each engine's own count
    assert served == {policy: 6, teacher: 3}

    completion = post(
        router, "/v1/completions", {"model": "teacher", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    )
    assert completion.status_code == 200 and completion.headers[WORKER_HEADER] == teacher
    served_name = listed[policy]  # the policy's own served model name is not a named worker's
    assert generate_response(router, **ASK, model=served_name).headers[WORKER_HEADER] == policy

    unknown = generate_response(router, status=None, **ASK, model="techer")
    assert unknown.status_code == 404
    assert (
        "model 'techer' is served by no worker; model ids registered with POST /workers: teacher"
        in unknown.json()["error"]["message"]
    )
    bad = post(router, "/workers", {"url": "http://127.0.0.1:9", "model_id": ""})
    assert bad.status_code == 400 and "model_id" in bad.json()["error"]["message"]


def version(url: str) -> str:
    return httpx.get(url + "/get_weight_version").json()["weight_version"]


def test_admin_fan_outs_skip_the_named_worker_unless_named(pair, router) -> None:
    policy, teacher = pair
    start = version(teacher)
    pushed = post(router, "/update_weight_version", {"new_version": "policy-7"})
    assert pushed.status_code == 200 and [w["url"] for w in pushed.json()["workers"]] == [policy]
    assert version(policy) == "policy-7" and version(teacher) == start
    flushed = post(router, "/flush_cache")
    assert [w["url"] for w in flushed.json()["workers"]] == [policy]

    named = post(router, "/update_weight_version?model=teacher", {"new_version": "teacher-1"})
    assert named.status_code == 200 and [w["url"] for w in named.json()["workers"]] == [teacher]
    assert version(teacher) == "teacher-1" and version(policy) == "policy-7"
    unknown = post(router, "/flush_cache?model=nope")
    assert unknown.status_code == 404 and "no worker is registered under 'nope'" in unknown.json()["error"]["message"]
