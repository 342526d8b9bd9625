"""The Tinker SDK and tinker-cookbook's recipes, unchanged, against `slimish tinker`, with no network.

Why: the recipes name hub models and hub datasets and the SDK wants an API key; none of that is
reachable from the test machine. What a recipe needs, and how it is met here (each a documented
hook of the cookbook, never an edit of it):

- a model name the cookbook knows (`model_info.get_recommended_renderer_name` refuses a local path):
  the server reports `Qwen/Qwen3-8B` (renderer `qwen3`) for a tiny random model that carries Qwen3's
  real tokenizer and chat template (tests/model_families.py);
- that name's tokenizer: `tokenizer_utils.register_tokenizer` (checked before the hub,
  tinker-cookbook 0.6.1: tinker_cookbook/tokenizer_utils.py:249);
- `datasets.load_dataset("HuggingFaceH4/no_robots")` (sl_loop): the cookbook's own
  example_data/conversations.jsonl, as its `train` split;
- the pricing file the RL and SL trainers fetch once (a 5 s timeout that never raises): marked
  fetched, so no request is made;
- `TINKER_API_KEY`: any key starting `tml-` (tinker 0.38.0: lib/_auth_token_provider.py:64);
  `TINKER_TELEMETRY=0` keeps the SDK's telemetry batches off the wire.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from slimish.net import listening_socket
from slimish.processes import ServerProcess

MODEL_NAME = "Qwen/Qwen3-8B"  # the cookbook's renderer for it is `qwen3`, the tiny model's template
API_KEY = "tml-local"
NO_ROBOTS = "HuggingFaceH4/no_robots"


def conversations() -> list[dict]:
    """The cookbook's example chat data: 128 rows of `{"messages": [...]}`."""
    import tinker_cookbook

    path = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tinker_server(model_dir: Path, root: Path, log_path: Path) -> ServerProcess:
    """`slimish tinker` serving `model_dir` as MODEL_NAME on a free loopback port, not started."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    argv = ["tinker", "--model", str(model_dir), "--port", str(port), "--root", str(root), "--model-name", MODEL_NAME]
    return ServerProcess(argv, port=port, health_path="/api/v1/healthz", log_path=log_path, sock=sock)


@contextmanager
def offline(model_dir: Path) -> Iterator[None]:
    """The SDK and the cookbook as a user runs them, with the hub, the datasets and the keys met
    locally (see the module docstring); root logging as it was afterwards (the recipes replace
    the root handlers, tinker-cookbook 0.6.1: tinker_cookbook/utils/ml_log.py:740)."""
    import datasets
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.utils import cost_estimation
    from transformers import AutoTokenizer

    def load_dataset(path: str, *args: object, **kwargs: object) -> datasets.DatasetDict:
        if path != NO_ROBOTS:
            raise ValueError(f"offline: no local stand-in for dataset {path!r} (only {NO_ROBOTS!r})")
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(conversations())})

    tokenizer = functools.cache(lambda: AutoTokenizer.from_pretrained(model_dir))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", API_KEY)
        mp.setenv("TINKER_TELEMETRY", "0")
        mp.setattr(datasets, "load_dataset", load_dataset)
        mp.setattr(cost_estimation, "_pricing_fetched", True)  # entries stay None: "no pricing", no request
        tokenizer_utils.register_tokenizer(MODEL_NAME, tokenizer)
        try:
            yield
        finally:
            tokenizer_utils.unregister_tokenizer(MODEL_NAME)
            root.handlers[:] = handlers
            root.setLevel(level)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
