"""Limits and exposure: prompt length, the max_new_tokens cap, body size and concurrency on the
engine and the router, each refused with a clear error naming the field and the limit; a full
server answers 503/429 with `Retry-After`; loopback by default, keys on a non-loopback bind, and
no network path that unpickles.

Concurrency is made deterministic by pausing the engine in place: requests sent then stay in
flight until they are aborted, so "full" is a state the test waits for (bounded), not a race.
"""

from __future__ import annotations

import argparse
import logging
import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from helpers import post, running_router, wait_for
from omegaconf import OmegaConf

import slimish
from slimish.config import RunConfig, load_run_config
from slimish.engine.config import EngineConfig
from slimish.flags import add_config_arguments, describe_config
from slimish.launch.local import engine_process
from slimish.router.config import RouterConfig
from slimish.schema import field_docs
from slimish.serving import warn_if_exposed

LIMITS = {
    "max_prompt_tokens": 48,
    "max_new_tokens_cap": 8,
    "max_body_bytes": 4096,
    "max_running_requests": 2,
    "max_queued_requests": 1,
}
CAPACITY = 3  # max_running_requests + max_queued_requests
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited(tiny_model_dir, tmp_path_factory):
    with engine_process(tiny_model_dir, log_path=tmp_path_factory.mktemp("limits") / "engine.log", **LIMITS) as proc:
        yield proc.url


def in_flight(engine: str) -> int:
    state = httpx.get(engine + "/server_info").json()["internal_states"][0]
    return state["#running-req"] + state["#queue-req"]


@contextmanager
def held(engine: str, via: str, count: int) -> Iterator[list[httpx.Response]]:
    """`count` generate requests (sent through `via`) held in flight on the paused engine; on
    exit they are aborted and the list holds their replies."""
    replies: list[httpx.Response] = []
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    assert post(engine, "/pause_generation", {"mode": "in_place"}).status_code == 200
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(post, via, "/generate", body) for _ in range(count)]
        try:
            wait_for(lambda: in_flight(engine) == count, f"{count} held requests")
            yield replies
        finally:
            post(engine, "/abort_request", {"abort_all": True})
            post(engine, "/continue_generation", {})
            replies.extend(f.result(timeout=60) for f in futures)


# ---- engine --------------------------------------------------------------------------------


def test_engine_prompt_length_names_the_limit(limited):
    r = post(limited, "/generate", {"input_ids": list(range(1, 50)), "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "input_ids: the prompt has 49 tokens; this engine accepts at most 48 (--max-prompt-tokens)"
    )
    r = post(limited, "/v1/completions", {"prompt": list(range(1, 50)), "max_tokens": 1})
    assert (
        r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "at most 48" in r.json()["error"]["message"]
    )
    assert (
        post(
            limited, "/generate", {"input_ids": list(range(1, 49)), "sampling_params": {"max_new_tokens": 1}}
        ).status_code
        == 200
    )


def test_engine_caps_max_new_tokens(limited):
    r = post(limited, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 9}})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "sampling_params.max_new_tokens: 9 is over this engine's cap of 8 (--max-new-tokens-cap)"
    )
    r = post(limited, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "max_tokens: 9 is over this engine's cap of 8"
    )
    # Defaults the client did not choose (128, 16, the rest of the context) are lowered to the cap.
    assert (
        post(limited, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()["meta_info"][
            "completion_tokens"
        ]
        == 8
    )
    done = post(limited, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}).json()
    assert done["usage"]["completion_tokens"] == 8
    chat = post(
        limited,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True},
    ).json()
    assert chat["usage"]["completion_tokens"] == 8


