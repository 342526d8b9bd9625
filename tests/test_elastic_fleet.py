"""An engine fleet that grows and shrinks while a run trains (docs/elastic.md): the router holds a
worker that joins a running fleet until it serves the fleet's weight version, and the trainer
re-forms its weight-update group over the fleet at the push after any change."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from helpers import ROOT, generate_response, running_engines, running_router, wait_for
from test_train_resume import _argv, _prompts, _trained

from slimish.launch.elastic import fleet_urls
from slimish.launch.workers import key_client
from slimish.metrics import read_metrics
from slimish.router.proxy import WORKER_HEADER

GROUPS = 2


def _workers(router: str, headers: dict[str, str] | None = None) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(router + "/workers", headers=headers, timeout=10).json()["workers"]}


def _served_by(router: str, n: int) -> set[str]:
    replies = [generate_response(router, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1}) for _ in range(n)]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return {r.headers[WORKER_HEADER] for r in replies}


def test_a_worker_joining_a_running_fleet_takes_no_request_until_it_serves_the_fleets_weights(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """B joins while A serves version 3: healthy, but held out (`joining`) while it reports its
    checkpoint's "default"; once B reports "3" too it takes its share. A worker registered
    under a model id serves another model and is never held. The trainer's next push goes to
    the run's own engines and the others that are alive, never to the named one."""
    with running_engines(tiny_model_dir, tmp_path_factory, n=3) as (a, b, named):
        with running_router(worker_urls=[a.url], join_check_interval=0.05) as router:
            assert httpx.post(a.url + "/update_weight_version", json={"new_version": "3"}).status_code == 200
            assert httpx.post(router + "/workers", json={"url": b.url}).status_code == 202
            wait_for(lambda: _workers(router)[b.url]["is_healthy"], "B healthy on the router")
            held = _workers(router)[b.url]
            assert held["joining"] and held["last_error"] == "joining: serves weight version default, the fleet 3"
            assert _served_by(router, 8) == {a.url}
            httpx.post(router + "/workers", json={"url": named.url, "model_id": "teacher"}).raise_for_status()
            wait_for(lambda: _workers(router)[named.url]["is_healthy"], "the named worker healthy")
            assert not _workers(router)[named.url]["joining"]

            assert httpx.post(b.url + "/update_weight_version", json={"new_version": "3"}).status_code == 200
            wait_for(lambda: not _workers(router)[b.url]["joining"], "B admitted", timeout=10)
            assert _served_by(router, 8) == {a.url, b.url}

            # The next push's fleet: A (the run's own) first, then B; never the teacher's named worker.
            with key_client(None) as http:
                assert fleet_urls(http, router, [a.url], skip_model="teacher") == [a.url, b.url]
                b.stop()  # dead: left out at once, before the router's health checks notice
                assert fleet_urls(http, router, [a.url], skip_model="teacher") == [a.url]


