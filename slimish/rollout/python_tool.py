"""Model-written Python, run in the harness sandbox: the code interpreter of ReTool-style rollouts.

A rollout function that lets the model write code (a `<code>` block, a `python` tool call) runs it
with `run_python` and gives `result.observation()` back to the model. The code runs as a harness
program (`slimish.gateway.harness.run_harness`) in the same bubblewrap sandbox: no network at all
(its environment names no gateway), nothing of the host's filesystem but the system and the
Python in use, its own PID namespace and user, and `CODE_LIMITS`. What the code does to itself
(an exception, an infinite loop, a fork bomb, a full disk) is an observation for the model; a
sandbox that failed is `result.infra_error`, which a rollout function must turn into an
`infra_failed` sample, never a reward.

    result = await run_python(code)
    if result.infra_error is not None:
        sample.status, sample.error = SampleStatus.INFRA_FAILED, result.infra_error
    else:
        append_observation(result.observation())
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from slimish.gateway.harness import HarnessLimits, HarnessRun, run_harness

# A tool call is a snippet: seconds of CPU, a little memory and disk, a few processes.
CODE_LIMITS = HarnessLimits(
    wall_s=10.0, kill_grace_s=0.5, cpu_s=10, memory_mb=1024, processes=32, disk_mb=64, output_bytes=64 << 10
)


@dataclass
class PythonResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when it was killed (timed out, a limit's signal)
    timed_out: bool
    infra_error: str | None  # the sandbox failed: the run says nothing about the code

    def observation(self, max_chars: int = 2000) -> str:
        """What the model sees: the output's end (a traceback's last line is the informative one),
        or why the code was stopped."""
        if self.timed_out:
            return "timed out"
        text = self.stdout + self.stderr
        if self.exit_code is None:
            text += "\n(killed: a limit of the sandbox)"
        return text[-max_chars:]


async def run_python(
    code: str, limits: HarnessLimits = CODE_LIMITS, files: dict[str, str] | None = None
) -> PythonResult:
    """Run `code` with `python -I` in a fresh sandboxed working directory seeded with `files`."""
    with await run_harness([sys.executable, "-I", "-c", code], {}, limits, files) as run:
        return PythonResult(run.stdout, run.stderr, run.exit_code, run.timed_out, _infra(run))


def _infra(run: HarnessRun) -> str | None:
    """The code is to blame for a timeout, an exit and a kill by a limit's signal; anything else
    that ended the run without an exit code (the sandbox failed, Python did not start) is infra."""
    if run.timed_out or run.exit_code is not None or (run.infra_error or "").startswith("killed by signal"):
        return None
    return run.infra_error
