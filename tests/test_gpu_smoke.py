"""benchmarks/gpu/smoke.py, the device smoke test, with `--dry-run`: every step of it on the CPU
(the SGLang double for SGLang, fp32, gloo), so that the script a lent GPU runs is known to work
up to the device itself. Also: a failed check makes it exit non-zero, and a run stopped by its
budget leaves no process behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "benchmarks" / "gpu" / "smoke.py"
LINE = re.compile(r"^(PASS|FAIL|SKIP) (\w+): (.*)$", re.M)
PASSED = [
    "device",
    "model",
    "sglang",
    "engine",
    "torch_step",
    "torch_push",
    "megatron_local_step",
    "megatron_local_push",
    "lora_step",
    "lora_push",
    "rl_run",
    "rl_versions",
    "rl_rewards",
    "rl_mismatch",
    "moe_routes",
    "moe_r3_step",
    "moe_push",
]
SKIPPED = {"megatron_te_step": "dry run: TE's spec needs CUDA", "megatron_te_push": "dry run: TE's spec needs CUDA"}
COLOC = "the GPU form of launch.colocate: dry run: the double loads no CUDA IPC handles (the CPU form: tests/test_colocate.py)"
COLOC_SKIPPED = dict.fromkeys(("coloc_run", "coloc_versions", "coloc_rewards", "coloc_mismatch"), COLOC)


def smoke(
    out: Path, *args: str, timeout: float = 600
) -> tuple[subprocess.CompletedProcess, dict[str, tuple[str, str]]]:
    """`smoke.py --out OUT ARGS`, its output in files rather than pipes: its result is back when
    the script exits, not when the last process holding its stdout does."""
    with open(out / "stdout", "w+") as stdout, open(out / "stderr", "w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(SMOKE), "--out", str(out), *args], cwd=ROOT, stdout=stdout, stderr=stderr
        )
        try:
            proc.wait(timeout=timeout)
        finally:
            proc.kill()
        done = subprocess.CompletedProcess(
            proc.args, proc.returncode, (out / "stdout").read_text(), (out / "stderr").read_text()
        )
    return done, {name: (status, detail) for status, name, detail in LINE.findall(done.stdout)}


@pytest.mark.slow  # ~1 min: four engines, five trainers, a two-step `slimish train`
def test_dry_run_passes_every_check(tmp_path: Path) -> None:
    done, checks = smoke(tmp_path, "--dry-run")
    report = done.stdout + done.stderr[-3000:]
    order = [*PASSED[4:8], *SKIPPED, *PASSED[8:14], *COLOC_SKIPPED, *PASSED[14:]]
    assert list(checks) == PASSED[:4] + order, report  # every check, in order, once
    assert {name: checks[name][0] for name in PASSED} == dict.fromkeys(PASSED, "PASS"), report
    skipped = SKIPPED | COLOC_SKIPPED
    assert {name: checks[name] for name in skipped} == {name: ("SKIP", why) for name, why in skipped.items()}
    assert done.returncode == 0, report
    assert "SGLang double" in checks["engine"][1] and "--dtype float32" in checks["engine"][1]
    assert checks["rl_versions"][1].startswith("2 steps")


def test_a_failed_check_exits_non_zero(tmp_path: Path) -> None:
    done, checks = smoke(tmp_path, "--dry-run", "--model", str(tmp_path / "absent"), timeout=120)
    assert checks["model"][0] == "FAIL" and done.returncode == 1, done.stdout + done.stderr


def test_a_run_past_its_budget_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    """Stopped mid-run (12 s in: its first engine up since ~5 s on an idle machine, starting
    under load): a FAIL line, exit 1, and no process whose command line names the run's
    directory (the script's own, its engines') survives."""
    done, checks = smoke(tmp_path, "--dry-run", "--budget", "12", timeout=120)
    assert checks["budget"][0] == "FAIL" and done.returncode == 1, done.stdout + done.stderr
    deadline = time.monotonic() + 10
    while (left := survivors(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left


def survivors(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if marker in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found
