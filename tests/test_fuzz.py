"""Property-based fuzzing of the engine's and the router's HTTP APIs with schemathesis.

Cases come from each server's own `/openapi.json` (request bodies are the `slimish.protocol` and
`slimish.formats.openai` models), valid ones and deliberately invalid ones, sent to a real engine
process and to a real router in front of it. The properties: no 5xx, every JSON reply parses,
the engine logs no traceback (a scheduler step that failed would abort everyone's requests, with
HTTP 200), and afterwards both still answer /health and generate exactly what they generated before.

Generation is kept cheap by the servers' own limits (`max_new_tokens_cap` 8, room for 64
sequences), which the fuzzer thereby exercises too. The cases reproduce (tests/fuzzing.py).
"""

from __future__ import annotations

import httpx
import pytest
from fuzzing import BOTH, fuzz
from helpers import running_router
from schemathesis import GenerationMode

from slimish.launch.local import engine_process

pytestmark = pytest.mark.slow  # ~1 min: 1,500+ requests

LIMITS = {"max_new_tokens_cap": 8, "max_running_requests": 8, "max_queued_requests": 56}
SERVING = {
    ("POST", "/generate"): (100, BOTH),
    ("POST", "/v1/completions"): (100, BOTH),
    ("POST", "/v1/chat/completions"): (100, BOTH),
}
# Control routes whose effects cannot stall what follows (pause, a memory release and joining a process group can).
ENGINE_OPS = {
    **SERVING,
    **{
        ("POST", p): (15, BOTH)
        for p in (
            "/abort_request",
            "/get_weights_by_name",
            "/update_weight_version",
            "/begin_weight_update",
            "/continue_generation",
            "/update_weights_from_disk",
            "/update_weights_from_distributed",
            "/destroy_weights_update_group",
            "/tokenize",
            "/v1/detokenize",
        )
    },
    **{
        ("GET", p): (1, (GenerationMode.POSITIVE,))
        for p in ("/health", "/model_info", "/server_info", "/v1/models", "/metrics")
    },
}
ROUTER_OPS = {
    **SERVING,
    **{
        ("GET", p): (1, (GenerationMode.POSITIVE,))
        for p in ("/health", "/readiness", "/get_loads", "/metrics", "/workers", "/list_workers")
    },
    ("GET", "/workers/{worker_id}"): (15, (GenerationMode.POSITIVE,)),
}
PROBE = {"input_ids": [5, 17, 42, 99], "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}


def probe(url: str) -> list[int]:
    r = httpx.post(url + "/generate", json=PROBE, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.fixture(scope="module")
def fuzz_engine(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "engine.log"
    with engine_process(tiny_model_dir, log_path=log, **LIMITS) as proc:
        yield proc, log


def test_engine_survives_fuzzing(fuzz_engine):
    proc, log = fuzz_engine
    before = probe(proc.url)
    assert fuzz(proc.url, ENGINE_OPS) >= 900
    assert proc.proc.poll() is None and httpx.get(proc.url + "/health").status_code == 200
    assert probe(proc.url) == before
    assert "Traceback" not in log.read_text(errors="replace")


def test_router_survives_fuzzing(fuzz_engine):
    proc, log = fuzz_engine
    with running_router(worker_urls=[proc.url], max_new_tokens_cap=8) as router:
        before = probe(router)
        assert fuzz(router, ROUTER_OPS) >= 600
        assert httpx.get(router + "/health").status_code == 200 and httpx.get(router + "/readiness").status_code == 200
        assert probe(router) == before
    assert "Traceback" not in log.read_text(errors="replace")