def test_the_join_gate_reads_keyed_engines_with_the_routers_key(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same gate in a keyed fleet: the router reads each worker's weight version with its key
    (`/model_info` is a keyed route), so B, serving "default" while A serves 3, is held, not
    admitted at once as a worker whose version cannot be read; and the push's probe reaches it."""
    key = {"Authorization": "Bearer sk-fleet"}
    with running_engines(tiny_model_dir, tmp_path_factory, n=2, api_key="sk-fleet") as (a, b):
        with running_router(worker_urls=[a.url], join_check_interval=0.05, api_key="sk-fleet") as router:
            httpx.post(a.url + "/update_weight_version", json={"new_version": "3"}, headers=key).raise_for_status()
            assert httpx.post(router + "/workers", json={"url": b.url}, headers=key).status_code == 202
            wait_for(lambda: _workers(router, key)[b.url]["is_healthy"], "B healthy on the router")
            held = _workers(router, key)[b.url]
            assert held["joining"] and held["last_error"] == "joining: serves weight version default, the fleet 3"
            with key_client("sk-fleet") as http:  # the run's: its push probes the fleet with it
                assert fleet_urls(http, router, [a.url]) == [a.url, b.url]
            httpx.post(b.url + "/update_weight_version", json={"new_version": "3"}, headers=key).raise_for_status()
            wait_for(lambda: not _workers(router, key)[b.url]["joining"], "B admitted", timeout=10)


# Registers the test's engine with the run's router as step 3's rollout begins (and waits until
# the router has checked it), notes how many requests it had served as steps 4 and 5 begin, and
# SIGKILLs it as step 6's begins.
ELASTIC_PLUGIN = """
import json, os, signal, time
from pathlib import Path
import httpx
from helpers import metric_total
from rollout_plugins import math

url, log, seen = os.environ["ELASTIC_ENGINE_URL"], Path(os.environ["ELASTIC_LOG"]), set()

def checked(router):
    return any(w["url"] == url and w["is_healthy"] for w in httpx.get(router + "/workers").json()["workers"])

async def rollout(ctx, sample):
    step = sample.group_id // {groups} + 1
    if sample.group_id % {groups} == 0 and sample.index == 0 and step not in seen:
        seen.add(step)
        event = {"step": step}
        if step == 3:
            httpx.post(ctx.client.base_url + "/workers", json={"url": url}).raise_for_status()
            deadline = time.monotonic() + 30
            while not checked(ctx.client.base_url):
                assert time.monotonic() < deadline, "the joining engine was never healthy on the router"
                time.sleep(0.02)
        if step in (4, 5):
            event["served"] = metric_total(url, "sglang:num_requests_total")
        if step == 6:
            os.kill(int(os.environ["ELASTIC_ENGINE_PID"]), signal.SIGKILL)
        if step in (3, 4, 5, 6):
            with log.open("a") as f:
                f.write(json.dumps(event) + "\\n")
    return await math.rollout(ctx, sample)
""".replace("{groups}", str(GROUPS))


@pytest.mark.slow
def test_an_engine_joins_at_step_3_and_is_killed_at_step_6_of_a_sync_run(
    tiny_model_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """10 sync steps on the run's one engine, plus one from outside registered with its router
    as step 3's rollout begins and SIGKILLed as step 6's begins: it serves nothing of step 3
    (its checkpoint is not step 2's weights), joins the group at the push after step 3, serves
    from step 4, is dropped from the group at the push after step 6; every sample of step k ran
    on version k - 1, no group failed, every prompt was trained once."""
    data, run_dir, log = _prompts(tmp_path / "prompts.jsonl", 100), tmp_path / "run", tmp_path / "elastic.jsonl"
    plugin = tmp_path / "elastic_plugin.py"
    plugin.write_text(ELASTIC_PLUGIN)
    with running_engines(tiny_model_dir, tmp_path_factory, n=1) as (outsider,):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}",
            "ELASTIC_ENGINE_URL": outsider.url,
            "ELASTIC_ENGINE_PID": str(outsider.proc.pid),
            "ELASTIC_LOG": str(log),
        }
        argv = _argv(
            tiny_model_dir, run_dir, data, "steps=10", "checkpoint.every=0", f"rollout.rollout_fn={plugin}:rollout"
        )
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    events = {row["step"]: row for row in map(json.loads, log.read_text().splitlines())}
    assert sorted(events) == [3, 4, 5, 6]
    assert events[4]["served"] == 0  # held out through step 3: its weights were not step 2's
    assert events[5]["served"] > 0  # admitted before step 4's rollout began (Driver.push waits for it)

    rows = {r["step"]: r for r in read_metrics(run_dir)}
    assert [rows[s]["launch/engines"] for s in range(11)] == [1, 1, 1, 2, 2, 2, 1, 1, 1, 1, 1]
    assert sum(rows[s]["rollout/groups_failed"] for s in range(1, 11)) == 0
    assert "joined" in done.stderr and "left" in done.stderr
    trained = _trained(run_dir)
    assert [t["step"] for t in trained] == list(range(1, 11))
    assert sorted(g for t in trained for g in t["group_ids"]) == list(range(10 * GROUPS))  # every prompt once
    assert [t["versions"] for t in trained] == [[[s - 1]] * GROUPS for s in range(1, 11)]  # never a stale token