def test_engine_body_size(limited):
    big = {"input_ids": PROMPT, "rid": "x" * 5000}
    r = post(limited, "/generate", big)
    assert r.status_code == 413 and "at most 4096 (--max-body-bytes)" in r.json()["error"]["message"]
    # Chunked, no Content-Length: counted as it is read.
    chunks = (b'{"input_ids": [5], "rid": "' + b"x" * 1000 for _ in range(5))
    r = httpx.post(limited + "/generate", content=chunks, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
    assert (
        post(limited, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    )


def test_engine_request_larger_than_it_can_hold_is_400(limited):
    r = post(limited, "/generate", {"input_ids": PROMPT, "sampling_params": {"n": CAPACITY + 1, "max_new_tokens": 1}})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "sampling_params.n: the request makes 4 sequences (batch items x n); this engine holds at most 3"
    )
    r = post(limited, "/v1/completions", {"prompt": PROMPT, "n": 10**9, "max_tokens": 1})  # refused before expanding
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_full_engine_is_503_with_retry_after(limited):
    with held(limited, limited, CAPACITY) as replies:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        for r in (
            post(limited, "/generate", body),
            post(limited, "/generate", {**body, "stream": True}),
            post(limited, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
        ):
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert (
                "the engine is full: 3 sequences in flight, this request adds 1, the limit is 3"
                in r.json()["error"]["message"]
            )
        assert (
            httpx.get(limited + "/health").status_code == 200
            and httpx.get(limited + "/health_generate").status_code == 200
        )
    assert [r.json()["meta_info"]["finish_reason"]["type"] for r in replies] == ["abort"] * CAPACITY
    assert (
        post(
            limited, "/generate", {"input_ids": PROMPT, "sampling_params": {"n": CAPACITY, "max_new_tokens": 2}}
        ).status_code
        == 200
    )


# ---- router --------------------------------------------------------------------------------


def test_router_prompt_length_names_the_limit(limited):
    with running_router(worker_urls=[limited], max_prompt_tokens=4) as router:
        r = post(router, "/generate", {"input_ids": PROMPT})
        assert (
            r.status_code == 400
            and r.json()["error"]["message"]
            == "input_ids has 5 tokens; this router accepts at most 4 (--max-prompt-tokens)"
        )
        r = post(router, "/generate", {"input_ids": [[1, 2], PROMPT]})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("input_ids[1] has 5 tokens")
        r = post(router, "/v1/completions", {"prompt": PROMPT})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt has 5 tokens")
        assert (
            post(router, "/generate", {"input_ids": PROMPT[:4], "sampling_params": {"max_new_tokens": 1}}).status_code
            == 200
        )


def test_full_router_is_429_with_retry_after(limited):
    with running_router(worker_urls=[limited], max_concurrent_requests=2, retry_after_s=3) as router:
        with held(limited, router, 2):
            r = post(router, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 429 and r.headers["retry-after"] == "3"
            assert (
                "the router is full: 2 requests in flight, the limit is 2 (--max-concurrent-requests)"
                in r.json()["error"]["message"]
            )
            assert (
                post(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}).status_code
                == 429
            )
            for path in ("/health", "/readiness", "/metrics", "/workers"):  # never refused
                assert httpx.get(router + path).status_code == 200
        assert (
            post(router, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}).status_code
            == 200
        )


def test_router_passes_a_full_engine_on_as_503_with_retry_after(limited):
    with running_router(worker_urls=[limited], max_retries=1) as router:
        with held(limited, limited, CAPACITY):
            r = post(router, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert (
                "the engine is full" in r.json()["error"]["message"]
                and "gave up after 2 attempts" in r.json()["error"]["message"]
            )


# ---- exposure ------------------------------------------------------------------------------


def test_loopback_by_default():
    for schema in (EngineConfig, RouterConfig):
        parser = argparse.ArgumentParser()
        add_config_arguments(parser, schema)
        args = parser.parse_args(["--model", "m"] if schema is EngineConfig else [])
        assert args.host == "127.0.0.1" and schema.__dataclass_fields__["host"].default == "127.0.0.1"


def test_help_shows_each_fields_comment(capsys):
    """Each field's help in the schema (`doc`) is the docs: every flag's help, and every run key in `--help`."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    text = " ".join(parser.format_help().split())
    assert "--max-running-requests MAX_RUNNING_REQUESTS rows in the running batch (default: 32)" in text
    assert field_docs(RouterConfig)["admin_api_key"] and set(field_docs(EngineConfig)) <= set(
        EngineConfig.__dataclass_fields__
    )
    lines = describe_config(RunConfig)
    assert (
        "  rollout.temperature (1.0): Default sampling params for ctx.generate / ctx.chat." in lines
        and "  buffer.max_staleness (0): weight versions a trained sample may lag behind; 0 = on-policy" in lines
    )

    def leaves(node):  # every key of the schema, nested sections (metrics.wandb.*) flattened
        return sum(leaves(v) for v in node.values()) if isinstance(node, dict) and node else 1  # {}: a dict-valued key

    assert len(lines) == leaves(OmegaConf.to_container(OmegaConf.structured(RunConfig)))
    assert "  metrics.wandb.sample_groups (2): Groups per step added to the `samples` table" in " ".join(lines)


def test_one_seed_and_renamed_keys_still_read(tmp_path, caplog):
    """`seed` seeds the data and the trainer unless they are set; old evaluation keys still work
    for a release, each with a warning naming its new place."""
    cfg = load_run_config(None, ["model=m", "data.source=x", "seed=7", "trainer.seed=3"])
    assert (cfg.data.seed, cfg.trainer.seed) == (7, 3)
    (tmp_path / "old.yaml").write_text(
        "model: m\ndata:\n  source: x\n  eval_source: task:add\nrollout:\n  eval_n_prompts: 9\n"
    )
    with caplog.at_level(logging.WARNING, logger="slimish.config"):
        cfg = load_run_config(str(tmp_path / "old.yaml"), ["rollout.eval_temperature=0.5"])
    assert (cfg.eval.source, cfg.eval.n_prompts, cfg.eval.temperature) == ("task:add", 9, 0.5)
    assert (
        "data.eval_source is now eval.source" in caplog.text
        and "rollout.eval_temperature is now eval.temperature" in caplog.text
    )


def test_renamed_flags_still_parse_with_a_warning(caplog):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, RouterConfig)
    with caplog.at_level(logging.WARNING, logger="slimish.flags"):
        assert parser.parse_args(["--admin-key", "k"]).admin_api_key == "k"
    assert "--admin-key is now --admin-api-key" in caplog.text and "--admin-key" not in parser.format_help()


def test_non_loopback_without_key_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="slimish.serving"):
        warn_if_exposed("engine", "127.0.0.1", None)
        warn_if_exposed("engine", "0.0.0.0", "k")
        assert not caplog.records
        warn_if_exposed("router", "0.0.0.0", None)
    assert "router listens on 0.0.0.0 with no --api-key" in caplog.text


def _outside_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 9))
        except OSError:
            return None
        host = s.getsockname()[0]
    return None if host.startswith("127.") else host


def test_non_loopback_bind_keeps_keys(tiny_model_dir, tmp_path):
    host = _outside_address()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with engine_process(
        tiny_model_dir, log_path=tmp_path / "engine.log", host="0.0.0.0", api_key="serve", admin_api_key="adm"
    ) as proc:
        url = f"http://{host}:{proc.port}"
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        assert httpx.get(url + "/health").status_code == 200
        assert post(url, "/generate", body).status_code == 401
        assert post(url, "/generate", body, headers={"Authorization": "Bearer serve"}).status_code == 200
        disk = {"model_path": str(tiny_model_dir)}
        assert (
            post(url, "/update_weights_from_disk", disk, headers={"Authorization": "Bearer serve"}).status_code == 401
        )
        assert (
            post(url, "/update_weights_from_disk", disk, headers={"Authorization": "Bearer adm"}).json()["success"]
            is True
        )
        assert httpx.get(url + "/openapi.json").status_code == 401  # the schema too: only health and metrics are open


def test_no_network_path_unpickles():
    """Weights arrive as raw tensors (broadcast) or safetensors files, bodies as JSON: nothing an
    engine or router serves deserialises pickles. Keep it so; a route that must would have to
    refuse non-loopback clients."""
    root = Path(slimish.__file__).parent
    served = [
        *root.glob("engine/*.py"),
        *root.glob("router/*.py"),
        *(root / n for n in ("serving.py", "protocol.py", "distributed.py")),
    ]
    banned = re.compile(
        r"\bpickle\b|\bmarshal\b|torch\.load\(|_object_list\(|recv_object|weights_only\s*=\s*False|yaml\.load\("
    )
    hits = [
        f"{p.name}:{i}" for p in served for i, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)
    ]
    assert not hits
