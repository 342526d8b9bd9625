"""The built-in engine's prefix cache: exact (the same tokens and bit-identical log-probs as with
the cache off), `cached_tokens` as reported, emptied by /flush_cache and by weight loads, and the
cache's own tree (match, namespaces, LRU bound) in-process.

Two real engine processes on the tiny model, one with the cache and one with
`--disable-radix-cache`, both with 8-token pages so short prompts span several; every request is
sent to both, one at a time, so both run the same batches and only the cache differs.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from helpers import generate, post

from slimish.engine.prefix_cache import PrefixCache
from slimish.launch.local import engine_process
from slimish.processes import start_all

PAGE = 8
SAMPLED = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 0}


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    """(cache on, cache off) engine URLs."""
    logs = tmp_path_factory.mktemp("prefix-cache-logs")
    procs = [
        engine_process(tiny_model_dir, log_path=logs / f"{name}.log", page_size=PAGE, **flags)
        for name, flags in (("on", {}), ("off", {"disable_radix_cache": True}))
    ]
    try:
        start_all(procs, timeout=120)
        yield [p.url for p in procs]
    finally:
        for p in procs:
            p.stop()


def both(engines: list[str], **body) -> dict | list:
    """The reply of the cache-on engine, after checking that the cache-off one said the same:
    tokens, every log-prob bit for bit, and `cached_tokens` 0."""
    on, off = (generate(url, **body) for url in engines)
    for a, b in zip(*(r if isinstance(r, list) else [r] for r in (on, off))):
        assert a["output_ids"] == b["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs"):
            assert a["meta_info"].get(key) == b["meta_info"].get(key), key
        assert b["meta_info"]["cached_tokens"] == 0
    return on


def test_server_info_reports_the_cache_as_configured(engines):
    """SGLang clients read these to know whether prefixes are reused (it said "disabled" always)."""
    on, off = (httpx.get(url + "/server_info", timeout=10).json() for url in engines)
    assert (on["disable_radix_cache"], off["disable_radix_cache"]) == (False, True)
    assert on["page_size"] == off["page_size"] == PAGE


def pages(n: int) -> int:
    return n // PAGE * PAGE


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_agent_turns_reuse_the_history_exactly(engines):
    """Each turn's prompt is the last prompt + the model's reply + tool text: it finds the last
    prompt's whole pages (not the reply: decode-written KV is never cached)."""
    history, last_len = prompt(1, 13), 0
    for turn in range(4):
        params = {**SAMPLED, "sampling_seed": turn}
        out = both(engines, input_ids=history, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        assert out["meta_info"]["cached_tokens"] == pages(last_len)
        last_len = len(history)
        history = history + out["output_ids"] + prompt(100 + turn, 5)


def test_input_logprobs_inside_a_cached_prefix_are_computed(engines):
    """Positions whose log-probs are asked for are never taken from the cache."""
    ids = prompt(2, 40)
    both(engines, input_ids=ids, sampling_params={**SAMPLED, "max_new_tokens": 1})
    for start in (0, 1, 9, 17, 39):
        out = both(
            engines,
            input_ids=ids,
            sampling_params={**SAMPLED, "max_new_tokens": 2, "sampling_seed": 1},
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=3,
        )
        meta = out["meta_info"]
        assert meta["cached_tokens"] == pages(max(start - 1, 0))
        assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[start:]


def test_n_copies_share_one_prefill(engines):
    """The first copy computes the prompt; the other copies compute none of it."""
    ids = prompt(3, 21)
    out = both(engines, input_ids=ids, sampling_params={**SAMPLED, "n": 4, "sampling_seed": 5}, return_logprob=True)
    assert [o["meta_info"]["cached_tokens"] for o in out] == [0, len(ids), len(ids), len(ids)]
    assert len({tuple(o["output_ids"]) for o in out}) > 1  # seeds + j: four samples, not one four times


def test_a_batch_shares_prefixes_within_one_step(engines):
    """Prompts admitted together: the second finds the first's pages at once; the same prompt
    twice shares its prefill."""
    base = prompt(4, 30)
    batch = [base, base[:20] + prompt(5, 11), base]
    out = both(engines, input_ids=batch, sampling_params={**SAMPLED, "sampling_seed": 2}, return_logprob=True)
    assert [o["meta_info"]["cached_tokens"] for o in out] == [0, pages(20), len(base)]


def test_concurrent_identical_prompts_are_exact(engines):
    """Requests arriving together from separate clients: the same tokens with the cache on and
    off. Which step each joins depends on timing, and a decode row's logits depend in the last
    bits on how many rows the step has, so log-probs agree to 1e-5 here, not bit for bit."""
    ids = prompt(6, 27)

    async def burst(url: str) -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {
                "input_ids": ids,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True},
                "return_logprob": True,
            }
            replies = await asyncio.gather(*(client.post(url + "/generate", json=body) for _ in range(6)))
        return [r.json() for r in replies]

    on, off = (asyncio.run(burst(url)) for url in engines)
    assert {tuple(r["output_ids"]) for r in on + off} == {tuple(on[0]["output_ids"])}
    ref = [lp for lp, _, _ in off[0]["meta_info"]["output_token_logprobs"]]
    for r in on + off:
        assert max(abs(lp - x) for (lp, _, _), x in zip(r["meta_info"]["output_token_logprobs"], ref)) < 1e-5


