"""Shared fixtures: tiny models are built once per test session; servers are real processes."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # docs/benchmarks.md, CPU facts: 2 threads were 5x slower here
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from family_cases import family_dirs, served  # noqa: E402,F401  (fitted model-family models, an engine on one)


def _build(factory: pytest.TempPathFactory, arch: str, seed: int) -> Path:
    from slimish.tiny_model import make_tiny_model

    return make_tiny_model(factory.mktemp("models") / f"tiny-{arch}-seed{seed}", arch=arch, size="tiny", seed=seed)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default test model: llama (untied head), whose random greedy output varies token to
    token, so exact-token assertions have power (tied random models just repeat their input)."""
    return _build(tmp_path_factory, "llama", 0)


@pytest.fixture(scope="session")
def tiny_model_dir_other_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, other weights: for weight-loading tests."""
    return _build(tmp_path_factory, "llama", 1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings (`lm_head.weight` is `model.embed_tokens.weight`)."""
    return _build(tmp_path_factory, "qwen2", 0)


@pytest.fixture(scope="session")
def tok(tiny_model_dir: Path):
    """The default test model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real built-in engine process on the default tiny model, one per test module: its URL."""
    from slimish.launch.local import engine_process

    with engine_process(tiny_model_dir, log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc.url


@contextmanager
def serving(app, what: str) -> Iterator[str]:
    """An ASGI app served by uvicorn in a thread of the test process on a free loopback port:
    its URL, for as long as the block runs."""
    import uvicorn

    from slimish.net import free_port

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
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


@contextmanager
def running_router(**settings) -> Iterator[str]:
    """The slimish router in a thread of the test process (fast to start): its URL. Health
    checks run often, so tests that kill a worker see it marked down quickly."""
    import asyncio

    from slimish.router import RouterConfig, create_app
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


def with_capture(url: str, tok: object, body, **kw: object):
    """`body(capture)` on an agent gateway in front of `url` (an engine or a router), started and
    stopped on a fresh event loop, as a rollout process runs it."""
    import asyncio

    from slimish.formats.model import ModelFormat
    from slimish.rollout.capture import CaptureServer

    async def main():
        capture = CaptureServer(url, ModelFormat(tok), **kw)
        await capture.start()
        try:
            return await body(capture)
        finally:
            await capture.stop()

    return asyncio.run(main())


ROOT = Path(__file__).resolve().parents[1]
SGLANG_DOUBLE = ROOT / "tests" / "sglang_double"


@pytest.fixture(scope="module")
def sglang_double(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`python -m sglang.launch_server` in children is tests/sglang_double: SGLang 0.5.23's command
    line and rules over the built-in engine (SGLang itself needs a GPU). Yields the file each
    start is recorded in (`{"argv", "pid"}` per line)."""
    record = tmp_path_factory.mktemp("sglang-double") / "starts.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SGLANG_DOUBLE), os.environ.get("PYTHONPATH")])))
        mp.setenv("SGLANG_SHIM_RECORD", str(record))
        yield record


def quickstart_argv(tmp_path: Path, *overrides: str, model: Path, config: str = "configs/quickstart.yaml") -> list[str]:
    """The command line of a quickstart run in `tmp_path/run`, shortened by `overrides`."""
    return [
        sys.executable,
        "-m",
        "slimish.train",
        "--config",
        str(ROOT / config),
        f"model={model}",
        f"run_dir={tmp_path / 'run'}",
        "checkpoint.every=0",
        *overrides,
    ]


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


@pytest.fixture(scope="session")
def quickstart_sft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's SFT warm start (held-out accuracy near chance), run once per session: an
    HF export that quickstart-task tests start RL from with `sft.steps=0`."""
    sft = tmp_path_factory.mktemp("quickstart-sft")
    run_quickstart(sft, "steps=0", "eval.every=0")
    return sft / "run" / "hf"


def torchrun_ranks(worker: Path, args: list[str], out: Path, timeout: float = 300) -> dict[int, dict]:
    """`worker args...` on 2 torchrun ranks; each writes `out/rank{r}.json` (an `error` key when
    it failed). Own session, so a hung run is killed with all its ranks."""
    from slimish.net import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
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
    tmp_path: Path, kill: str, *overrides: str, env: dict[str, str] | None = None
) -> None:
    """A 4-step run on 2 engines in which `kill` kills one mid-rollout of step 3: the router
    retries its requests elsewhere, the run restarts it before the next push, and the run
    finishes with every prompt trained once, none failed, and step 4 on step 3's weights."""
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
    assert [r["launch/engines_restarted"] for r in rows] == [0.0, 0.0, 1.0, 0.0]
    assert sum(r["rollout/groups_failed"] for r in rows) == 0  # the router retried the dead engine's requests
    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert sorted(i for t in trained for i in t["group_ids"]) == list(range(16))  # every prompt once
    assert trained[-1]["versions"] == [[3]] * 4  # step 4 ran on the weights pushed after step 3, both engines
    assert "had exited: restarted" in done.stdout + done.stderr


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


def post(url: str, path: str, body: object = None, timeout: float = 120.0, **kw: object) -> httpx.Response:
    """POST `body` as JSON (an empty object when None) to `url + path`."""
    return httpx.post(url + path, json=body if body is not None else {}, timeout=timeout, **kw)


def wait_for(predicate: Callable[[], bool], what: str = "the condition", timeout: float = 30.0) -> None:
    """Poll `predicate` with a bound (never a sleep standing in for synchronisation)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


@contextmanager
def running_engines(
    model_dir: Path, factory: pytest.TempPathFactory, n: int = 2, timeout: float = 120.0, **flags: object
) -> Iterator[list]:
    """`n` built-in engine processes loading their model at once (logs in a fresh directory);
    stopped when the block ends."""
    from slimish.launch.local import engine_process
    from slimish.launch.process import start_all

    logs = factory.mktemp("engine-logs")
    procs = [engine_process(model_dir, log_path=logs / f"engine{i}.log", **flags) for i in range(n)]
    try:
        start_all(procs, timeout=timeout)
        yield procs
    finally:
        for p in procs:
            p.stop()


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
    from slimish.rollout.manager import RolloutManager

    async def main():
        runtime = await RolloutRuntime.create(cfg, router)
        try:
            buffer = Buffer(Staleness.of(cfg.buffer))
            return await body(
                RolloutManager(runtime, PromptData(cfg.data), buffer, rollout_fn, reward_fn, filter_fn, **hooks)
            )
        finally:
            await runtime.close()

    return asyncio.run(main())


def accounted(m) -> bool:
    """Every prompt taken is kept, filtered, failed or requeued."""
    c = m.counters
    return c["prompts_taken"] == c["groups_kept"] + c["groups_filtered"] + c["groups_failed"] + len(m.requeued)


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two built-in engines behind the router, started as a run starts them, one pair per module."""
    from slimish.config import LaunchConfig
    from slimish.launch.local import local_servers

    with local_servers(LaunchConfig(engines=2), tiny_model_dir, tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Ten "What is i + i?" prompts labelled 2i, as JSONL: their path."""
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + {i}?", "label": str(2 * i)}) + "\n" for i in range(10))
    )
    return str(path)


def pytest_terminal_summary(terminalreporter) -> None:
    """How many documentation code blocks ran and were checked (tests/test_docs.py counts them),
    shown even under `pytest -q`."""
    docs = sys.modules.get("test_docs")
    if docs is not None and docs.COUNTS:
        terminalreporter.write_line(docs.summary())
