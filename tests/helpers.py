"""Shared test helpers: plain functions, constants and context managers that test modules import
(`from helpers import ...`). Fixtures live in conftest.py, which pytest loads on its own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from filelock import FileLock

from slimish import moe

ROOT = Path(__file__).resolve().parents[1]
SGLANG_DOUBLE = ROOT / "tests" / "sglang_double"
# The one tool of the chat, gateway and OpenAI-route tests (OpenAI function-tool form).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def post(url: str, path: str, body: object = None, timeout: float = 120.0, **kw: object) -> httpx.Response:
    """POST `body` as JSON (an empty object when None) to `url + path`. Test servers speak plain
    HTTP: `verify=False` skips building the default TLS context, ~65 ms a request on this CPU."""
    return httpx.post(url + path, json=body if body is not None else {}, timeout=timeout, verify=False, **kw)


def generate_response(
    url: str, *, headers: dict | None = None, timeout: float = 120.0, status: int | None = 200, **body: object
) -> httpx.Response:
    """POST a native `/generate` with `body`'s fields to `url` (an engine or a router): the response,
    whose status is checked to be `status` (not checked when None). For tests that read headers
    or a refusal; `generate` is the common case."""
    r = post(url, "/generate", body, timeout=timeout, headers=headers)
    if status is not None:
        assert r.status_code == status, r.text
    return r


def generate(url: str, *, headers: dict | None = None, timeout: float = 120.0, **body: object) -> dict | list:
    """POST a native `/generate` with `body`'s fields to `url`: the reply's JSON (a list for a
    batch), the status checked to be 200."""
    return generate_response(url, headers=headers, timeout=timeout, **body).json()


def reference_routes(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """The routers' top-k of every position in one forward of `ids`: int32 [len(ids), layers, top_k]."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = [
        router.register_forward_hook(lambda m, a, out, layer=layer: chosen.__setitem__(layer, out[2]))
        for layer, router in moe.routers(model).items()
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    rows = np.zeros((len(ids), cfg.num_hidden_layers, cfg.num_experts_per_tok), dtype=np.int32)
    for layer, indices in chosen.items():
        rows[:, layer] = indices.numpy()
    return rows


def decode_sglang_routes(encoded: str, layers: int, top_k: int) -> np.ndarray:
    """`meta_info.routed_experts` read as SGLang 0.5.23 reads it, written from its source only (not
    from slimish/protocol.py, which it checks): `np.frombuffer(pybase64.b64decode(s.encode("utf-8")),
    dtype=np.int32)` (python/sglang/srt/state_capturer/routed_experts.py:166-174), the flat array of
    the host buffer's int32 `[tokens, num_layers, topk_size]` rows (state_capturer/base.py:63-75),
    reshaped to that shape."""
    import base64

    return np.frombuffer(base64.b64decode(encoded.encode("utf-8")), dtype=np.int32).reshape(-1, layers, top_k)


def metric_total(url: str, sample: str, **labels: str) -> float:
    """The sum of a Prometheus sample over its label sets (those matching `labels`), read with
    prometheus_client's own parser: 0 when no series exists yet."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def process_exited(pid: int) -> bool:
    """`pid` has exited: gone, or its main thread a zombie (its other threads may still be exiting;
    `ServerProcess.exited` counts it as exited from there)."""
    from slimish.processes import main_thread_exited

    return main_thread_exited(pid) or not Path(f"/proc/{pid}").exists()


def wait_for(predicate: Callable[[], bool], what: str = "the condition", timeout: float = 30.0) -> None:
    """Poll `predicate` with a bound (never a sleep standing in for synchronisation)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


@contextmanager
def serving(app, what: str) -> Iterator[str]:
    """An ASGI app served by uvicorn in a thread of the test process on a free loopback port:
    its URL, for as long as the block runs."""
    import uvicorn

    from slimish.net import listening_socket

    sock = listening_socket()
    server = uvicorn.Server(uvicorn.Config(app, port=sock.getsockname()[1], log_level="warning"))
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, f"{what} did not start within 30 s"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


