"""The black-box harness runner (`slimish/gateway/harness.py`) on real processes, and the example
harness (`rollout_plugins/harness_task/agent.py`, `rollout_plugins/cli_harness.py`) against a
scripted fake OpenAI-compatible server in a thread.

Programs are small `python -c` scripts: what they see (environment, cwd, files) they print, and
the tests read it back from the captured stdout.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import FakeModel, fake_model_server

from rollout_plugins.harness_task.task import TASK, score, task_files
from slimish.gateway.harness import HarnessLimits, HarnessRun, gateway_env, run_harness
from slimish.net import free_port
from slimish.types import Sample, SampleStatus

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "rollout_plugins" / "harness_task" / "agent.py"
FAST = HarnessLimits(wall_s=20.0, kill_grace_s=0.5)


def run(code: str, env: dict[str, str] | None = None, limits: HarnessLimits = FAST, **kw: Any) -> HarnessRun:
    return asyncio.run(run_harness([sys.executable, "-c", code], env or {}, limits, **kw))


def running(marker: str) -> list[int]:
    """The host's live processes whose command line holds `marker` (a sandboxed program sees only
    its own PID namespace, so it cannot tell the host its pid; a zombie counts as dead: PID 1 of a
    container may never reap it)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                marker in (proc / "cmdline").read_text()
                and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
            ):
                pids.append(int(proc.name))
        except (OSError, ValueError, IndexError):  # not a process, or gone during the read
            pass
    return pids


