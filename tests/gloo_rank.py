"""The main of a test's worker process: one gloo rank of a small world the test spawned. The spec
(JSON) is argv[1], the output directory argv[2]; the rank writes `rank{R}.json` with what it
measured, or the traceback that stopped it, so the test can show it."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def rank_main(body: Callable[[dict, Path], None], results: dict) -> None:
    """Run `body(spec, out)`, which fills `results`; then write them, whatever happened."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    # A rank hung outside a collective (which the timeout below covers) prints its stacks and exits
    # before `torchrun_ranks` gives up at 300 s, so the test shows where.
    faulthandler.dump_traceback_later(240, exit=True)
    # A rank that fails leaves its peer in a collective: time that out well before the test's limit.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        body(spec, out)
    except Exception:
        results["error"] = traceback.format_exc()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
