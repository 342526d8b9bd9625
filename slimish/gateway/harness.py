"""Black-box agent harnesses: run an unmodified program and keep what it left behind.

Many agents are whole programs (a CLI coding agent, an SDK script) that cannot be changed to call
`ctx.chat`. They are trained as they are: the program runs with its model API pointed at the
agent gateway (`gateway_env`, or `ctx.agent_env()`), which records the exact tokens of every model
call, and the rollout function scores the files the program left in its working directory.

    with await run_harness([sys.executable, "agent.py"], env=await ctx.agent_env(), limits=HarnessLimits(wall_s=120),
                           files={"task.md": "..."}) as run:
        reward = check(run.workdir) if run.infra_error is None else None
    # the temporary working directory is gone here

`run_harness` never raises for anything the program does: a crash, a hang, a flood of output or a
missing executable comes back as a `HarnessRun` whose `infra_error` says why the run tells nothing
about the policy. Programs run in a bubblewrap sandbox (`sandbox.py`: a private filesystem, its
own PID namespace, user and limits, no network but its gateway); a host that cannot make one
gets the plain runner, with a warning of what is then not enforced. The plain runner gives each
run its own session (process group), so a timed-out program is killed with every child it
started; its limits are POSIX resource limits set in the child before `exec`, per process (each
child gets the same allowance, not a share), which a program running as root can raise again,
and a process that leaves the group (`setsid`) escapes its kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slimish.gateway import sandbox
from slimish.gateway.sandbox import Sandbox

# Once the group is dead its pipes close: a pipe still open after this long is held by a process
# that left the group (its own session), and is no longer read.
DRAIN_S = 1.0
# Variables a program needs to behave normally; everything else of the trainer's environment
# (tokens, cloud credentials, the API keys of real model providers) stays out.
MINIMAL_ENV = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


@dataclass
class HarnessLimits:
    wall_s: float = 300.0  # wall-time budget; the program's whole process group is killed at the end of it
    cpu_s: int | None = None  # RLIMIT_CPU, per process: SIGXCPU at cpu_s, SIGKILL a second later
    memory_mb: int | None = None  # RLIMIT_AS, per process: allocations past it fail (MemoryError, ENOMEM)
    output_bytes: int = 1 << 20  # stdout and stderr kept up to this much each (the rest dropped, counted)
    kill_grace_s: float = 2.0  # between SIGTERM and SIGKILL: time for the program to flush its files
    processes: int = 512  # sandbox: RLIMIT_NPROC of its own user (processes and threads, all of them together)
    disk_mb: int = 1024  # sandbox: size of its working directory's tmpfs, and of its /tmp's
    sandbox: bool = True  # run in the bubblewrap sandbox (sandbox.py); False, or a host without it: the plain runner

    def check(self) -> None:
        """Bad limits are the caller's bug: raised at the call, not found later as a strange run."""
        if not self.wall_s > 0 or not self.kill_grace_s >= 0:
            raise ValueError(
                f"HarnessLimits: wall_s must be > 0 and kill_grace_s >= 0, got {self.wall_s}, {self.kill_grace_s}"
            )
        for name in ("cpu_s", "memory_mb", "processes", "disk_mb"):
            value = getattr(self, name)
            optional = name in ("cpu_s", "memory_mb")
            if (value is not None or not optional) and (not isinstance(value, int) or value <= 0):
                raise ValueError(
                    f"HarnessLimits: {name} must be a positive int{' or None' if optional else ''}, got {value!r}"
                )
        if self.output_bytes < 0:
            raise ValueError(f"HarnessLimits: output_bytes must be >= 0, got {self.output_bytes}")


