"""PID 1 of a harness sandbox (`slimish/gateway/sandbox.py` builds the sandbox and starts this).

It runs inside bubblewrap's namespaces, before the program and after it, as the only process
there the program cannot signal (the kernel drops every signal to a namespace's init that it has
no handler for, and the program runs as another user):

1. copy the host's working directory (bound where only this process can read it) into the
   program's own size-bounded tmpfs, at the same path as on the host;
2. relay 127.0.0.1:PORT to the gateway socket bound in from the host (the only way out of the
   empty network namespace), when the program has a gateway;
3. start the program as a user of its own, with its limits (RLIMIT_NPROC counts that user's
   processes; a user without CAP_SYS_RESOURCE cannot raise a hard limit);
4. at the program's exit, or at the wall budget (SIGTERM to all, SIGKILL after the grace), kill
   whatever it left and reap it, copy the working directory back, report on the status fd.

Standard library only: it runs as `python -I -S` with nothing of slimish importable.
"""

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

HOST = "/.slimish/host"  # the host's working directory, bound read-write (root only: /.slimish is 0700)
GATEWAY_SOCKET = "/.slimish/gw/socket"


def accept(server: socket.socket) -> None:
    """Serve 127.0.0.1:PORT inside the sandbox by the host's gateway socket, one thread pair a connection."""
    while True:
        conn, _ = server.accept()
        upstream = socket.socket(socket.AF_UNIX)
        try:
            upstream.connect(GATEWAY_SOCKET)
        except OSError:
            conn.close()
            continue
        threading.Thread(target=relay, args=(conn, upstream), daemon=True).start()


def relay(conn: socket.socket, upstream: socket.socket) -> None:
    """Both directions of one connection, each in its own thread; both sockets closed once both end."""
    back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
    back.start()
    pump(conn, upstream)
    back.join()
    conn.close()
    upstream.close()


def pump(src: socket.socket, dst: socket.socket) -> None:
    """src to dst until src ends, then dst's writing ends. On an error (a peer that reset) both
    connections end whole: `shutdown` wakes the other direction's thread out of its `recv`, which
    a `close` from this thread would not, leaving the agent's connection open and its call hanging
    until the wall budget (seen: the gateway refused, the request already relayed, reset)."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def limiter(cfg: dict):
    """What the program's child runs before exec: its own user (when root made the sandbox), its limits."""
    uid, limits = cfg["uid"], [(getattr(resource, name), (soft, hard)) for name, soft, hard in cfg["rlimits"]]

    def apply() -> None:
        for which, value in limits:
            resource.setrlimit(which, value)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


def copy_tree(src: str, dst: str, inside: str) -> None:
    """Copy files, directories and symlinks that stay inside `inside`; nothing else (fifos,
    devices, links out of the working directory) leaves the sandbox."""
    os.makedirs(dst, exist_ok=True)
    for entry in os.scandir(src):
        target = os.path.join(dst, entry.name)
        if entry.is_symlink():
            if os.path.realpath(entry.path).startswith(inside + os.sep):
                os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir(follow_symlinks=False):
            copy_tree(entry.path, target, inside)
        elif entry.is_file(follow_symlinks=False):
            shutil.copyfile(entry.path, target)
            os.chmod(target, entry.stat(follow_symlinks=False).st_mode & 0o777)


def chown_tree(root: str, uid: int) -> None:
    os.chown(root, uid, uid)
    for path, dirs, files in os.walk(root):
        for name in dirs + files:
            os.lchown(os.path.join(path, name), uid, uid)


def wait_program(pid: int, wall_s: float, grace_s: float) -> tuple[int | None, bool]:
    """Wait for the program, reaping the orphans it leaves meanwhile (PID 1 inherits them); at the
    wall budget SIGTERM everything, SIGKILL after the grace. (Its exit code, negative for a
    signal, None if it never ended; whether it timed out.)"""
    deadline, code, timed_out = time.monotonic() + wall_s, None, False
    while code is None:
        now = time.monotonic()
        if now >= deadline:
            if timed_out:
                return None, True
            with contextlib.suppress(ProcessLookupError):  # none left
                os.kill(-1, signal.SIGTERM)
            deadline, timed_out = now + grace_s, True
        reaped, wstatus = os.waitpid(-1, os.WNOHANG)
        if reaped == pid:
            code = os.waitstatus_to_exitcode(wstatus)
        elif reaped == 0:
            time.sleep(0.02)
    return code, timed_out


def kill_all() -> None:
    """SIGKILL everything in the namespace but PID 1 (`setsid` children too) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.02)
        except ChildProcessError:
            return


def main() -> None:
    with os.fdopen(int(sys.argv[1])) as f:
        cfg = json.load(f)
    status = os.fdopen(cfg["status_fd"], "w")
    workdir = cfg["workdir"]
    copy_tree(HOST, workdir, HOST)
    if cfg["uid"] is not None:
        chown_tree(workdir, cfg["uid"])
        os.chmod("/tmp", 0o1777)
    # Listening before the program starts (its first connection waits in the backlog); served after
    # the fork, so the child never forks a threaded parent.
    port = cfg["gateway_port"]
    server = None if port is None else socket.create_server(("127.0.0.1", port), backlog=64)
    try:
        # preexec_fn is safe here: no thread runs yet. kill(-1) spares the caller: PID 1 keeps SIGTERM's default.
        proc = subprocess.Popen(cfg["argv"], cwd=workdir, env=cfg["env"], preexec_fn=limiter(cfg))  # noqa: PLW1509
    except OSError as exc:
        json.dump({"start_error": str(exc)}, status)
        return
    if server is not None:
        threading.Thread(target=accept, args=(server,), daemon=True).start()
    code, timed_out = wait_program(proc.pid, cfg["wall_s"], cfg["grace_s"])
    kill_all()
    copy_error = None
    try:
        clear(HOST)
        copy_tree(workdir, HOST, workdir)
    except OSError as exc:
        copy_error = f"copying the working directory back failed: {exc}"
    json.dump({"returncode": code, "timed_out": timed_out, "copy_error": copy_error}, status)


def clear(root: str) -> None:
    """Empty the host's working directory (the program's final state replaces it)."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


if __name__ == "__main__":
    main()
