"""Shared fixtures: tiny models are built once per test session; servers are real processes."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # notes/cpu-runtime.md: 2 threads were 5x slower here
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real built-in engine process on the default tiny model, one per test module: its URL."""
    from slimish.launch.local import engine_process

    with engine_process(tiny_model_dir, log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc.url
