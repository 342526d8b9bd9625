"""Shared fixtures: tiny models are built once per test session; servers are real processes."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # notes/cpu-runtime.md: 2 threads were 5x slower here
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


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
def running_router(**settings) -> Iterator[str]:
    """The slimish router in a thread of the test process (fast to start): its URL. Health
    checks run often, so tests that kill a worker see it marked down quickly."""
    import uvicorn

    from slimish.launch.local import free_port
    from slimish.router import RouterConfig, create_app

    cfg = RouterConfig(**{"health_check_interval": 0.2, "health_failure_threshold": 1, **settings})
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "router did not start within 30 s"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)