@dataclass
class HarnessRun:
    """One finished run. Its working directory outlives the run so the caller can score it; use the
    run as a context manager (`with await run_harness(...) as run:`) or call `cleanup()` to remove
    it (a run that is garbage-collected removes it too, so a forgotten one cannot fill the disk).
    A `workdir` the caller passed in is the caller's: it is never removed."""

    argv: list[str]
    exit_code: int | None  # None when it was killed (timed out, or by a signal) or did not start
    timed_out: bool
    seconds: float
    workdir: Path  # its own temporary working directory (still there until cleanup)
    stdout: str
    stderr: str
    infra_error: str | None  # why the run says nothing about the policy: timed out, killed by a signal, failed to start
    stdout_dropped: int = 0  # bytes past `output_bytes`, not kept
    stderr_dropped: int = 0
    sandboxed: bool = False  # whether it ran in the bubblewrap sandbox (not the plain runner)
    _remove: weakref.finalize | None = field(default=None, repr=False, compare=False)

    def cleanup(self) -> None:
        """Remove the temporary working directory (a finalizer: it runs once, later calls do nothing)."""
        if self._remove is not None:
            self._remove()

    def __enter__(self) -> HarnessRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def gateway_env(base_url: str, session_key: str) -> dict[str, str]:
    """The environment that points OpenAI- and Anthropic-SDK programs at one gateway session.

    The gateway finds the session by the key (`Authorization: Bearer` or `x-api-key`), so one base
    URL serves every harness, and programs that take nothing but a base URL and a key from the
    environment work unchanged. The OpenAI SDK appends `/chat/completions` to a base URL that ends
    in `/v1`; the Anthropic SDK appends `/v1/messages` itself. `ANTHROPIC_AUTH_TOKEN` is what some
    Anthropic clients (Claude Code) send as a bearer token instead of `x-api-key`."""
    if not base_url or not session_key:
        raise ValueError(f"gateway_env: base_url and session_key must be non-empty, got {base_url!r}, {session_key!r}")
    root = base_url.rstrip("/")
    return {
        "OPENAI_BASE_URL": f"{root}/v1",
        "OPENAI_API_KEY": session_key,
        "ANTHROPIC_BASE_URL": root,
        "ANTHROPIC_API_KEY": session_key,
        "ANTHROPIC_AUTH_TOKEN": session_key,
    }


async def run_harness(
    argv: list[str],
    env: dict[str, str],
    limits: HarnessLimits,
    files: dict[str, str] | None = None,
    workdir: Path | None = None,
    readable: list[Path] | tuple[Path, ...] = (),
) -> HarnessRun:
    """Run an unmodified program to the end, or to the end of its wall budget.

    It runs in a fresh temporary working directory seeded with `files` (relative path -> text),
    or in `workdir` when given (the caller's; seeded the same, never removed), with `env` added to
    a minimal environment (PATH, HOME = the working directory, TMPDIR, LANG) rather than the
    trainer's, which may hold secrets. stdin is /dev/null (a program waiting for a human must not
    hang), stdout and stderr are kept up to `limits.output_bytes` each. At the wall budget the
    whole process group gets SIGTERM, then SIGKILL after `limits.kill_grace_s`; what is left of
    the group when the program exits on its own is killed too (background children would
    otherwise outlive the rollout). Cancelling the call kills the group and removes the directory.
    In the sandbox (`limits.sandbox`, sandbox.py) the program sees the system, the Python in use,
    the directories on PATH and `readable` (e.g. the agent's own code), all read-only; its working
    directory; and of the network only the gateway its environment names.
    Raises only for bad arguments (ValueError, TypeError)."""
    _check_args(argv, env, files)
    limits.check()
    owned = workdir is None
    root = Path(tempfile.mkdtemp(prefix="harness-")) if owned else Path(workdir).resolve()
    try:
        box = _sandboxed(limits)
        shown = [Path(p).resolve() for p in readable]
        run = await _run(list(argv), _child_env(root, env), limits, root, files or {}, box, shown)
    except BaseException:  # cancelled (the end of a rollout step), or bad arguments found late
        if owned:
            _rmtree(root)
        raise
    if owned:
        run._remove = weakref.finalize(run, _rmtree, root)
    return run