@dataclass
class FakeModel:
    """An OpenAI-compatible `/v1/chat/completions` that replies from a script: each entry is a
    list of (tool name, raw arguments) calls, or a final text. Past the script it says "done"."""

    url: str = ""
    script: list[list[tuple[str, str]] | str] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"key", "body"} per call

    def reply(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        self.requests.append({"key": key, "body": body})
        step = self.script.pop(0) if self.script else "done"
        n = len(self.requests)
        if isinstance(step, str):
            message, finish = {"role": "assistant", "content": step}, "stop"
        else:
            calls = [
                {"id": f"call_{n}_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                for i, (name, args) in enumerate(step)
            ]
            message, finish = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        return {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "m"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def tool_results(self, request: int = -1) -> list[str]:
        """What the agent had sent back as tool results by that request."""
        return [m["content"] for m in self.requests[request]["body"]["messages"] if m["role"] == "tool"]


@contextmanager
def fake_model_server() -> Iterator[FakeModel]:
    """A `FakeModel` served in a thread of the test process (`model.url` its URL), for as long as the block runs."""
    model, app = FakeModel(), FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        return model.reply(await request.json(), request.headers.get("authorization", ""))

    with serving(app, "fake model server") as url:
        model.url = url
        yield model


@contextmanager
def running_router(**settings) -> Iterator[str]:
    """The slimish router in a thread of the test process (fast to start): its URL. Health
    checks run often, so tests that kill a worker see it marked down quickly."""
    import asyncio

    from slimish.router.app import create_app
    from slimish.router.config import RouterConfig
    from slimish.router.wire import bind

    cfg = RouterConfig(**{"health_check_interval": 0.2, "health_failure_threshold": 1, **settings})
    router, sock = create_app(cfg), bind("127.0.0.1", 0, reuse_port=False)
    loop, ready = asyncio.new_event_loop(), threading.Event()
    stop = asyncio.Event()
    thread = threading.Thread(
        target=lambda: loop.run_until_complete(router.serve([sock], ready=ready.set, stop=stop)), daemon=True
    )
    thread.start()
    assert ready.wait(30), "router did not start within 30 s"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@contextmanager
def running_engines(
    model_dir: Path, factory: pytest.TempPathFactory, n: int = 2, timeout: float = 120.0, **flags: object
) -> Iterator[list]:
    """`n` built-in engine processes loading their model at once (logs in a fresh directory);
    stopped when the block ends."""
    from slimish.launch.local import engine_process
    from slimish.processes import start_all

    logs = factory.mktemp("engine-logs")
    procs = [engine_process(model_dir, log_path=logs / f"engine{i}.log", **flags) for i in range(n)]
    try:
        start_all(procs, timeout=timeout)
        yield procs
    finally:
        for p in procs:
            p.stop()


def run_plugin(rollout, model_dir: Path, url: str, tok, sample, sampling_params: dict):
    """A rollout plugin on one sample, through a real `RolloutContext` on `url` (an engine or a
    router), as the manager calls it."""
    import asyncio

    from slimish.client import Client
    from slimish.config import RunConfig
    from slimish.rollout.api import RolloutContext, RolloutRuntime

    async def main():
        runtime = RolloutRuntime(RunConfig(model=str(model_dir)), Client(url), tok)
        try:
            return await rollout(RolloutContext(runtime, sample, sampling_params=sampling_params), sample)
        finally:
            await runtime.close()

    return asyncio.run(main())


def with_gateway(url: str, tok: object, body, **kw: object):
    """`body(gateway)` on an agent gateway in front of `url` (an engine or a router), started and
    stopped on a fresh event loop, as a rollout process runs it."""
    import asyncio

    from slimish.formats.model import ModelFormat
    from slimish.gateway.server import Gateway

    async def main():
        gateway = Gateway(url, ModelFormat(tok), **kw)
        await gateway.start()
        try:
            return await body(gateway)
        finally:
            await gateway.stop()

    return asyncio.run(main())


def make_cfg(model: Path, source: str, *overrides: str):
    """A rollout-test RunConfig: in stream order, no filter, 8 new tokens, then `overrides`."""
    from slimish.config import load_run_config

    base = [
        f"model={model}",
        f"data.source={source}",
        "data.shuffle=false",
        "rollout.filter_fn=null",
        "rollout.max_new_tokens=8",
    ]
    return load_run_config(None, [*base, *overrides])


def run_manager(cfg, router: str, rollout_fn, body, reward_fn=None, filter_fn=None, **hooks):
    """`body(manager)` on a fresh runtime, data stream and buffer, on a fresh event loop."""
    import asyncio

    from slimish.buffer import Buffer, Staleness
    from slimish.rollout.api import RolloutRuntime
    from slimish.rollout.data import PromptData
    from slimish.rollout.functions import RolloutFunctions
    from slimish.rollout.manager import RolloutManager

    async def main():
        runtime = await RolloutRuntime.create(cfg, router)
        try:
            buffer = Buffer(Staleness.of(cfg.buffer))
            return await body(
                RolloutManager(
                    runtime, PromptData(cfg.data), buffer, RolloutFunctions(rollout_fn, reward_fn, filter_fn, **hooks)
                )
            )
        finally:
            await runtime.close()

    return asyncio.run(main())


def accounted(m) -> bool:
    """Every prompt taken is kept, filtered, failed or requeued."""
    c = m.counters
    return c["prompts_taken"] == c["groups_kept"] + c["groups_filtered"] + c["groups_failed"] + len(m.requeued)


# A quickstart run cut to what shows a loop works: 2 prompts of 4 samples of 8 tokens a step, no SFT
# warm start, no eval, no ptx, every group kept (a random model's rewards have no spread).
SHORT_QUICKSTART = (
    "sft.steps=0",
    "eval.every=0",
    "rollout.rollout_batch_size=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "rollout.filter_fn=null",
    "algorithm.ptx_coef=0",
)


# A sync run's trainer takes every usable core by default (trainer.cpu_threads), whatever
# OMP_NUM_THREADS says: right for one run on a machine, not for `make test`'s two workers, each
# running one. Two 2-thread trainers on 2 cores spin on each other's cores: two 40-step quickstart
# runs at once took 170 s each with the default and 70 s with one thread (50 s for one run alone;
# 2026-12-07).
TRAINER_THREADS = "trainer.cpu_threads=1"


def quickstart_argv(tmp_path: Path, *overrides: str, model: Path, config: str = "configs/quickstart.yaml") -> list[str]:
    """The command line of a quickstart run in `tmp_path/run`, shortened by `overrides`. Its trainer
    trains on one thread (`TRAINER_THREADS`) unless an override says otherwise."""
    return [
        sys.executable,
        "-m",
        "slimish.train",
        "--config",
        str(ROOT / config),
        f"model={model}",
        f"run_dir={tmp_path / 'run'}",
        "checkpoint.every=0",
        TRAINER_THREADS,
        *overrides,
    ]


def rollout_once(tmp_path: Path, model: Path, router: str, source: str, flags: list[str], *overrides: str) -> list:
    """`slimish rollout --steps 1` in this process, 2 prompts x 2 samples from `source` in order, on
    the engines behind `router`: the samples it wrote (`overrides` add to or replace the settings)."""
    from slimish import cli
    from slimish.types import Sample

    out = tmp_path / "samples.jsonl"
    argv = ["rollout", "--steps", "1", "--out", str(out), *flags, f"model={model}", f"data.source={source}"]
    argv += ["data.shuffle=false", f"launch.router_url={router}", f"run_dir={tmp_path}"]
    argv += ["rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=2", *overrides]
    assert cli.main(argv) == 0
    return [Sample.from_dict(json.loads(line)) for line in out.read_text().splitlines()]


DOCS_COUNTS = "docs_counts"  # the user property tests/test_docs.py reports its counts under


def docs_summary(c: Counter[str]) -> str:
    """The session's line on the documentation's code blocks (tests/test_docs.py counts them)."""
    return (
        f"documentation code blocks: {c['python run'] + c['bash run']} run ({c['python run']} python, {c['bash run']} bash), "
        f"{c['python parsed'] + c['commands checked'] + c['configs validated']} checked ({c['python parsed']} python parsed only, "
        f"{c['commands checked']} slimish commands, {c['configs validated']} configs)"
    )


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Path:
    """`build(path)` run once per test session, its result a directory `path` that session
    fixtures hand out. `make test` runs the suite on several pytest-xdist workers, each with its
    own session fixtures; they share the parent of their base temp directories, so the first
    worker to ask builds there under a lock and the others wait and read it (a build that raised
    is not marked built: the next asker builds again, from an empty directory)."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path, done = root / name, root / f"{name}.built"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


def run_quickstart(
    tmp_path: Path,
    *overrides: str,
    model: Path | None = None,
    timeout: float = 1200,
    config: str = "configs/quickstart.yaml",
) -> list[dict]:
    """`python -m slimish.train --config configs/quickstart.yaml` (or `config`), shortened by
    `overrides`, on `model` or a fresh tiny model as `make demo` builds it; its metrics rows (it
    must exit 0)."""
    from slimish.metrics import read_metrics
    from slimish.tiny_model import make_tiny_model

    model = model or make_tiny_model(tmp_path / "model", arch="llama", size="tiny", seed=0)
    argv = quickstart_argv(tmp_path, *overrides, model=model, config=config)
    done = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(tmp_path / "run")


def torchrun_ranks(worker: Path, args: list[str], out: Path, timeout: float = 300) -> dict[int, dict]:
    """`worker args...` on 2 torchrun ranks; each writes `out/rank{r}.json` (an `error` key when
    it failed). Own session, so a hung run is killed with all its ranks."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # its rendezvous on a port it binds itself: none picked free for it to lose
        "--nproc-per-node",
        "2",
        str(worker),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"{worker.name} did not finish within {timeout:.0f} s:\n{stderr[-4000:]}")
    results = {}
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results (rc={proc.returncode}):\n{stderr[-4000:]}"
        results[rank] = json.loads(path.read_text())
        assert "error" not in results[rank], f"rank {rank} failed:\n{results[rank]['error']}"
    assert proc.returncode == 0, stderr[-4000:]
    return results


# A rollout plugin that kills one engine while the first group of step 3 starts (4 groups a step,
# no filter), once; `{kill}` is the body of `kill_one_engine()`.
KILL_PLUGIN = """
import os, signal
from pathlib import Path
from rollout_plugins import math

def kill_one_engine():
{kill}

async def rollout(ctx, sample):
    marker = Path(os.environ["KILL_MARKER"])
    if sample.group_id == 8 and sample.index == 0 and not marker.exists():
        marker.write_text("killed")
        kill_one_engine()
    return await math.rollout(ctx, sample)
"""


def assert_run_survives_an_engine_kill(
    tmp_path: Path,
    kill: str,
    *overrides: str,
    env: dict[str, str] | None = None,
    restarted: str = "launch/engines_restarted",
) -> None:
    """A 4-step run on 2 engines in which `kill` kills one mid-rollout of step 3: the router
    retries its requests elsewhere, the run restarts it before the next push, and the run
    finishes with every prompt trained once, none failed, and step 4 on step 3's weights.
    With `restarted="launch/router_restarted"`, `kill` kills the router instead."""
    from slimish.metrics import read_metrics
    from slimish.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama", size="tiny", seed=0)
    plugin = tmp_path / "kill_plugin.py"
    plugin.write_text(KILL_PLUGIN.replace("{kill}", "\n".join("    " + line for line in kill.strip().splitlines())))
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "slimish.train",
        f"model={model}",
        f"run_dir={run_dir}",
        "steps=4",
        "data.source=task:max_digit",
        "launch.engines=2",
        f"rollout.rollout_fn={plugin}:rollout",
        "rollout.filter_fn=null",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=8",
        "eval.every=0",
        "checkpoint.every=0",
        *overrides,
    ]
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "KILL_MARKER": str(tmp_path / "killed")}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "killed").exists()  # the fault did happen

    rows = [r for r in read_metrics(run_dir) if r["step"] >= 1]
    assert [r[restarted] for r in rows] == [0.0, 0.0, 1.0, 0.0]
    assert sum(r["rollout/groups_failed"] for r in rows) == 0  # the router retried the dead engine's requests
    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert sorted(i for t in trained for i in t["group_ids"]) == list(range(16))  # every prompt once
    assert trained[-1]["versions"] == [[3]] * 4  # step 4 ran on the weights pushed after step 3, both engines
    assert "had exited: restarted" in done.stdout + done.stderr
