"""Engine faults in a real run: an engine SIGKILLed mid-rollout. The router routes around it (the
requests it held are retried on the other engine), the run restarts it before the next push, and
it serves again only once that push has set its weights. Nothing is lost or trained twice. An
engine the kernel has not finished killing counts as dead already."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_run_survives_an_engine_kill, wait_for

from slimish.processes import ServerProcess, main_thread_exited

pytestmark = pytest.mark.slow

# The engines are this trainer process's children.
SIGKILL_A_CHILD_ENGINE = """
children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
engines = [p for p in children if b"engine" in Path(f"/proc/{p}/cmdline").read_bytes()]
os.kill(int(engines[0]), signal.SIGKILL)
"""

# A child whose main thread ends while another thread lives on (holding the interpreter's lock
# the main thread took with it): the state a SIGKILLed multi-threaded engine is in until its last
# thread has exited, held here for as long as the test needs.
MAIN_THREAD_EXITS = """
import ctypes, threading, time
threading.Thread(target=time.sleep, args=(600,)).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_an_engine_killed_mid_rollout_is_routed_around_restarted_and_rejoins(tmp_path: Path) -> None:
    assert_run_survives_an_engine_kill(tmp_path, SIGKILL_A_CHILD_ENGINE)


def test_a_child_whose_main_thread_is_gone_has_exited(tmp_path: Path) -> None:
    """Seen in a rehearsal of the suite: a SIGKILLed engine's port had closed and its main thread
    was a zombie, but `poll()` still read it as running (the kernel reaps a process only once its
    last thread has exited), so `restart_dead` left it dead. `exited` finishes it off and reaps it."""
    (tmp_path / "main_thread_exits.py").write_text(MAIN_THREAD_EXITS)
    child = ServerProcess([], port=0, module="main_thread_exits", env={"PYTHONPATH": str(tmp_path)})
    child.launch()
    try:
        assert child.proc is not None
        wait_for(lambda: main_thread_exited(child.proc.pid), "the child's main thread to exit")
        assert child.proc.poll() is None  # what `restart_dead` read before: running
        assert child.exited() and child.proc.returncode is not None  # reaped: its port is free to bind again
    finally:
        child.stop()