def gone(marker: str, within_s: float = 3.0) -> bool:
    """Whether every process with `marker` in its command line has died."""
    deadline = time.monotonic() + within_s
    while running(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---- the runner ------------------------------------------------------------------------------


def test_env_is_added_to_a_minimal_one_and_the_trainers_secrets_stay_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIMISH_TEST_SECRET", "hunter2")
    with run(
        "import json, os; print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd()}))", {"MY_VAR": "42"}
    ) as r:
        seen = json.loads(r.stdout)
        assert r.exit_code == 0 and r.infra_error is None, r.stderr
        assert seen["env"]["MY_VAR"] == "42"
        assert "SLIMISH_TEST_SECRET" not in seen["env"]
        assert seen["cwd"] == str(r.workdir) == seen["env"]["HOME"] == seen["env"]["TMPDIR"]
        assert set(seen["env"]) <= {"MY_VAR", "PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PYTHONUNBUFFERED"}


def test_files_are_seeded_in_its_own_cwd_which_cleanup_removes(tmp_path: Path) -> None:
    code = "print(open('task.md').read() + open('sub/dir/data.txt').read()); open('left.txt', 'w').write('behind')"
    with run(code, files={"task.md": "the task|", "sub/dir/data.txt": "1 2 3"}) as r:
        assert r.stdout.strip() == "the task|1 2 3"
        assert r.workdir.name.startswith("harness-") and (r.workdir / "left.txt").read_text() == "behind"
    assert not r.workdir.exists()
    explicit = run("pass")
    assert explicit.workdir.is_dir()
    explicit.cleanup()
    explicit.cleanup()  # once is enough; again is harmless
    assert not explicit.workdir.exists()
    mine = tmp_path / "mine"
    with run("open('out.txt', 'w').write('x')", workdir=mine, files={"in.txt": "y"}) as r:
        assert r.workdir == mine.resolve()
    assert (mine / "out.txt").read_text() == "x" and (mine / "in.txt").exists()  # the caller's directory stays


def test_stdout_and_stderr_are_captured_bounded_and_the_exit_code_kept() -> None:
    code = "import sys; sys.stdout.write('a' * 100_000); sys.stderr.write('oops'); sys.exit(3)"
    with run(code, limits=HarnessLimits(wall_s=20, output_bytes=1000)) as r:
        assert (r.stdout, r.stdout_dropped) == ("a" * 1000, 99_000)
        assert (r.stderr, r.stderr_dropped) == ("oops", 0)
        assert r.exit_code == 3 and not r.timed_out
        assert r.infra_error is None  # a program's own failure may be the policy's doing: not infra


SLEEPER_WITH_CHILD = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60) # sleeper-child'])
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
time.sleep(60)
"""


def test_a_program_past_its_wall_budget_is_killed_with_its_children() -> None:
    limits = HarnessLimits(wall_s=1.5, kill_grace_s=0.5)
    start = time.monotonic()
    with run(SLEEPER_WITH_CHILD, limits=limits) as r:
        took = time.monotonic() - start
        assert r.timed_out and r.exit_code is None
        assert r.infra_error is not None and "timed out" in r.infra_error
        assert took < limits.wall_s + limits.kill_grace_s + 1.5, took
        assert limits.wall_s <= r.seconds <= took
        assert gone("# sleeper-child"), "the program's child survived the kill"


def test_children_left_running_by_a_finished_program_are_killed() -> None:
    """A background child that holds the output pipes would otherwise keep the run (and the pipes) open."""
    code = (
        "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60) # left-child'])"
    )
    start = time.monotonic()
    with run(code) as r:
        assert r.exit_code == 0 and not r.timed_out and r.infra_error is None
        assert time.monotonic() - start < 5
        assert gone("# left-child")


def test_a_program_allocating_past_its_memory_limit_fails_instead_of_taking_the_machine() -> None:
    with run("b = bytearray(4 << 30); print('allocated')", limits=HarnessLimits(wall_s=20, memory_mb=256)) as r:
        assert r.exit_code not in (0, None), r
        assert "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_a_program_past_its_cpu_limit_is_killed_by_the_kernel() -> None:
    with run("while True: pass", limits=HarnessLimits(wall_s=20, cpu_s=1)) as r:
        assert r.exit_code is None and not r.timed_out
        assert r.infra_error == "killed by signal SIGXCPU"
        assert r.seconds < 10


def test_a_program_that_does_not_exist_is_an_infra_error_not_an_exception() -> None:
    with asyncio.run(run_harness(["/nonexistent/harness", "--flag"], {}, FAST)) as r:
        assert r.exit_code is None and not r.timed_out
        assert r.infra_error is not None and r.infra_error.startswith("failed to start")


def test_bad_arguments_raise() -> None:
    for argv, files, error in [
        ([], None, TypeError),
        (["x", 1], None, TypeError),
        (["true"], {"../up.txt": ""}, ValueError),
        (["true"], {"/etc/x": ""}, ValueError),
        (["true"], {"a.txt": b"bytes"}, TypeError),
    ]:
        with pytest.raises(error):
            asyncio.run(run_harness(argv, {}, FAST, files=files))
    with pytest.raises(ValueError):
        asyncio.run(run_harness(["true"], {}, HarnessLimits(wall_s=0)))
    with pytest.raises(ValueError):
        asyncio.run(run_harness(["true"], {}, HarnessLimits(memory_mb=-1)))
    with pytest.raises(ValueError, match="processes must be a positive int, got None"):
        asyncio.run(run_harness(["true"], {}, HarnessLimits(processes=None)))  # type: ignore[arg-type]


def test_cancelling_a_run_kills_the_program_and_removes_its_workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end of a rollout step cancels leftover rollouts: their harnesses must not live on."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where its working directory is made
    code = "import time; time.sleep(60) # cancelled-run"

    async def main() -> None:
        task = asyncio.create_task(run_harness([sys.executable, "-c", code], {}, FAST))
        while not running("# cancelled-run"):
            assert not task.done(), task.result()
            await asyncio.sleep(0.05)
        assert [p.name[:8] for p in tmp_path.iterdir()] == ["harness-"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert gone("# cancelled-run")
    assert not list(tmp_path.iterdir())


def test_harnesses_run_concurrently_on_one_loop() -> None:
    async def main() -> list[HarnessRun]:
        return await asyncio.gather(
            *(run_harness([sys.executable, "-c", "import time; time.sleep(1)"], {}, FAST) for _ in range(6))
        )

    start = time.monotonic()
    runs = asyncio.run(main())
    assert all(r.exit_code == 0 for r in runs)
    assert len({r.workdir for r in runs}) == 6
    assert time.monotonic() - start < 4.5  # 6 s one after another
    for r in runs:
        r.cleanup()


def test_gateway_env_names_the_session_by_its_key() -> None:
    assert gateway_env("http://127.0.0.1:8123/", "7-0-abc") == {
        "OPENAI_BASE_URL": "http://127.0.0.1:8123/v1",
        "OPENAI_API_KEY": "7-0-abc",
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:8123",
        "ANTHROPIC_API_KEY": "7-0-abc",
        "ANTHROPIC_AUTH_TOKEN": "7-0-abc",
    }
    with pytest.raises(ValueError):
        gateway_env("http://127.0.0.1:8123", "")


# ---- the example harness against a scripted model ---------------------------------------------


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeModel]:
    with fake_model_server() as model:
        yield model


@pytest.fixture
def fake_model(fake_server: FakeModel) -> FakeModel:
    fake_server.script, fake_server.requests = [], []
    return fake_server


def run_agent(model: FakeModel, numbers: list[int], **kw: Any) -> HarnessRun:
    env, files = gateway_env(model.url, "session-key-1"), task_files(TASK, {"numbers": numbers})
    limits = HarnessLimits(wall_s=60)
    return asyncio.run(run_harness([sys.executable, str(AGENT)], env, limits, files, readable=[AGENT.parent], **kw))


def test_the_agent_does_the_task_with_tool_calls_and_the_checker_gives_1(fake_model: FakeModel) -> None:
    fake_model.script = [
        [("read_file", json.dumps({"path": "numbers.txt"}))],
        [("write_file", json.dumps({"path": "answer.txt", "content": "60\n"}))],
        "Wrote the sum.",
    ]
    with run_agent(fake_model, [10, 20, 30]) as r:
        assert r.exit_code == 0 and r.infra_error is None, r.stderr
        assert (r.workdir / "answer.txt").read_text() == "60\n"
        assert score(r.workdir, "60") == 1.0 and score(r.workdir, "61") == 0.0
        assert len(fake_model.requests) == 3
        assert {q["key"] for q in fake_model.requests} == {
            "Bearer session-key-1"
        }  # the gateway finds the session by it
        first = fake_model.requests[0]["body"]
        assert first["messages"][-1]["content"] == TASK + "\n"  # task.md
        assert {t["function"]["name"] for t in first["tools"]} == {"read_file", "write_file"}
        assert fake_model.tool_results(1) == ["10\n20\n30\n"]
        assert fake_model.tool_results(2)[-1].startswith("wrote 3 chars")


def test_the_agent_refuses_paths_outside_its_workdir_and_survives_bad_arguments(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    fake_model.script = [
        [
            ("write_file", json.dumps({"path": "../escape.txt", "content": "x"})),
            ("write_file", json.dumps({"path": str(tmp_path / "abs.txt"), "content": "x"})),
            ("read_file", json.dumps({"path": "/etc/hostname"})),
            ("write_file", "{not json"),
            ("write_file", json.dumps({"path": 5, "content": "x"})),
            ("read_file", json.dumps(["numbers.txt"])),
            ("read_file", json.dumps({"path": "missing.txt"})),
            ("delete_everything", "{}"),
        ]
    ]
    with run_agent(fake_model, [1, 2], workdir=tmp_path / "work") as r:
        assert r.exit_code == 0 and r.infra_error is None, r.stderr
        results = fake_model.tool_results()
        assert len(results) == 8 and all(x.startswith("error:") for x in results), results
        assert all("outside the working directory" in x for x in results[:3])
        assert "no tool named 'delete_everything'" in results[-1]
        assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "abs.txt").exists()
        assert score(r.workdir, "3") == 0.0  # no answer written: a bad reward, not a crash


# ---- the rollout function --------------------------------------------------------------------


class FakeContext:
    """What `rollout_plugins.cli_harness` uses of a RolloutContext: the session's environment and
    its captured samples (one per session that reached the model, here)."""

    def __init__(self, model: FakeModel, base_url: str) -> None:
        self.model, self.base_url = model, base_url

    async def agent_env(self) -> dict[str, str]:
        return gateway_env(self.base_url, "session-key-2")

    def captured_samples(self) -> list[Sample]:
        return [Sample(prompt="captured", status=SampleStatus.COMPLETED)] if self.model.requests else []


def test_the_rollout_function_scores_the_captured_samples(fake_model: FakeModel) -> None:
    from rollout_plugins.cli_harness import (
        rollout,
    )  # here: it needs SampleStatus.INFRA_FAILED, the runner's tests do not

    fake_model.script = [[("write_file", json.dumps({"path": "answer.txt", "content": "7"}))]]
    sample = Sample(prompt=[{"role": "user", "content": TASK}], label="7", metadata={"numbers": [3, 4]})
    (out,) = asyncio.run(rollout(FakeContext(fake_model, fake_model.url), sample))
    assert (out.prompt, out.reward, out.status) == ("captured", 1.0, SampleStatus.COMPLETED)


def test_a_harness_that_never_reaches_the_model_comes_back_infra_failed(fake_model: FakeModel) -> None:
    from rollout_plugins.cli_harness import (
        rollout,
    )  # here: it needs SampleStatus.INFRA_FAILED, the runner's tests do not

    sample = Sample(prompt=TASK, label="7", metadata={"numbers": [3, 4]})
    (out,) = asyncio.run(
        rollout(FakeContext(fake_model, f"http://127.0.0.1:{free_port()}"), sample)
    )  # nothing listens there
    assert out is sample and out.status == SampleStatus.INFRA_FAILED and out.reward is None
    assert out.error is not None and "no model call (exit code 1)" in out.error and "APIConnectionError" in out.error
