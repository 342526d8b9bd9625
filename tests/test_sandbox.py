"""The harness sandbox (`slimish/gateway/sandbox.py`): escape attempts, each a program run as a
harness through `run_harness`, against real servers (two engines behind the router, the agent
gateway in front of it), and the fallback to the plain runner.

Each escape program prints one JSON line: what it tried and what happened. Where the plain runner
is safe to run it on, the same program runs there too and escapes: what the sandbox stops is real.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from helpers import with_gateway
from test_harness import gone, running

from slimish.gateway import sandbox
from slimish.gateway.harness import HarnessLimits, HarnessRun, SandboxUnavailable, gateway_env, run_harness
from slimish.launch.config import LaunchConfig
from slimish.launch.local import router_process
from slimish.rollout.python_tool import run_python

pytestmark = pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox: {sandbox.unavailable()}")

LIMITS = HarnessLimits(wall_s=20.0, kill_grace_s=0.5, processes=64, disk_mb=16, memory_mb=512, cpu_s=10)
GENERATE_ONLY = True  # the session's shared engine is enough
PLAIN = HarnessLimits(wall_s=20.0, kill_grace_s=0.5, sandbox=False)


def harness(code: str, limits: HarnessLimits = LIMITS, env: dict[str, str] | None = None, **kw: Any) -> HarnessRun:
    return asyncio.run(run_harness([sys.executable, "-c", code], env or {}, limits, **kw))


def result(run: HarnessRun) -> dict[str, Any]:
    """The program's JSON line, the run having ended on its own."""
    assert run.exit_code == 0 and run.infra_error is None, (run.infra_error, run.stderr[-2000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


# ---- the filesystem --------------------------------------------------------------------------

READ = """
import json, os, sys
seen = {}
for path in sys.argv[1:]:
    try:
        seen[path] = open(path).read() if os.path.isfile(path) else sorted(os.listdir(path))
    except OSError as e:
        seen[path] = e.__class__.__name__
print(json.dumps(seen))
"""


def test_the_run_directory_home_and_repository_are_not_there(tmp_path: Path) -> None:
    secret = tmp_path / "run" / "checkpoints" / "reward_checker.py"
    secret.parent.mkdir(parents=True)
    secret.write_text("ANSWER = 42")
    paths = [str(secret), str(tmp_path), "/root", str(Path(__file__)), "/etc/hostname"]
    with _read(paths) as run:
        seen = result(run)
    print("ESCAPE read-run-dir:", seen)
    assert seen[str(secret)] == seen[str(tmp_path)] == seen[str(Path(__file__))] == "FileNotFoundError"
    needed = [sys.prefix, sys.base_prefix, *os.environ["PATH"].split(os.pathsep)]  # what Python and PATH need
    assert set(seen["/root"]) <= {Path(p).parts[2] for p in needed if p.startswith("/root/")}, seen["/root"]
    assert isinstance(seen["/etc/hostname"], str)  # the system is there, read-only
    with asyncio.run(run_harness([sys.executable, "-c", READ, *paths], {}, PLAIN)) as plain:
        assert result(plain)[str(secret)] == "ANSWER = 42"  # the plain runner reads it


def _read(paths: list[str]) -> HarnessRun:
    return asyncio.run(run_harness([sys.executable, "-c", READ, *paths], {}, LIMITS))


def test_the_system_is_read_only_and_the_workdir_comes_back() -> None:
    system = [f"/usr/bin/slimish-escape-{os.getpid()}", f"/etc/slimish-escape-{os.getpid()}"]
    code = (
        "import json, os, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:] + ['/.slimish/host/evil']:\n"
        "    try: open(p, 'w'); out[p] = 'written'\n"
        "    except OSError as e: out[p] = e.__class__.__name__\n"
        "open('answer.txt', 'w').write('7'); os.remove('task.md'); os.symlink('/etc/passwd', 'leak')\n"
        "os.symlink('answer.txt', 'link'); os.mkfifo('fifo')\n"
        "print(json.dumps(out))\n"
    )
    try:
        run = asyncio.run(
            run_harness([sys.executable, "-c", code, *system], {}, LIMITS, {"task.md": "t", "keep/me.txt": "k"})
        )
    finally:
        written = [p for p in system if os.path.exists(p)]
        for p in written:  # a broken sandbox must not leave them on the host
            os.remove(p)
    assert not written
    with run:
        seen = result(run)
        assert set(seen.values()) <= {"OSError", "PermissionError", "FileNotFoundError"}, seen
        left = sorted(str(p.relative_to(run.workdir)) for p in run.workdir.rglob("*"))
        assert left == ["answer.txt", "keep", "keep/me.txt", "link"]  # no link out, no fifo; the deletion kept
        assert (run.workdir / "link").read_text() == "7"


def test_writing_until_the_disk_is_full_fills_its_own_tmpfs() -> None:
    code = (
        "import json, os, tempfile\n"
        "out = {}\n"
        "for where in ['.', tempfile.gettempdir(), '/tmp']:\n"
        "    n = 0\n"
        "    try:\n"
        "        with open(os.path.join(where, 'fill-' + str(len(out))), 'wb') as f:\n"
        "            while n < 1 << 30: f.write(b'x' * (1 << 20)); f.flush(); n += 1 << 20\n"
        "    except OSError as e: out[where] = [n, e.errno]\n"
        "    else: out[where] = [n, 0]\n"
        "print(json.dumps(out))\n"
    )
    with harness(code) as run:
        seen = result(run)
        print("ESCAPE disk-full:", seen)
        assert all(errno == 28 and n <= 16 << 20 for n, errno in seen.values()), seen  # ENOSPC at 16 MiB
        assert sum(p.stat().st_size for p in run.workdir.iterdir()) <= 16 << 20  # what came back, bounded


# ---- processes and limits --------------------------------------------------------------------

FORK_BOMB = """
import json, os, time
forks, error = 0, None
while error is None and forks < 100000:
    try:
        if os.fork() == 0:
            while True:  # every child forks on too, quietly (marker: fork-bomb)
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
        forks += 1
    except OSError as e:
        error = e.errno
print(json.dumps({"forks": forks, "errno": error}), flush=True)
"""


def test_a_fork_bomb_is_stopped_at_its_process_limit_and_killed() -> None:
    with harness(FORK_BOMB + "# fork-bomb") as run:
        seen = result(run)
    print("ESCAPE fork-bomb:", seen, f"{run.seconds:.2f} s")
    assert seen["errno"] == 11 and seen["forks"] < LIMITS.processes  # EAGAIN: RLIMIT_NPROC of its own user
    assert gone("# fork-bomb")


SETSID = """
import subprocess, sys
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # setsid-child'], start_new_session=True)
"""


def test_a_setsid_child_does_not_outlive_the_harness() -> None:
    with harness(SETSID) as run:
        assert run.exit_code == 0 and run.infra_error is None, run.stderr
    assert gone("# setsid-child", within_s=1.0)
    with asyncio.run(run_harness([sys.executable, "-c", SETSID], {}, PLAIN)) as plain:
        assert plain.exit_code == 0
    survivors = running("# setsid-child")  # the plain runner's escapes the kill
    print("ESCAPE setsid: sandbox 0 left; plain runner left", len(survivors))
    for pid in survivors:
        os.kill(pid, 9)
    assert survivors


RAISE = """
import ctypes, json, os, resource
out = {}
for name in ['RLIMIT_NPROC', 'RLIMIT_AS', 'RLIMIT_CPU']:
    which = getattr(resource, name)
    soft, hard = resource.getrlimit(which)
    try:
        resource.setrlimit(which, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)); out[name] = 'raised'
    except (ValueError, OSError) as e:
        out[name] = [hard, str(e)]
for name, call in [('setuid0', lambda: os.setuid(0)), ('unshare_user', lambda: ctypes.CDLL(None, use_errno=True).unshare(0x10000000))]:
    try:
        out[name] = 'done' if call() == 0 else 'errno ' + str(ctypes.get_errno())
    except OSError as e:
        out[name] = e.__class__.__name__
out['uid'] = os.getuid()
print(json.dumps(out))
"""


def test_it_cannot_raise_its_own_limits_or_become_root() -> None:
    with harness(RAISE) as run:
        seen = result(run)
    print("ESCAPE raise-limits:", seen)
    assert seen["RLIMIT_NPROC"][0] == LIMITS.processes and seen["RLIMIT_AS"][0] == LIMITS.memory_mb << 20
    assert all("not allowed to raise" in seen[n][1] for n in ("RLIMIT_NPROC", "RLIMIT_AS", "RLIMIT_CPU"))
    assert seen["setuid0"] == "PermissionError" and seen["uid"] != 0
    assert seen["unshare_user"] == "errno 1"  # EPERM: no new user namespace (and so no caps) from inside
    if os.geteuid() == 0:  # the plain runner's program is root: it raises them
        with asyncio.run(run_harness([sys.executable, "-c", RAISE], {}, PLAIN)) as plain:
            assert result(plain)["RLIMIT_CPU"] == "raised"


# ---- the network -----------------------------------------------------------------------------

CONNECT = """
import json, socket, sys, urllib.request
out = {}
for name, host, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((host, port), timeout=3).close(); out[name] = 'connected'
    except OSError as e:
        out[name] = e.__class__.__name__ + ' ' + str(e.errno)
req = urllib.request.Request(
    sys.argv[2] + '/v1/chat/completions',
    data=json.dumps({'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4}).encode(),
    headers={'Authorization': 'Bearer ' + sys.argv[3], 'Content-Type': 'application/json'},
)
out['gateway'] = json.loads(urllib.request.urlopen(req, timeout=30).read())['choices'][0]['finish_reason']
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def router(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router process in front of the (shared, generate-only) engine: the ports a program must not reach."""
    with router_process(LaunchConfig(), [engine], tmp_path_factory.mktemp("logs")).start(60) as proc:
        yield proc.url


def test_only_the_gateway_of_its_session_is_reachable(engine: str, router: str, tok: Any) -> None:
    targets = [
        (name, urlsplit(url).hostname, urlsplit(url).port) for name, url in [("router", router), ("engine", engine)]
    ]
    targets += [("other-host", "10.255.255.1", 80), ("dns", "1.1.1.1", 53), ("ipv6-loopback", "::1", targets[0][2])]

    async def body(gateway: Any) -> tuple[dict, dict]:
        key = gateway.new_session("escape")
        env = gateway_env(gateway.url, key)
        argv = [sys.executable, "-c", CONNECT, json.dumps(targets), gateway.url, key]
        with await run_harness(argv, env, LIMITS) as run, await run_harness(argv, env, PLAIN) as plain:
            return result(run), result(plain)

    seen, plain = with_gateway(router, tok, body, default_sampling={"max_new_tokens": 4})
    print("ESCAPE network:", seen)
    assert seen["gateway"] in ("stop", "length")  # its own session's model call goes through
    assert all(seen[name].startswith("ConnectionRefusedError") for name in ["router", "engine", "ipv6-loopback"]), seen
    assert all(seen[name].split()[0] in ("OSError", "ConnectionRefusedError") for name in ["other-host", "dns"]), seen
    assert plain["router"] == plain["engine"] == "connected"  # the plain runner reaches them directly


# ---- failures and the fallback ---------------------------------------------------------------


def test_a_gateway_that_resets_the_relayed_request_ends_the_agents_connection() -> None:
    """PID 1's relay, one connection: the request is relayed, then the host side closes with it
    unread (a gateway that refused the connection), so the relay's read of it fails with a reset.
    The agent's connection must end. It hung before: the failing direction closed both sockets,
    which left the other direction's thread blocked in `recv` and the agent's socket open, and the
    agent's call waited out the wall budget (1 of 15 runs of test_harness's unreachable-model test)."""
    import socket
    import threading
    import time

    from slimish.gateway.sandbox_init import relay

    agent, conn = socket.socketpair()
    upstream, host = socket.socketpair()
    worker = threading.Thread(target=relay, args=(conn, upstream), daemon=True)
    worker.start()
    agent.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n")
    host.settimeout(10)
    assert host.recv(1, socket.MSG_PEEK) == b"P"  # relayed, and left unread
    wchan, deadline = Path(f"/proc/self/task/{worker.native_id}/wchan"), time.monotonic() + 10
    while wchan.read_text() != "unix_stream_read_generic" and time.monotonic() < deadline:
        time.sleep(0.01)  # until the relay thread waits for more from the agent, where it hung
    host.close()
    agent.settimeout(10)
    try:
        assert agent.recv(100) == b""
    except ConnectionResetError:
        pass
    worker.join(timeout=10)
    assert not worker.is_alive()
    agent.close()


def test_a_sandbox_failure_is_an_infra_error() -> None:
    """Seed files past the tmpfs: PID 1 cannot copy them in, the program never runs."""
    with harness("print('ran')", limits=HarnessLimits(wall_s=20, disk_mb=1), files={"big.txt": "x" * (2 << 20)}) as run:
        assert run.sandboxed and run.exit_code is None and "ran" not in run.stdout
        assert run.infra_error is not None and run.infra_error.startswith("sandbox failed"), run.infra_error
    from rollout_plugins.cli_harness import scored
    from slimish.types import Sample, SampleStatus

    class NoCapture:
        def captured_samples(self) -> list[Sample]:
            return []

    (out,) = scored(NoCapture(), Sample(prompt="p"), run, reward=0.0)
    assert out.status == SampleStatus.INFRA_FAILED and out.reward is None and out.error == run.infra_error


def test_without_namespaces_it_falls_back_with_a_warning_naming_what_is_not_enforced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "unavailable", lambda: "forced by the test")
    secret = tmp_path / "secret.txt"
    secret.write_text("s")
    with pytest.warns(SandboxUnavailable, match=r"forced by the test.*private filesystem.*network.*setsid") as w:
        run = _read([str(secret)])
    assert len(w) == 1 and not run.sandboxed
    assert result(run)[str(secret)] == "s"  # it is the plain runner: the file is readable
    run.cleanup()


def test_model_written_python_runs_in_the_sandbox(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("s")
    ok = asyncio.run(run_python(f"print(sum(range(10))); print(open({str(tmp_path / 'secret')!r}).read())"))
    assert ok.infra_error is None and ok.stdout == "45\n" and "FileNotFoundError" in ok.observation()
    loop = asyncio.run(run_python("while True: pass", HarnessLimits(wall_s=1.0, kill_grace_s=0.2)))
    assert loop.timed_out and loop.infra_error is None and loop.observation() == "timed out"
    net = asyncio.run(run_python("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)"))
    assert net.exit_code == 1 and "OSError" in net.stderr and net.infra_error is None


def test_at_the_wall_budget_it_gets_sigterm_and_what_it_saves_comes_back() -> None:
    code = (
        "import signal, sys, time\n"
        "def save(*_):\n"
        "    open('saved.txt', 'w').write('partial'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, save)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    with harness(code, limits=HarnessLimits(wall_s=1.0, kill_grace_s=5.0)) as run:
        assert run.timed_out and run.exit_code is None and run.infra_error.startswith("timed out")
        assert (run.workdir / "saved.txt").read_text() == "partial"
    with harness("import time; time.sleep(60)", limits=HarnessLimits(wall_s=1.0, kill_grace_s=5.0)) as plain:
        assert plain.timed_out and plain.seconds < 5.0  # SIGTERM's default action ended it, not the SIGKILL
