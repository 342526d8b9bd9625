"""`slimish router --processes N`: several router processes on one port behave as one router.

Real `slimish router` processes on free loopback ports in front of two real built-in engines.
Every `httpx.post` / `httpx.get` here opens a new connection, so SO_REUSEPORT spreads the
requests over the router processes; which process served a reply is read from its
`x-slimish-router-process` header, which engine from `x-slimish-worker`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import httpx
import psutil
import pytest
from helpers import generate_response, running_engines, wait_for

from slimish.net import free_port
from slimish.processes import ServerProcess
from slimish.protocol import ROUTING_KEY_HEADER
from slimish.router.config import RouterConfig
from slimish.router.policy import rendezvous
from slimish.router.proxy import PROCESS_HEADER, WORKER_HEADER
from slimish.router.workers import Worker

GREEDY = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}
ADMIN = {"Authorization": "Bearer adm"}
PROCESSES = 2


@pytest.fixture(scope="module")
def urls(tiny_model_dir, tmp_path_factory) -> Iterator[list[str]]:
    with running_engines(tiny_model_dir, tmp_path_factory) as procs:
        yield [p.url for p in procs]


@contextmanager
def router(tmp_path, worker_urls: list[str], *flags: str) -> Iterator[ServerProcess]:
    """A `slimish router --processes 2` process, returned once every router process serves."""
    port = free_port()
    argv = [
        "router",
        "--processes",
        str(PROCESSES),
        "--port",
        str(port),
        "--health-check-interval",
        "0.2",
        "--admin-api-key",
        "adm",
        *flags,
        "--worker-urls",
        *worker_urls,
    ]
    # TMPDIR: the registry file lands under tmp_path, so a parent killed by a test leaves nothing behind
    proc = ServerProcess(argv, port=port, log_path=tmp_path / "router.log", env={"TMPDIR": str(tmp_path)})
    try:
        proc.start(timeout=60)
        seen: set[str] = set()
        wait_for(
            lambda: seen.add(httpx.get(proc.url + "/v1/models").headers[PROCESS_HEADER]) or len(seen) == PROCESSES,
            "every router process to take connections",
        )
        yield proc
    finally:
        proc.stop()


def test_sessions_and_prefixes_stick_across_processes(urls, tmp_path):
    pool = [Worker(u) for u in urls]
    owner = {f"agent-{i}": rendezvous(pool, f"agent-{i}".encode()).url for i in range(64)}
    agents = [next(k for k, u in owner.items() if u == url) for url in urls]  # keys for each engine
    agents += [k for k in owner if k not in agents][:2]
    with router(tmp_path, urls, "--policy", "session") as r:
        replies = {
            agent: [
                generate_response(
                    r.url, headers={ROUTING_KEY_HEADER: agent}, input_ids=[5, 6, 7], sampling_params=GREEDY
                )
                for _ in range(8)
            ]
            for agent in agents
        }
    for agent, theirs in replies.items():
        served = {x.headers[WORKER_HEADER] for x in theirs}
        assert served == {owner[agent]}, f"{agent}: expected only {owner[agent]}, served by {served}"
    processes = {x.headers[PROCESS_HEADER] for theirs in replies.values() for x in theirs}
    assert len(processes) == PROCESSES, "all on one router process: not a cross-process test"

    with router(tmp_path, urls, "--policy", "cache_aware") as r:
        replies = {
            tuple(p): [generate_response(r.url, input_ids=p, sampling_params=GREEDY) for _ in range(8)]
            for p in ([9] * 40, list(range(100, 140)))
        }
    assert all(len({x.headers[WORKER_HEADER] for x in theirs}) == 1 for theirs in replies.values())
    assert len({x.headers[PROCESS_HEADER] for theirs in replies.values() for x in theirs}) == PROCESSES


def test_registry_and_fan_outs_are_one_across_processes(urls, tmp_path):
    def everywhere(path: str) -> list[httpx.Response]:
        """`path` as each child sees it: 8 new connections reach both (2^-7 odds of missing one)."""
        return [httpx.get(r.url + path) for _ in range(8)]

    with router(tmp_path, urls[:1], "--policy", "round_robin") as r:
        added = httpx.post(r.url + "/workers", json={"url": urls[1]}, headers=ADMIN)
        assert added.status_code == 202, added.text
        assert {w["url"] for w in httpx.get(r.url + "/workers", headers=ADMIN).json()["workers"]} == set(
            urls
        )  # the parent's
        assert all(
            {w["worker"] for w in x.json()["workers"]} == set(urls) for x in everywhere("/get_loads")
        )  # each child's
        wait_for(
            lambda: all(x.json()["healthy_workers"] == 2 for x in everywhere("/readiness")),
            "the added engine to be routable",
        )
        assert {
            generate_response(r.url, input_ids=[1, 2], sampling_params=GREEDY).headers[WORKER_HEADER] for _ in range(8)
        } == set(urls)

        for _ in range(4):  # each through whichever process takes it: one result per engine
            fan = httpx.post(r.url + "/flush_cache", headers=ADMIN, timeout=60)
            assert fan.status_code == 200, fan.text
            assert sorted(w["url"] for w in fan.json()["workers"]) == sorted(urls)
        assert all(
            httpx.post(r.url + "/flush_cache").status_code == 401 for _ in range(4)
        )  # keys checked whichever process

        gone = httpx.post(r.url + "/remove_worker", params={"url": urls[0]}, headers=ADMIN)
        assert gone.status_code == 200, gone.text
        assert all([w["worker"] for w in x.json()["workers"]] == [urls[1]] for x in everywhere("/get_loads"))
        assert {
            generate_response(r.url, input_ids=[1, 2], sampling_params=GREEDY).headers[WORKER_HEADER] for _ in range(8)
        } == {urls[1]}


def test_a_named_worker_is_named_in_every_process(urls, tmp_path):
    """A worker registered under a model id (an OPD teacher) gets only requests naming it, and
    every other request stays off it, whichever process routes."""
    with router(tmp_path, urls[:1]) as r:
        added = httpx.post(r.url + "/workers", json={"url": urls[1], "model_id": "teacher"}, headers=ADMIN)
        assert added.status_code == 202, added.text
        wait_for(
            lambda: all(x.json()["healthy_workers"] == 2 for x in [httpx.get(r.url + "/readiness") for _ in range(8)]),
            "the named engine to be routable",
        )
        named = [
            httpx.post(r.url + "/generate", json={"input_ids": [1, 2], "model": "teacher", "sampling_params": GREEDY})
            for _ in range(8)
        ]
        plain = [generate_response(r.url, input_ids=[1, 2], sampling_params=GREEDY) for _ in range(8)]
    assert {x.headers[WORKER_HEADER] for x in named} == {urls[1]} and {x.headers[WORKER_HEADER] for x in plain} == {
        urls[0]
    }
    assert len({x.headers[PROCESS_HEADER] for x in named + plain}) == PROCESSES


def test_least_inflight_balances_with_per_process_counts(urls, tmp_path):
    """Each process rotates its own ties: the engines' shares differ by at most one per process."""
    with router(tmp_path, urls, "--policy", "least_inflight") as r:
        replies = [generate_response(r.url, input_ids=[3, 4], sampling_params=GREEDY) for _ in range(40)]
    by_process = Counter(x.headers[PROCESS_HEADER] for x in replies)
    by_engine = Counter(x.headers[WORKER_HEADER] for x in replies)
    assert len(by_process) == PROCESSES, by_process
    assert set(by_engine) == set(urls) and abs(by_engine[urls[0]] - by_engine[urls[1]]) <= PROCESSES, by_engine


