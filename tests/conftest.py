"""Shared fixtures: tiny models are built once per test session; servers are real processes. The
plain functions and constants tests import are in helpers.py."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # docs/benchmarks.md, CPU facts: 2 threads were 5x slower here
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from slimish.metrics import read_metrics  # noqa: E402

torch.set_num_threads(1)

from family_cases import family_dirs, family_engine, served  # noqa: E402,F401  (fitted models, engines on them)
from helpers import DOCS_COUNTS, SGLANG_DOUBLE, built_once, docs_summary, run_quickstart  # noqa: E402


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
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mixture of experts: 8 experts, top-2, renormalised weights (Qwen3-MoE's layout)."""
    return _build(tmp_path_factory, "qwen3_moe", 0)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mixture of experts with a gated shared expert and raw top-k weights (Qwen2-MoE's layout)."""
    return _build(tmp_path_factory, "qwen2_moe", 0)


@pytest.fixture(scope="session")
def tok(tiny_model_dir: Path):
    """The default test model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real built-in engine process on the default tiny model, one per test module: its URL. A
    module that only generates on it (no weight push, adapter, pause or kill) says so with
    `GENERATE_ONLY = True` and gets the session's one such engine instead: an engine start saved."""
    if getattr(request.module, "GENERATE_ONLY", False):
        yield request.getfixturevalue("shared_engine")
        return
    from slimish.launch.local import engine_process

    with engine_process(tiny_model_dir, log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc.url


@pytest.fixture(scope="session")
def shared_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The engine of the modules that only generate (`engine`, GENERATE_ONLY): one for the session."""
    from slimish.launch.local import engine_process

    with engine_process(tiny_model_dir, log_path=tmp_path_factory.mktemp("logs") / "shared-engine.log") as proc:
        yield proc.url


@pytest.fixture(scope="session")
def moe_routes_engine(tiny_qwen3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A built-in engine on the tiny Qwen3-MoE that returns routes (`enable_return_routed_experts`),
    pages of 8 tokens, shared by the route tests: its URL."""
    from slimish.launch.local import engine_process

    log = tmp_path_factory.mktemp("logs") / "moe-routes-engine.log"
    with engine_process(tiny_qwen3_moe_dir, log_path=log, page_size=8, enable_return_routed_experts=True) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def sglang_double(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`python -m sglang.launch_server` in children is tests/sglang_double: SGLang 0.5.23's command
    line and rules over the built-in engine (SGLang itself needs a GPU). Yields the file each
    start is recorded in (`{"argv", "pid"}` per line); beside it, calls.jsonl records the control
    calls the servers served, in order (sglang/tensors.py)."""
    record = tmp_path_factory.mktemp("sglang-double") / "starts.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SGLANG_DOUBLE), os.environ.get("PYTHONPATH")])))
        mp.setenv("SGLANG_SHIM_RECORD", str(record))
        mp.setenv("SGLANG_SHIM_CALLS", str(record.parent / "calls.jsonl"))
        yield record


@pytest.fixture(scope="session")
def quickstart_sft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's SFT warm start (held-out accuracy near chance), run once per session: an
    HF export that quickstart-task tests start RL from with `sft.steps=0`."""
    sft = built_once(tmp_path_factory, "quickstart-sft", lambda path: run_quickstart(path, "steps=0", "eval.every=0"))
    return sft / "run" / "hf"


@pytest.fixture(scope="session")
def quickstart_grpo(tmp_path_factory: pytest.TempPathFactory, quickstart_sft: Path) -> tuple[list[dict], Path]:
    """The quickstart's sync GRPO run from the shared warm start, run once per session (a run is
    minutes): 40 steps, evaluated greedily on 1024 held-out prompts at steps 0, 30 and 40. Its metrics
    rows and run directory: the quickstart test and the async test's sync run read its first 30
    steps (the schedule is constant, so they are a 30-step run), the distillation test's teacher
    is its final export (`run / "hf"`)."""
    overrides = ["steps=40", "eval.every=30", "eval.n_prompts=1024", "sft.steps=0", "async_training=false"]
    tmp = built_once(
        tmp_path_factory, "quickstart-grpo", lambda path: run_quickstart(path, *overrides, model=quickstart_sft)
    )
    return read_metrics(tmp / "run"), tmp / "run"


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two built-in engines behind the router, started as a run starts them, one pair per module."""
    from slimish.launch.config import LaunchConfig
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


# `make test` hands each pytest-xdist worker a file at a time (`--dist loadfile`). Files that share
# a session build or engine run on one worker, in turn: the build is made once with nobody waiting
# on it idle, and the engines start once, not once per worker (each start is ~7 s of CPU).
SCOPES = {
    "families": (
        "test_family_formats",
        "test_tool_choice",
        "test_model_families",
        "test_gateway_responses",
        "test_gateway_anthropic",
    ),  # family_dirs and family_engine (family_cases.py)
    "quickstart-grpo": ("test_quickstart", "test_train_async", "test_opd"),  # quickstart_grpo
    "moe-routes": ("test_engine_routes", "test_sample_routes"),  # moe_routes_engine
}
SCOPE_OF = {f"tests/{name}.py": scope for scope, names in SCOPES.items() for name in names}
# Handed out first, longest first (measured 2026-12-06, two workers): the last unit a worker takes
# is what the other may sit idle for at the end. The rest follow most tests first (xdist's order).
LONGEST = (
    "quickstart-grpo",
    "families",
    "tests/test_lora_train.py",
    "tests/test_gateway_train.py",
    "tests/test_ppo_critic.py",
    "tests/test_fuzz.py",
    "tests/test_moe_train.py",
    "tests/test_train_faults2.py",
    "tests/test_true_on_policy.py",
    "tests/test_megatron_backend.py",
    "tests/test_tutorial.py",
    "tests/test_train_resume.py",
    "tests/test_policies.py",
    "tests/test_docs.py",
    "tests/test_gpu_smoke.py",
    "tests/test_colocate.py",
    "tests/test_tinker_cookbook.py",
    "tests/test_launch_ray.py",
)
RANK = {scope: i for i, scope in enumerate(LONGEST)}


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` with the scopes and the order above."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return SCOPE_OF.get(file, file)

        def _assign_work_unit(self, node) -> None:
            first = min(self.workqueue, key=lambda scope: RANK.get(scope, len(RANK)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return Scheduling(config, log)


DOCS: Counter[str] = Counter()  # what tests/test_docs.py ran and checked, from every worker's reports


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == DOCS_COUNTS:
                DOCS.update(value)


def pytest_terminal_summary(terminalreporter) -> None:
    """How many documentation code blocks ran and were checked, shown even under `pytest -q`."""
    if DOCS:
        terminalreporter.write_line(docs_summary(DOCS))
