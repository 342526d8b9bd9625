"""`/start_profile` and `/stop_profile`: the torch profiler around the scheduler's steps, written
as a Chrome trace (open it in chrome://tracing or Perfetto), as SGLang's profiler routes do.

The profiler starts and stops on the scheduler thread (through `Engine.run`), where the model
runs; with `num_steps` it stops itself after that many scheduler steps."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from slimish.protocol import ProfileReq


class ProfileError(ValueError):
    pass


class Profiler:
    def __init__(self) -> None:
        self.active: torch.profiler.profile | None = None
        self.steps_left: int | None = None
        self.path: Path | None = None

    def start(self, req: ProfileReq) -> None:
        if self.active is not None:
            raise ProfileError("Profiling is already in progress. Call /stop_profile first.")
        out = Path(req.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp"))
        try:
            out.mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError) as exc:
            raise ProfileError(f"output_dir: cannot create {str(out)!r} ({exc})") from None
        self.path = out / f"{req.profile_prefix or 'slimish'}-{time.time():.0f}.trace.json"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and "GPU" in (req.activities or ["CPU", "GPU"]):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.active = torch.profiler.profile(
            activities=activities, with_stack=bool(req.with_stack), record_shapes=bool(req.record_shapes)
        )
        self.active.__enter__()
        self.steps_left = req.num_steps

    def stop(self) -> Path:
        if self.active is None:
            raise ProfileError("Profiling is not in progress. Call /start_profile first.")
        prof, path = self.active, self.path
        self.active = self.steps_left = None
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(str(path))
        return path

    def step(self, _: Any = None) -> None:
        """After each scheduler step: stop once `num_steps` have run."""
        if self.active is not None and self.steps_left is not None:
            self.steps_left -= 1
            if self.steps_left <= 0:
                self.stop()