def _check_args(argv: list[str], env: dict[str, str], files: dict[str, str] | None) -> None:
    if not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"run_harness: argv must be a non-empty list of str, got {argv!r}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TypeError("run_harness: env must map str to str")
    for path, text in (files or {}).items():
        if not isinstance(text, str):
            raise TypeError(f"run_harness: files[{path!r}] must be text, got {type(text).__name__}")
        parts = Path(path).parts
        if not parts or Path(path).is_absolute() or ".." in parts:
            raise ValueError(f"run_harness: files key {path!r} must be a relative path inside the working directory")


def _seed(root: Path, files: dict[str, str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def _child_env(root: Path, env: dict[str, str]) -> dict[str, str]:
    """PATH is the trainer's (where `node`, `git` and the agent CLIs are installed); HOME and TMPDIR
    are the working directory, so dotfiles and temporary files are the run's and go with it."""
    base = {**MINIMAL_ENV, "PATH": os.environ.get("PATH", os.defpath), "HOME": str(root), "TMPDIR": str(root)}
    return {**base, **env}


def _limiter(limits: HarnessLimits) -> Callable[[], None]:
    """The function the child runs between fork and exec. It only calls `setrlimit` with values
    computed here: the child of a multi-threaded parent must not import, allocate much or lock."""
    rlimits = [(resource.RLIMIT_CORE, (0, 0))]  # no core dumps in the working directory
    if limits.cpu_s is not None:
        rlimits.append((resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)))
    if limits.memory_mb is not None:
        size = limits.memory_mb << 20
        rlimits.append((resource.RLIMIT_AS, (size, size)))

    def apply() -> None:
        for which, value in rlimits:
            resource.setrlimit(which, value)

    return apply


def _sandboxed(limits: HarnessLimits) -> bool:
    """Whether this run goes in the sandbox; a host that cannot make one gets the plain runner and
    a warning that names what is then not enforced."""
    if not limits.sandbox:
        return False
    reason = sandbox.unavailable()
    if reason is not None:
        warnings.warn(
            f"run_harness: no sandbox on this host ({reason}); the plain runner does not enforce: "
            f"{sandbox.NOT_ENFORCED}",
            SandboxUnavailable,
            stacklevel=2,
        )
    return reason is None


class SandboxUnavailable(RuntimeWarning):
    """The harness ran without its sandbox (see `sandbox.unavailable`)."""


async def _run(
    argv: list[str],
    env: dict[str, str],
    limits: HarnessLimits,
    root: Path,
    files: dict[str, str],
    boxed: bool,
    readable: list[Path],
) -> HarnessRun:
    """In the sandbox: behind the gateway relay (when the environment names a gateway), through bwrap."""
    address = sandbox.gateway_address(env) if boxed else None
    async with sandbox.GatewayRelay(address) if address else contextlib.nullcontext() as relay:
        box = sandbox.Sandbox(argv, env, root, limits, relay, readable) if boxed else None
        try:
            return await _execute(argv, env, limits, root, files, box)
        finally:
            if box is not None:
                box.close()


async def _execute(
    argv: list[str], env: dict[str, str], limits: HarnessLimits, root: Path, files: dict[str, str], box: Sandbox | None
) -> HarnessRun:
    start = time.monotonic()
    # The sandbox's PID 1 sets the limits and keeps the wall budget; the runner's own is its backstop.
    how = {"pass_fds": box.pass_fds} if box else {"preexec_fn": _limiter(limits)}
    try:
        _seed(root, files)
        transport, out = await asyncio.get_running_loop().subprocess_exec(
            lambda: _Output(limits.output_bytes),
            *(box.argv if box else argv),
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            **how,
        )
    except (OSError, subprocess.SubprocessError) as exc:  # no such program, not executable, a full disk...
        return HarnessRun(argv, None, False, time.monotonic() - start, root, "", "", f"failed to start: {exc}")
    if box is not None:
        box.started()
    pid = transport.get_pid()
    try:
        try:
            wall, grace = (box.wall_s, 0.0) if box else (limits.wall_s, limits.kill_grace_s)
            timed_out = await _wait(out, pid, wall, grace)
            seconds = time.monotonic() - start
        finally:
            _killpg(pid, signal.SIGKILL)  # what it left running in its group; all of it when cancelled
        await asyncio.wait([out.closed], timeout=DRAIN_S)
    finally:
        transport.close()
    returncode = transport.get_returncode()
    if box is None:
        error = _infra_error(returncode, timed_out, limits)
    else:
        returncode, timed_out, error = _sandbox_outcome(box.status(), returncode, timed_out, limits, out.text(2))
    code = None if timed_out or returncode is None or returncode < 0 else returncode
    return HarnessRun(
        argv,
        code,
        timed_out,
        seconds,
        root,
        out.text(1),
        out.text(2),
        error,
        out.dropped[1],
        out.dropped[2],
        sandboxed=box is not None,
    )


def _sandbox_outcome(
    status: dict | None, bwrap_code: int | None, killed: bool, limits: HarnessLimits, stderr: str
) -> tuple[int | None, bool, str | None]:
    """(exit code, timed out, infra error) from what the sandbox's PID 1 reported. No report means
    the sandbox itself failed, or was killed past its backstop: an infra error, never a reward."""
    if status is None:
        if killed:
            return None, True, f"sandbox did not finish {sandbox.MARGIN_S:g} s past its wall budget"
        return None, False, f"sandbox failed (bwrap exit code {bwrap_code}): {stderr[-500:].strip()}"
    if "start_error" in status:
        return None, False, f"failed to start: {status['start_error']}"
    code, timed_out = status["returncode"], status["timed_out"]
    return code, timed_out, status["copy_error"] or _infra_error(code, timed_out, limits)


async def _wait(out: _Output, pid: int, wall_s: float, grace_s: float) -> bool:
    """Wait for the program to exit; at the wall budget SIGTERM its group (a chance to save its
    work), SIGKILL it after the grace. Whether it timed out."""
    done, _ = await asyncio.wait([out.exited], timeout=wall_s)
    if done:
        return False
    _killpg(pid, signal.SIGTERM)
    await asyncio.wait([out.exited], timeout=grace_s)
    _killpg(pid, signal.SIGKILL)
    await asyncio.wait([out.exited], timeout=DRAIN_S)  # not forever: a process stuck in the kernel ignores even SIGKILL
    return True


class _Output(asyncio.SubprocessProtocol):
    """Keeps the first `limit` bytes of stdout and of stderr and counts the rest; everything is
    read as it comes, so the program never blocks on a full pipe. `exited` is the program's exit,
    `closed` the end of its output too (a child that left the group may hold the pipes open)."""

    def __init__(self, limit: int) -> None:
        loop = asyncio.get_running_loop()
        self.limit = limit
        self.kept = {1: bytearray(), 2: bytearray()}
        self.dropped = {1: 0, 2: 0}
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        room = max(self.limit - len(self.kept[fd]), 0)
        self.kept[fd] += data[:room]
        self.dropped[fd] += max(len(data) - room, 0)

    def process_exited(self) -> None:
        self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set_result(None)

    def text(self, fd: int) -> str:
        return self.kept[fd].decode("utf-8", errors="replace")


def _killpg(pgid: int, sig: int) -> None:
    """The program is its group's leader (its own session), so its pid is the group id. An empty
    group is gone: nothing to do. A pid is not reused while its group still has members."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _infra_error(returncode: int | None, timed_out: bool, limits: HarnessLimits) -> str | None:
    if timed_out:
        return f"timed out after {limits.wall_s:g} s (wall budget)"
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:  # a real-time signal has no name
            name = str(-returncode)
        return f"killed by signal {name}"
    return None


def _rmtree(root: Path) -> None:
    """Remove a tree the program may have made read-only: it ran as this user, so its files can
    be chmodded back and removed."""
    shutil.rmtree(root, ignore_errors=True)
    if root.exists():
        for path, dirs, _ in os.walk(root):
            for name in ["", *dirs]:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(path, name), stat.S_IRWXU)
        shutil.rmtree(root, ignore_errors=True)
