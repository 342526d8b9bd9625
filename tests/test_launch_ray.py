"""`launch.mode: ray` on a real Ray cluster (one per module, on 127.0.0.1): built-in engines as
actors of a placement group, a killed actor replaced and brought to the run's weights before it
serves, and a short RL run that loses no sample to such a kill."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from helpers import assert_run_survives_an_engine_kill, generate, process_exited, wait_for

ray = pytest.importorskip("ray")

from slimish.launch.config import LaunchConfig  # noqa: E402
from slimish.launch.ray_engines import ray_servers  # noqa: E402
from slimish.trainer.backend import WeightExport  # noqa: E402
from slimish.trainer.config import WeightSyncConfig  # noqa: E402
from slimish.trainer.weight_sync import WeightSync  # noqa: E402

WAIT_S = 180.0
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
ASK = {"input_ids": PROMPT, "sampling_params": GREEDY}
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}  # no token for the trainer child to find


@pytest.fixture(scope="module")
def ray_address() -> str:
    """A local cluster for this module (~10-15 s to start); the trainer child joins it by address."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in RAY_ENV.items():
            mp.setenv(key, value)
        ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()


def router_workers(router_url: str) -> list[str]:
    return sorted(w["url"] for w in httpx.get(router_url + "/workers", timeout=30).json()["workers"])


def hf_params(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())


def engine_pid(url: str) -> int:
    """The engine process serving `url` (on this machine: the cluster is local), by its `--host`
    and `--port` both: another test's engine may listen on the same port of another address
    (127.0.0.1), and a match on the port alone once killed that one and left this one serving."""
    where = urlsplit(url)
    want = {b"--host": where.hostname.encode(), b"--port": str(where.port).encode()}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        flags = dict(zip(argv, argv[1:]))
        if b"slimish.cli" in argv and b"engine" in argv and all(flags.get(k) == v for k, v in want.items()):
            return int(proc.name)
    raise AssertionError(f"no engine process for {url}")


def wait_exited(pid: int, timeout: float = 60.0) -> None:
    """Until `pid`'s main thread has exited (a zombie), or it is gone. Its port closes a moment
    before that (the kernel closes a dying process's files first), and the kernel reaps it only
    once its last thread is gone, later still on a loaded machine: `restart_dead` counts it
    dead from the zombie on (`ServerProcess.exited`)."""
    wait_for(lambda: process_exited(pid), f"process {pid} to exit after SIGKILL", timeout)


def wait_unreachable(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/model_info", timeout=2.0)
        except httpx.HTTPError:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} still answers {timeout:.0f}s after its actor was killed")


@pytest.mark.slow  # ~45 s here: two engines started, one again, two pushes
def test_engine_actors_serve_and_a_killed_one_rejoins_at_the_current_weights(
    ray_address, tiny_model_dir, tiny_model_dir_other_seed, tmp_path
):
    launch = LaunchConfig(mode="ray", engines=2, ray_address=ray_address, start_timeout=WAIT_S)
    with ray_servers(launch, tiny_model_dir, tmp_path / "logs") as servers:
        table = ray.util.placement_group_table(servers.group)
        assert table["state"] == "CREATED" and list(table["bundles"].values()) == [{"CPU": 1.0}] * 2
        assert router_workers(servers.router_url) == sorted(servers.engine_urls)
        initial = generate(servers.engine_urls[0], timeout=WAIT_S, **ASK)["output_ids"]
        assert generate(servers.engine_urls[1], timeout=WAIT_S, **ASK)["output_ids"] == initial

        pushed = hf_params(tiny_model_dir_other_seed)  # other weights: a push is visible in the tokens
        sync = WeightSync(WeightSyncConfig(timeout_s=120.0), servers.engine_urls)
        try:
            sync.connect()
            sync.push(WeightExport(pushed), 1)
        finally:
            sync.close()
        trained = generate(servers.engine_urls[1], timeout=WAIT_S, **ASK)["output_ids"]
        assert trained != initial

        old, actor_ids = list(servers.engine_urls), [a._actor_id for a in servers.actors]
        ray.kill(servers.actors[0])  # actor 0 dies; actor 1 lives but loses its engine
        pid = engine_pid(old[1])
        os.kill(pid, signal.SIGKILL)
        wait_exited(pid)
        for url in old:
            wait_unreachable(url)  # actor 0's engine child died with it
        assert servers.restart_dead(WAIT_S) == servers.engine_urls
        # Actor 0 replaced under a new name, actor 1 kept (its engine restarted inside it).
        now = [ray.get_actor(n)._actor_id for n in ("slimish-engine-0-r1", "slimish-engine-1")]
        assert now == [a._actor_id for a in servers.actors] and now[0] != actor_ids[0] and now[1] == actor_ids[1]
        assert router_workers(servers.router_url) == sorted(servers.engine_urls) and not set(old) & set(
            servers.engine_urls
        )
        for url in servers.engine_urls:
            assert httpx.get(url + "/health", timeout=30).status_code == 503  # no rollouts on their initial weights
        assert servers.restart_dead(WAIT_S) == []  # alive, merely awaiting weights: left alone

        sync = WeightSync(WeightSyncConfig(timeout_s=120.0, group_name="rejoin"), servers.engine_urls)
        try:
            sync.connect()
            sync.push(WeightExport(pushed), 2)
        finally:
            sync.close()
        assert all(httpx.get(url + "/health", timeout=30).status_code == 200 for url in servers.engine_urls)
        for url in servers.engine_urls:
            out = generate(url, timeout=WAIT_S, **ASK)
            assert out["output_ids"] == trained and out["meta_info"]["weight_version"] == "2"
    assert not ray.util.list_named_actors()  # every actor gone with the servers


@pytest.mark.slow
def test_an_rl_run_on_ray_survives_an_engine_actor_killed_mid_rollout(ray_address, tmp_path):
    kill = """
import ray
ray.kill(ray.get_actor("slimish-engine-0"))  # this trainer is the actors' driver
"""
    assert_run_survives_an_engine_kill(
        tmp_path, kill, "launch.mode=ray", f"launch.ray_address={ray_address}", env=RAY_ENV
    )