def test_abort_keeps_the_prompt_pages(engines):
    """An aborted request's prompt was prefilled whole: its pages serve the next request."""
    ids = prompt(7, 35)
    rid = "prefix-abort"

    async def aborted(url: str) -> dict:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {
                "input_ids": ids,
                "rid": rid,
                "stream": True,
                "sampling_params": {**SAMPLED, "max_new_tokens": 2000},
            }
            async with client.stream("POST", url + "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        await client.post(url + "/abort_request", json={"rid": rid})
                        break
        return generate(url, input_ids=ids, sampling_params={**SAMPLED, "sampling_seed": 9}, return_logprob=True)

    on, off = (asyncio.run(aborted(url)) for url in engines)
    assert on["output_ids"] == off["output_ids"]
    assert on["meta_info"]["output_token_logprobs"] == off["meta_info"]["output_token_logprobs"]
    assert (on["meta_info"]["cached_tokens"], off["meta_info"]["cached_tokens"]) == (pages(34), 0)


def test_flush_cache_empties_it(engines):
    ids = prompt(8, 30)
    both(engines, input_ids=ids, sampling_params=SAMPLED)
    assert both(engines, input_ids=ids, sampling_params=SAMPLED)["meta_info"]["cached_tokens"] == pages(29)
    for url in engines:
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    assert both(engines, input_ids=ids, sampling_params=SAMPLED)["meta_info"]["cached_tokens"] == 0


def test_a_weight_load_never_serves_old_kv(engines, tiny_model_dir, tiny_model_dir_other_seed):
    """After a load (same version string or a new one) nothing is found; outputs follow the new
    weights exactly as the cache-off engine's do."""
    ids = prompt(9, 30)
    params = {**SAMPLED, "sampling_seed": 4}
    before = both(engines, input_ids=ids, sampling_params=params, return_logprob=True)
    try:
        for url in engines:
            r = post(url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir_other_seed)})
            assert r.json()["success"], r.text
        after = both(engines, input_ids=ids, sampling_params=params, return_logprob=True)
        assert after["meta_info"]["cached_tokens"] == 0
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
        again = both(engines, input_ids=ids, sampling_params=params, return_logprob=True)
        assert again["meta_info"]["cached_tokens"] == pages(29)
    finally:
        for url in engines:
            assert post(
                url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "back"}
            ).json()["success"]
    assert both(engines, input_ids=ids, sampling_params=params)["meta_info"]["cached_tokens"] == 0


def test_config_names_bad_cache_settings(tiny_model_dir):
    from slimish.engine.config import EngineConfig

    with pytest.raises(ValueError, match="page_size must be >= 1"):
        EngineConfig(model=str(tiny_model_dir), page_size=0)
    with pytest.raises(ValueError, match="radix_cache_max_tokens must be >= 64"):
        EngineConfig(model=str(tiny_model_dir), radix_cache_max_tokens=10)


# ---- the tree, in-process ------------------------------------------------------------------


def page_kv(tag: float) -> torch.Tensor:
    return torch.full((2, 2, 1, 4, 3), tag)  # [layers, k/v, heads, page of 4, head_dim]


def test_tree_matches_whole_pages_within_the_limit_and_namespace():
    cache = PrefixCache(page_size=4, max_tokens=64)
    ids = list(range(14))
    cache.insert("a", ids, 3, lambda k: page_kv(k))
    assert [float(kv[0, 0, 0, 0, 0]) for kv in cache.match("a", ids, 14)] == [0.0, 1.0, 2.0]
    assert len(cache.match("a", ids, 11)) == 2  # the limit cuts at a page
    assert len(cache.match("a", ids[:6] + [99] * 8, 14)) == 1  # diverges inside page 2
    assert cache.match("b", ids, 14) == []  # another namespace sees nothing
    calls = []
    cache.insert("a", ids[:8] + [50, 51, 52, 53], 3, lambda k: calls.append(k) or page_kv(9))
    assert calls == [2] and cache.tokens == 16  # shared pages are stored once
    cache.flush()
    assert cache.tokens == 0 and cache.match("a", ids, 14) == []


def test_tree_evicts_least_recently_used_leaves_first():
    cache = PrefixCache(page_size=4, max_tokens=16)  # four pages
    a, b = [1] * 8, [2] * 8
    cache.insert("ns", a, 2, page_kv)
    cache.insert("ns", b, 2, page_kv)
    cache.match("ns", a, 8)  # a is now the more recent
    cache.insert("ns", [3] * 4, 1, page_kv)  # one page over: b's leaf goes
    assert len(cache.match("ns", b, 8)) == 1 and len(cache.match("ns", a, 8)) == 2
    cache.insert("other", [4] * 12, 3, page_kv)  # three more: the oldest leaves, across namespaces
    assert cache.tokens == 16
    assert len(cache.match("other", [4] * 12, 12)) == 3
