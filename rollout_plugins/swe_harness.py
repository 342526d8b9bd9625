"""mini-swe-agent, trained as is: `--rollout-fn rollout_plugins.swe_harness:rollout`.

mini-swe-agent (PyPI `mini-swe-agent`) is a coding agent with one tool, `bash`. Its own command
line (`mini`, with its default `mini.yaml` prompts) runs unmodified in a fresh working directory
holding a small repository. Its model client is litellm: the model name `openai/policy` picks
litellm's OpenAI-compatible client, which takes its base URL and key from the environment, so
`ctx.agent_env()` points it at this sample's gateway session. The reward is whether the
repository's check passes afterwards.

A prompt row is `{"prompt": "<the issue>", "files": {"<path>": "<text>", ...}}` (the data loader
moves `files` into the sample's metadata), where `files` holds `check.py`, the check (`EXAMPLE_ROW`
is one). The check is written again from the row before it runs, so an agent that edits the check
gains nothing, and it runs under the harness runner and its limits like the agent: it executes
code the policy wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rollout_plugins.cli_harness import scored
from slimish.gateway.harness import HarnessLimits, run_harness
from slimish.types import Sample

CHECK = "check.py"
LIMITS = HarnessLimits(wall_s=300.0, cpu_s=120, memory_mb=4096)
CHECK_LIMITS = HarnessLimits(wall_s=30.0, cpu_s=20, memory_mb=1024)
STEP_LIMIT = 8  # model calls per rollout (mini's cost limit means nothing here: the policy has no price)
# mini-swe-agent and litellm offline and unattended:
MINI_ENV = {
    "MSWEA_CONFIGURED": "true",  # no first-run setup dialog asking for a model and key
    "MSWEA_SILENT_STARTUP": "1",  # no banner
    "MSWEA_COST_TRACKING": "ignore_errors",  # litellm has no price for the policy: cost 0, not an error
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",  # a refused request (the context is full) is not retried for minutes
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm's bundled price table, not a download at import
}
EXAMPLE_ROW = {
    "prompt": "add(2, 3) returns -1 instead of 5. Fix calc.py so that `python check.py` passes.",
    "files": {
        "calc.py": "def add(a, b):\n    return a - b\n",
        CHECK: "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('ok')\n",
    },
}


def mini_argv(task: str) -> list[str]:
    """mini's command line: the default prompts, no confirmations, at most STEP_LIMIT model calls."""
    return [
        *(sys.executable, "-m", "minisweagent.run.mini", "--model", "openai/policy", "--task", task),
        *("--yolo", "--exit-immediately", "--output", "trajectory.json"),
        *("--config", "mini.yaml", "--config", f"agent.step_limit={STEP_LIMIT}"),
    ]


async def passes_check(workdir: Path, files: dict[str, str]) -> float:
    """1.0 when the row's own check exits 0 in what the agent left, else 0.0."""
    check = await run_harness([sys.executable, CHECK], {}, CHECK_LIMITS, files={CHECK: files[CHECK]}, workdir=workdir)
    return float(check.exit_code == 0)


async def rollout(ctx, sample: Sample) -> list[Sample]:
    files = sample.metadata["files"]
    task = sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt[-1]["content"])
    env = {**await ctx.agent_env(), **MINI_ENV}
    with await run_harness(mini_argv(task), env=env, limits=LIMITS, files=files) as run:
        reward = await passes_check(run.workdir, files) if run.infra_error is None else None
    return scored(ctx, sample, run, reward)
