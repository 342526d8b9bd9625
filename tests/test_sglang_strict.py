"""The weight sync against the strict SGLang 0.5.23 double (tests/sglang_double), and the double's
own rules, each driven the wrong way to see SGLang's refusal.

The built-in engine forgives what SGLang does not (updates outside a session, a flush while
requests run, a begin racing a pause); these tests hold the trainer's push to SGLang's rules:
per engine pause then begin, end then continue; a flush only with the last bucket and never under
an in_place pause; drain without half-updated weights between buckets; tensors streamed into
buckets; /health that answers while paused; data- or pipeline-parallel engines refused; a LoRA
adapter reloaded through routes SGLang has.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from helpers import metric_total, running_router, serving, wait_for
from safetensors.torch import load_file
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from test_engine_lora import make_adapter, reference
from test_weight_sync import hf_greedy, hf_model, seeded

from slimish.config import load_run_config
from slimish.launch.sglang import MODULE, sglang_process
from slimish.net import free_port
from slimish.processes import ServerProcess
from slimish.trainer.backend import WeightExport
from slimish.trainer.config import WeightSyncConfig
from slimish.trainer.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from slimish.trainer.weight_sync import WeightSync, WeightSyncError

WAIT_S = 120.0
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}  # seconds of decode on these CPUs
ENDLESS = {"temperature": 0.0, "max_new_tokens": 2000, "ignore_eos": True}  # ended by an abort
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]


def post(url: str, path: str, body: dict | None = None, timeout: float = WAIT_S) -> httpx.Response:
    return httpx.post(url + path, json=body if body is not None else {}, timeout=timeout)


@pytest.fixture(scope="module")
def engine(sglang_double, tiny_model_dir, tmp_path_factory):
    """One double run as SGLang runs by default, /health generating (with a 2 s timeout here)."""
    port = free_port()
    argv = [
        "--model-path",
        str(tiny_model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-metrics",
        *LORA_ARGS,
    ]
    env = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true", "SGLANG_HEALTH_CHECK_TIMEOUT": "2"}
    with ServerProcess(
        argv, port=port, env=env, log_path=tmp_path_factory.mktemp("logs") / "double.log", module=MODULE
    ).start(WAIT_S) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def parallel_engine(sglang_double, tiny_model_dir, tmp_path_factory):
    """A double started as the launcher starts SGLang, with data and pipeline parallelism."""
    log = tmp_path_factory.mktemp("logs") / "parallel.log"
    with sglang_process(
        tiny_model_dir, ["--dp-size", "2", "--pp-size", "2", "--dtype", "bfloat16"], log_path=log
    ).start(WAIT_S) as proc:
        yield proc.url


def late_pause(upstream: str) -> Starlette:
    """A proxy to `upstream` that delivers /pause_generation 0.2 s late, as a network may
    when a pause and a begin are sent at once."""
    client = httpx.AsyncClient(base_url=upstream, timeout=600)

    async def forward(request: Request) -> Response:
        if request.url.path == "/pause_generation":
            await asyncio.sleep(0.2)
        r = await client.request(
            request.method, request.url.path, content=await request.body(), headers={"content-type": "application/json"}
        )
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


class Running:
    """`n` long greedy generations in flight on `url` (threads), joined by `results`."""

    def __init__(self, url: str, n: int = 2, params: dict = LONG) -> None:
        self.pool = ThreadPoolExecutor(n)
        before = metric_total(url, "sglang:num_running_reqs")
        body = {"input_ids": PROMPT, "sampling_params": params}
        self.futures: list[Future] = [self.pool.submit(post, url, "/generate", body, 600.0) for _ in range(n)]
        wait_for(
            lambda: metric_total(url, "sglang:num_running_reqs") >= before + n, "the generations to run", timeout=60
        )

    def results(self) -> list[dict]:
        try:
            replies = [f.result(timeout=600) for f in self.futures]
        finally:
            self.pool.shutdown()
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json() for r in replies]


def sync_config(**kw) -> WeightSyncConfig:
    return WeightSyncConfig(**{"timeout_s": 30.0, "bucket_mb": 0.05, **kw})


def served(url: str, name: str, rows: int) -> torch.Tensor:
    r = post(url, "/get_weights_by_name", {"name": name, "truncate_size": rows})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json(), dtype=torch.float32)


def greedy(url: str, **body) -> dict:
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- the double's rules ---------------------------------------------------------------------------


def launch(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", MODULE, *argv], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def test_the_command_line_is_sglangs(sglang_double, tmp_path):
    """Bare boolean flags, SGLang's aliases and choices parse (the start is recorded; exit 7 is
    SGLANG_SHIM_EXIT's); an unknown flag, a value after a boolean flag or a bad choice exits 2
    with argparse's message, as `sglang serve` does."""
    ok = [
        "--model",
        "/m",
        "--tensor-parallel-size",
        "2",
        "--dp-size",
        "1",
        "--base-gpu-id",
        "3",
        "--dtype",
        "bfloat16",
        "--trust-remote-code",
        "--disable-radix-cache",
        "--enable-return-routed-experts",
        *LORA_ARGS,
        "--mem-fraction-static",
        "0.7",
    ]
    done = launch(*ok, SGLANG_SHIM_EXIT="7")
    assert done.returncode == 7, done.stderr
    assert json.loads(sglang_double.read_text().splitlines()[-1])["argv"] == ok
    for bad, message in [
        (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        (["--enable-lora", "true"], "unrecognized arguments: true"),
        (["--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
    ]:
        done = launch("--model-path", "/m", *bad, SGLANG_SHIM_EXIT="7")
        assert done.returncode == 2 and f"sglang serve: error: {message}" in done.stderr, done.stderr


def test_routes_are_sglangs_and_server_info_reports_the_command_line(engine, parallel_engine):
    assert httpx.get(engine + "/get_weight_version", timeout=30).status_code == 404  # slimish's, not SGLang 0.5.23's
    assert post(engine, "/get_weight_version").status_code == 404
    info = httpx.get(parallel_engine + "/server_info", timeout=30).json()
    assert (info["tp_size"], info["dp_size"], info["pp_size"], info["dtype"]) == (1, 2, 2, "bfloat16")
    assert httpx.get(parallel_engine + "/metrics", timeout=30).status_code == 404  # no --enable-metrics


def test_weight_updates_only_inside_a_session(engine):
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
    r = post(engine, "/update_weights_from_distributed", update)
    message = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
    assert (r.status_code, r.json()["message"]) == (400, message)
    r = post(engine, "/end_weight_update")
    assert (r.status_code, r.json()["message"]) == (
        400,
        "no weight-update session is open; call begin_weight_update() first",
    )
    assert post(engine, "/begin_weight_update").status_code == 200
    r = post(engine, "/begin_weight_update")
    assert (r.status_code, r.json()["message"]) == (
        400,
        "a weight-update session is already open; call end_weight_update() first",
    )
    assert post(engine, "/end_weight_update").status_code == 200


def test_a_flush_is_refused_while_requests_run_even_paused_in_place(engine):
    running = Running(engine, n=1, params=ENDLESS)
    try:
        r = post(engine, "/flush_cache")
        assert (r.status_code, r.text) == (400, "Flush cache failed.\n")
        assert post(engine, "/pause_generation", {"mode": "in_place"}).status_code == 200
        assert post(engine, "/flush_cache").status_code == 400  # in_place keeps the running batch
        assert post(engine, "/pause_generation", {"mode": "retract"}).status_code == 200
        assert post(engine, "/flush_cache").status_code == 200  # retracted to the queue, which a paused flush ignores
    finally:
        post(engine, "/abort_request", {"abort_all": True})
        post(engine, "/continue_generation")
    running.results()


def test_a_begin_that_reaches_sglang_before_the_pause_hangs(engine):
    """SGLang's deadlock: begin on an unpaused engine waits for the writer lock; a retract pause
    then parks the running request, which keeps its reader lock, so that begin never gets it (its
    client gave up after 1 s; the server still waits): the session stays closed while paused.
    Once the request is aborted, the begin that hung opens the session, and the next is refused."""
    running = Running(engine, n=1, params=ENDLESS)
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(engine, "/begin_weight_update", timeout=1.0)  # waits for the running request
        assert post(engine, "/pause_generation", {"mode": "retract"}).status_code == 200
        r = post(engine, "/end_weight_update")  # paused: runs at once
        assert (r.status_code, r.json()["message"]) == (
            400,
            "no weight-update session is open; call begin_weight_update() first",
        )
    finally:
        post(engine, "/abort_request", {"abort_all": True})
        post(engine, "/continue_generation")
        running.results()
        wait_for(lambda: post(engine, "/begin_weight_update").status_code == 400, "the hung begin to open the session")
        assert post(engine, "/end_weight_update").status_code == 200


def test_health_generates_and_so_waits_out_a_pause(engine):
    assert httpx.get(engine + "/health", timeout=30).status_code == 200
    assert post(engine, "/pause_generation", {"mode": "retract"}).status_code == 200
    try:
        started = time.monotonic()
        assert httpx.get(engine + "/health", timeout=30).status_code == 503
        assert time.monotonic() - started >= 2.0  # SGLANG_HEALTH_CHECK_TIMEOUT
    finally:
        post(engine, "/continue_generation")
    assert httpx.get(engine + "/health", timeout=30).status_code == 200


# -- the weight sync under SGLang's rules -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_push_while_requests_run_completes_and_leaves_no_session_open(
    engine, tiny_model_dir, tiny_model_dir_other_seed, mode
):
    """Issue 42 #6 and #7: each engine is paused before its session opens, though the pause
    reaches it late (a begin that came first would wait forever on the request the pause
    parks), and only the last bucket flushes, never under in_place (its running batch makes
    SGLang refuse the flush, and so the update). Two pushes in a row: the first left no session
    open. The parked request then finishes, on the last push's weights."""
    reference, other = hf_model(tiny_model_dir), hf_model(tiny_model_dir_other_seed)
    before = httpx.get(engine + "/model_info", timeout=30).json()["weight_version"]
    with serving(late_pause(engine), "the late-pause proxy") as url:
        with WeightSync(sync_config(pause_mode=mode, group_name=f"busy-{mode}", timeout_s=15.0), [url]) as sync:
            running = Running(engine, n=1)
            sync.push(WeightExport(seeded(reference, 3)), 3)
            sync.push(WeightExport(other.named_parameters()), 4)
    (meta,) = [r["meta_info"] for r in running.results()]
    spans = [span["version"] for span in meta["weight_versions"]]
    assert (
        meta["finish_reason"]["type"] == "length" and spans[0] == before and spans[-1] in ("3", "4")
    )  # parked, then resumed
    assert greedy(engine)["output_ids"] == hf_greedy(other)


def test_a_drain_push_serves_no_half_updated_weights(engine, tiny_model_dir, tiny_model_dir_other_seed):
    """Issue 42 #7: under `drain` a generation asked for between two buckets must not run on the
    half-updated model: it waits for the push and runs on the new weights, labelled with their
    version. The generation is asked for while the push's iterator is between buckets."""
    base, other = hf_model(tiny_model_dir), hf_model(tiny_model_dir_other_seed)
    with WeightSync(sync_config(group_name="drain"), [engine]) as sync:
        sync.push(WeightExport(base.named_parameters()), 5)
    mid: dict[str, object] = {}

    def tensors():
        for k, (name, t) in enumerate(other.named_parameters()):
            if k == 8:  # buckets of the first tensors are on the engine by now (0.05 MB buckets)
                pool = ThreadPoolExecutor(1)
                mid["reply"] = pool.submit(greedy, engine)
                try:
                    mid["during"] = mid["reply"].result(timeout=3.0)  # served during the push: it must not be
                except TimeoutError:
                    pass
                pool.shutdown(wait=False)
            yield name, t

    with WeightSync(sync_config(group_name="drain", pause_mode="drain"), [engine]) as sync:
        sync.push(WeightExport(tensors()), 6)
    assert "during" not in mid, "a generation ran mid-push"
    reply = mid["reply"].result(timeout=WAIT_S)
    assert reply["output_ids"] == hf_greedy(other) and reply["meta_info"]["weight_version"] == "6"


def test_a_push_streams_its_tensors_into_buckets(engine, tiny_model_dir, tiny_model_dir_other_seed):
    """Issue 42 #9a: the first bucket is on the engine before the iterator yields the last tensor
    (the whole model is never held at once)."""
    base, other = hf_model(tiny_model_dir), hf_model(tiny_model_dir_other_seed)
    named = list(other.named_parameters())
    first_name, first = named[0]
    seen: list[bool] = []

    def tensors():
        for k, (name, t) in enumerate(named):
            if k == len(named) - 1:
                seen.append(torch.equal(served(engine, first_name, first.shape[0]), first.detach()))
            yield name, t

    with WeightSync(sync_config(group_name="stream"), [engine]) as sync:
        sync.push(WeightExport(base.named_parameters()), 7)
        sync.push(WeightExport(tensors()), 8)
    assert seen == [True]
    assert torch.equal(served(engine, named[-1][0], named[-1][1].shape[0]), named[-1][1].detach())


def test_a_paused_sglang_engine_stays_healthy_in_the_router(parallel_engine):
    """Issue 42 #9b: the launcher starts SGLang with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0,
    so /health answers while a push has generation paused: the router keeps the engine through
    more than its failure threshold of checks (1 failure, 0.5 s timeout, every 0.2 s)."""
    with running_router(worker_urls=[parallel_engine], health_check_timeout=0.5) as router:
        wait_for(
            lambda: httpx.get(router + "/workers", timeout=10).json()["workers"][0]["is_healthy"],
            "the engine to turn healthy",
        )
        assert post(parallel_engine, "/pause_generation", {"mode": "retract"}).status_code == 200
        try:
            deadline = time.monotonic() + 3.0  # 0.5 s timeout + 0.2 s interval, several times over
            while time.monotonic() < deadline:
                worker = httpx.get(router + "/workers", timeout=10).json()["workers"][0]
                assert worker["is_healthy"], worker["last_error"]
                time.sleep(0.1)
        finally:
            post(parallel_engine, "/continue_generation")


def test_data_or_pipeline_parallel_engines_are_refused_at_connect(parallel_engine):
    """Issue 42 #9d: SGLang's update group is rank_offset + tp_rank of one replica and one stage,
    and SGLang asserts dp_size == 1: refused before any group is formed, naming the engine."""
    sync = WeightSync(sync_config(group_name="parallel"), [parallel_engine])
    try:
        with pytest.raises(
            WeightSyncError, match=rf"{parallel_engine}: dp_size=2, pp_size=2: .*dp_size=1 and pp_size=1"
        ):
            sync.connect()
        assert sync.group is None
    finally:
        sync.close()


def adapter(model_dir: Path, root: Path, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    path = make_adapter(model_dir, root / f"seed{seed}", seed, 4, 8, ["q_proj", "v_proj"], False)
    return load_file(str(path / ADAPTER_WEIGHTS)), json.loads((path / ADAPTER_CONFIG).read_text())


def test_an_adapter_push_into_sglang_reloads_it_and_versions_the_engine(engine, tiny_model_dir, tmp_path):
    """Issue 42 #3: SGLang 0.5.23 has no per-adapter broadcast (it drops `lora_name`) and no
    /get_weight_version, so an adapter push into it is paused (abort), then an unload and a load
    of the saved directory through the router, then /update_weight_version: rollouts naming the
    adapter sample exactly the PEFT model and report the push's version."""
    with WeightSync(sync_config(group_name="base"), [engine]) as sync:  # earlier tests pushed other weights
        sync.push(WeightExport(hf_model(tiny_model_dir).named_parameters()), 0)
    cfg = sync_config(transport="disk", pause_mode="abort", disk_dir=str(tmp_path / "pushes"))
    # Checks once, at the start: this engine's /health generates, and so fails while a push pauses it.
    with running_router(worker_urls=[engine], health_check_interval=600) as router:
        wait_for(
            lambda: httpx.get(router + "/workers", timeout=10).json()["workers"][0]["is_healthy"],
            "the engine to turn healthy",
        )
        with WeightSync(cfg, [engine], adapter="run", router_url=router) as sync:
            for version in (1, 2):
                tensors, config = adapter(tiny_model_dir, tmp_path, version)
                sync.push(WeightExport(tensors.items(), config), version)
                reply = greedy(router, lora_path="run")
                want = hf_greedy(reference(tiny_model_dir, tmp_path / f"seed{version}"))
                assert (reply["output_ids"], reply["meta_info"]["weight_version"]) == (want, str(version))
        assert [p.name for p in (tmp_path / "pushes").iterdir()] == ["run-2"]


def test_an_adapter_broadcast_into_sglang_is_refused_naming_the_fields(engine, tmp_path):
    """The broadcast cannot work against SGLang (its update has no adapter target): refused at
    the first push, before anything is loaded, as the run's config check refuses it for
    launch.engine_kind=sglang."""
    with (
        running_router(worker_urls=[engine]) as router,
        WeightSync(sync_config(), [engine], adapter="run", router_url=router) as sync,
    ):
        with pytest.raises(WeightSyncError, match=r"weight_sync.transport=disk and weight_sync.pause_mode=abort"):
            sync.push(WeightExport([("x", torch.zeros(1))], {}), 1)
    overrides = ["model=/m", "data.source=task:max_digit", "launch.engine_kind=sglang", "trainer.lora.enabled=true"]
    with pytest.raises(
        SystemExit,
        match=r"trainer.lora with launch.engine_kind=sglang: .*transport=disk and weight_sync.pause_mode=abort",
    ):
        load_run_config(None, overrides)
    load_run_config(None, [*overrides, "weight_sync.transport=disk", "weight_sync.pause_mode=abort"])