def test_a_run_starts_its_router_with_launch_router_processes(urls, tmp_path):
    from slimish.launch.config import LaunchConfig
    from slimish.launch.local import router_process

    launch = LaunchConfig(router_processes=PROCESSES, policy="round_robin")
    with router_process(launch, urls, tmp_path).start(60) as proc:
        seen: set[str] = set()
        wait_for(
            lambda: seen.add(httpx.get(proc.url + "/v1/models").headers[PROCESS_HEADER]) or len(seen) == PROCESSES,
            "every router process to take connections",
        )


def test_router_processes_die_with_the_parent(urls, tmp_path):
    with router(tmp_path, urls) as r:
        assert r.proc is not None
        children = psutil.Process(r.proc.pid).children()
        assert len(children) >= PROCESSES
        os.kill(r.proc.pid, signal.SIGKILL)
        r.proc.wait(10)
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"orphaned router processes: {alive}"


def test_bad_processes_and_port_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="processes must be >= 1"):
        RouterConfig(processes=0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for port, says in ((taken.getsockname()[1], "cannot listen"), (0, "every process must bind the same port")):
            argv = [sys.executable, "-m", "slimish.cli", "router", "--processes", "2", "--port", str(port)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert done.returncode != 0 and f"--port {port}: " in done.stderr and says in done.stderr, done.stderr
