"""Engine faults in a real run: an engine SIGKILLed mid-rollout. The router routes around it (the
requests it held are retried on the other engine), the run restarts it before the next push, and
it serves again only once that push has set its weights. Nothing is lost or trained twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_run_survives_an_engine_kill

pytestmark = pytest.mark.slow

# The engines are this trainer process's children.
SIGKILL_A_CHILD_ENGINE = """
children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
engines = [p for p in children if b"engine" in Path(f"/proc/{p}/cmdline").read_bytes()]
os.kill(int(engines[0]), signal.SIGKILL)
"""


def test_an_engine_killed_mid_rollout_is_routed_around_restarted_and_rejoins(tmp_path: Path) -> None:
    assert_run_survives_an_engine_kill(tmp_path, SIGKILL_A_CHILD_ENGINE)
