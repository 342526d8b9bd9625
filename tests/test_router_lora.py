"""LoRA through the router: two real engines holding different adapters behind a real router.

A request for an adapter lands only on workers that hold it (checked by the worker header and
by its tokens equalling that engine's own answer); load / unload fan out and teach the router
who holds what; a worker added later is read from its `/v1/models`.
"""

from __future__ import annotations

import httpx
import pytest
from helpers import running_engines, running_router, wait_for
from test_engine_lora import GREEDY, PROMPTS, WAIT_S, adapter_dirs, post  # noqa: F401  (adapter_dirs: a fixture)

from slimish.router.proxy import WORKER_HEADER

LORA_FLAGS = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])


@pytest.fixture(scope="module")
def engines(tiny_model_dir, adapter_dirs, tmp_path_factory):
    """Engine 0 holds a1, engine 1 holds a2."""
    with running_engines(tiny_model_dir, tmp_path_factory, n=2, timeout=WAIT_S, **LORA_FLAGS) as procs:
        for proc, name in zip(procs, ("a1", "a2")):
            r = post(proc.url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dirs[name])})
            assert r.json()["success"], r.text
        yield [p.url for p in procs]


@pytest.fixture(scope="module")
def router(engines):
    """Starts with engine 0 only; the first test adds engine 1."""
    with running_router(worker_urls=engines[:1]) as url:
        yield url


def served_by(router: str, lora: str | list | None, prompt=PROMPTS[0]) -> tuple[str, list[int]]:
    r = post(router, "/generate", {"input_ids": prompt, "lora_path": lora, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    return r.headers[WORKER_HEADER], body["output_ids"] if isinstance(body, dict) else [b["output_ids"] for b in body]


def holders(router: str) -> dict[str, list[str]]:
    return {w["url"]: w["lora_adapters"] for w in httpx.get(router + "/workers", timeout=10).json()["workers"]}


def test_an_added_worker_is_read_for_its_adapters(router, engines):
    assert holders(router) == {engines[0]: ["a1"]}
    assert post(router, "/workers", {"url": engines[1]}).status_code == 202
    wait_for(lambda: holders(router).get(engines[1]) == ["a2"], "the added worker's adapters", timeout=30)


def test_requests_land_only_on_workers_holding_their_adapter(router, engines):
    wait_for(
        lambda: httpx.get(router + "/readiness", timeout=10).json()["healthy_workers"] == 2, "both workers healthy"
    )
    for lora, home in (("a1", engines[0]), ("a2", engines[1])):
        direct = post(
            home, "/generate", {"input_ids": PROMPTS[0], "lora_path": lora, "sampling_params": GREEDY}
        ).json()["output_ids"]
        for _ in range(4):
            assert served_by(router, lora) == (home, direct)
    assert served_by(router, "a1")[1] != served_by(router, "a2")[1]  # a2's weights differ: a mix-up would show
    assert {served_by(router, None)[0] for _ in range(4)} == set(engines)  # base rows go anywhere
    assert served_by(router, ["a2", None], PROMPTS[:2])[0] == engines[1]  # a batch goes where all its adapters are

    body = {"model": "a2", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    assert post(router, "/v1/completions", body).headers[WORKER_HEADER] == engines[1]


def test_unknown_or_split_adapters_are_refused_naming_them(router):
    r = post(router, "/generate", {"input_ids": PROMPTS[0], "lora_path": "zz", "sampling_params": GREEDY})
    assert r.status_code == 400 and "lora adapter 'zz' is not loaded on any worker" in r.json()["error"]["message"], (
        r.text
    )
    r = post(router, "/generate", {"input_ids": PROMPTS[:2], "lora_path": ["a1", "a2"], "sampling_params": GREEDY})
    assert r.status_code == 400 and "no healthy worker holds all of the lora adapters ['a1', 'a2']" in r.text
    r = post(router, "/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]


def test_load_and_unload_fan_out_and_teach_the_router(router, engines, adapter_dirs):
    r = post(router, "/load_lora_adapter", {"lora_name": "a3", "lora_path": str(adapter_dirs["a3"])})
    assert r.status_code == 200 and r.json()["success"] and r.json()["error_message"] is None, r.text
    assert [w["body"]["success"] for w in r.json()["workers"]] == [True, True]
    assert {served_by(router, "a3")[0] for _ in range(4)} == set(engines)

    r = post(router, "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapter_dirs["a1"])})
    assert r.status_code == 400 and not r.json()["success"]  # engine 0 has it already; engine 1 loads it
    assert (
        r.json()["error_message"].startswith(f"{engines[0]}: lora adapter 'a1'")
        and "already loaded" in r.json()["error_message"]
    )
    assert holders(router) == {engines[0]: ["a1", "a3"], engines[1]: ["a1", "a2", "a3"]}
    assert {served_by(router, "a1")[0] for _ in range(4)} == set(engines)

    r = post(router, "/unload_lora_adapter", {"lora_name": "a2"})
    assert (
        r.status_code == 400 and engines[0] in r.json()["error_message"] and engines[1] not in r.json()["error_message"]
    )
    assert sorted(r.json()["loaded_adapters"]) == ["a1", "a3"]
    r = post(router, "/generate", {"input_ids": PROMPTS[0], "lora_path": "a2", "sampling_params": GREEDY})
    assert r.status_code == 400 and "'a2' is not loaded on any worker" in r.text
