"""A run with `launch.api_key`: its engines and its router check the key, and every call to them
carries it, as SGLang's server checks `Authorization: Bearer <key>` on all but its health and
metrics routes (sglang 0.5.23: python/sglang/srt/utils/auth.py) and sglang-router sends its
`--api-key` to its workers (sglang_router 0.3.2: router_args.py, `--api-key`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from helpers import SHORT_QUICKSTART, generate_response, running_engines, running_router, wait_for

from slimish.launch.config import LaunchConfig
from slimish.launch.elastic import fleet_urls
from slimish.launch.local import await_weights_on_relaunch, engine_server
from slimish.launch.workers import key_client

KEY = "sk-run"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_a_keyed_router_reaches_keyed_engines_on_every_route(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Serving, info and fan-out routes through a keyed router to keyed engines all answer; the
    router's own reads of its workers (/server_info's model path) got through; the trainer's
    next push reaches both engines; a caller without the key is refused by the router."""
    with running_engines(tiny_model_dir, tmp_path_factory, n=2, api_key=KEY) as (a, b):
        with running_router(worker_urls=[a.url, b.url], api_key=KEY) as router:
            wait_for(lambda: all(w["is_healthy"] for w in _workers(router)), "both engines healthy on the router")
            assert {w["metadata"].get("model_path") for w in _workers(router)} == {str(tiny_model_dir)}
            reply = generate_response(
                router, headers=AUTH, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "temperature": 0}
            )
            assert len(reply.json()["output_ids"]) == 2
            assert httpx.get(router + "/model_info", headers=AUTH, timeout=10).status_code == 200
            flushed = httpx.post(router + "/flush_cache", headers=AUTH, timeout=30)
            assert flushed.status_code == 200 and flushed.json()["success"], flushed.text
            with key_client(KEY) as http:  # the run's next push reaches both
                assert fleet_urls(http, router, [a.url]) == [a.url, b.url]
            assert (
                generate_response(router, input_ids=[1], status=401)
                .json()["error"]["message"]
                .startswith("missing key")
            )


def test_a_relaunched_keyed_engine_is_waited_for_on_its_keyed_model_info(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An engine of a keyed run started again is waited for on `/model_info` (--await-weights),
    a keyed route: the wait carries the key, so the engine counts as up once it is."""
    engine = engine_server(LaunchConfig(api_key=KEY), tiny_model_dir, tmp_path / "engine.log")
    await_weights_on_relaunch(engine)
    try:
        engine.start(60)
        assert httpx.get(engine.url + "/model_info", timeout=10).status_code == 401  # the key is checked
    finally:
        engine.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_keyed_run_trains_through_its_router_and_the_agent_gateway(tmp_path: Path) -> None:
    """2 sync steps of the quickstart's shape with `launch.api_key`, each sample an OpenAI-SDK
    agent behind the run's agent gateway, scored by a teacher (on-policy distillation) whose
    engine is registered by name on the run's router: rollouts and scorings reach the engines
    through the keyed router, the pushes reach them, and no group failed."""
    from helpers import run_quickstart

    from slimish.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama", size="tiny", seed=0)
    rows = run_quickstart(
        tmp_path,
        "steps=2",
        *SHORT_QUICKSTART,
        "rollout.rollout_fn=rollout_plugins.openai_agent:rollout",
        f"launch.api_key={KEY}",
        "algorithm.opd.coef=1.0",
        f"launch.teacher.model={model}",
        "launch.teacher.served_name=teacher",
        model=model,
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/groups_failed"] == 0 and r["rollout/groups_kept"] == 2 for r in rows[1:])
    assert all(r["launch/engines"] == 1 for r in rows)
    assert abs(rows[1]["train/teacher_kl"]) < 1e-5  # the teacher scored step 1's samples: the same model


def _workers(router: str) -> list[dict]:
    return httpx.get(router + "/workers", headers=AUTH, timeout=10).json()["workers"]
