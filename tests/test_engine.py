"""The built-in engine as a real process: /generate, logprobs, batching, abort, pause, info, errors."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
import torch
from helpers import generate, metric_total, post, wait_for
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from slimish.engine.config import EngineConfig
from slimish.launch.local import engine_process

PROMPTS = [[5, 17, 42, 99, 7], [300, 301, 302], list(range(60, 90)), [11] * 9]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(hf, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at every position of `ids` (row j predicts token j+1)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


# ---- correctness against HF --------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_hf_generate(engine, hf, prompt):
    out = generate(engine, input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == hf_greedy(hf, prompt, 24)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 24
    assert meta["finish_reason"] == {"type": "length", "length": 24}


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_output_logprobs_equal_hf(engine, hf, temperature):
    prompt = PROMPTS[2]
    params = {"temperature": temperature, "max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 3}
    out = generate(engine, input_ids=prompt, sampling_params=params, return_logprob=True)
    ids = out["output_ids"]
    lps = out["meta_info"]["output_token_logprobs"]
    assert len(lps) == len(ids) == out["meta_info"]["output_token_logprobs_length"] == 20
    assert [t for _, t, _ in lps] == ids
    ref = hf_logprobs(hf, prompt + ids, temperature or 1.0)
    expected = [float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]
    assert max(abs(a - b) for (a, _, _), b in zip(lps, expected)) < 1e-4


def test_input_logprobs_top_and_token_ids(engine, hf):
    prompt = PROMPTS[0]
    out = generate(
        engine,
        input_ids=prompt,
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        token_ids_logprob=[1, 2],
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    ref = hf_logprobs(hf, prompt + out["output_ids"])
    inp = meta["input_token_logprobs"]
    assert inp[0][0] is None and [t for _, t, _ in inp] == prompt
    assert all(abs(inp[j][0] - float(ref[j - 1, prompt[j]])) < 1e-4 for j in range(1, len(prompt)))
    top = meta["output_top_logprobs"]
    assert len(top) == 4 and all(len(e) == 3 for e in top)
    for i, entry in enumerate(top):
        vals, ids = torch.topk(ref[len(prompt) - 1 + i], 3)
        assert [t for _, t, _ in entry] == ids.tolist()
        assert entry[0][1] == out["output_ids"][i]  # greedy picks the top token
        assert isinstance(entry[0][2], str)  # return_text_in_logprobs
    picked = meta["output_token_ids_logprobs"]
    assert [[t for _, t, _ in e] for e in picked] == [[1, 2]] * 4
    assert abs(picked[0][0][0] - float(ref[len(prompt) - 1, 1])) < 1e-4
    assert len(meta["input_top_logprobs"]) == len(prompt) and meta["input_top_logprobs"][0] is None


def test_max_new_tokens_zero_scores_the_prompt(engine, hf):
    prompt = PROMPTS[2]
    out = generate(
        engine, input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    ref = hf_logprobs(hf, prompt)
    lps = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
    assert lps[0] is None and max(abs(lps[j] - float(ref[j - 1, prompt[j]])) for j in range(1, len(prompt))) < 1e-4


# ---- batches, n, concurrency -------------------------------------------------------------


def test_batch_and_n_return_lists_in_order(engine, hf):
    singles = [generate(engine, input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    batch = generate(engine, input_ids=PROMPTS, sampling_params=GREEDY)
    assert isinstance(batch, list) and [b["output_ids"] for b in batch] == singles
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [len(p) for p in PROMPTS]
    per_item = generate(engine, input_ids=PROMPTS[:2], sampling_params=[GREEDY, {**GREEDY, "max_new_tokens": 3}])
    assert [b["meta_info"]["completion_tokens"] for b in per_item] == [24, 3]
    n = generate(engine, input_ids=PROMPTS[0], sampling_params={**GREEDY, "n": 3}, rid="abc")
    assert [b["output_ids"] for b in n] == [singles[0]] * 3
    assert [b["meta_info"]["id"] for b in n] == ["abc-0", "abc-1", "abc-2"]
    two_by_two = generate(engine, input_ids=PROMPTS[:2], sampling_params={**GREEDY, "n": 2})
    assert [b["output_ids"] for b in two_by_two] == [singles[0], singles[0], singles[1], singles[1]]


def test_text_prompt_and_text_batch(engine, tok):
    text = "the quick brown fox"
    single = generate(engine, text=text, sampling_params=GREEDY)
    ids = generate(engine, input_ids=tok.encode(text), sampling_params=GREEDY)
    assert single["output_ids"] == ids["output_ids"]
    assert single["text"] == tok.decode(single["output_ids"], skip_special_tokens=True)
    batch = generate(engine, text=[text, "12+7="], sampling_params=GREEDY)
    assert batch[0]["output_ids"] == single["output_ids"] and len(batch) == 2


def test_sixteen_concurrent_requests_are_batched_and_exact(engine, hf):
    """Different lengths at once: every result equals HF greedy, and tokens interleave in time."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(3 + 2 * i)] for i in range(16)]
    lengths = [8 + 3 * i for i in range(16)]

    async def one(client, prompt, n):
        stamps, last = [], None
        body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": n}, "stream": True}
        async with client.stream("POST", engine + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
                    stamps.append(time.monotonic())
        return last, stamps

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(main())
    for (last, _), p, n in zip(results, prompts, lengths):
        assert last["output_ids"] == hf_greedy(hf, p, n)
    # The shortest request finished before the longest produced its last token, and
    # every request got its first token before the longest one finished: batched, not queued.
    first_done = min(s[-1] for _, s in results)
    last_started = max(s[0] for _, s in results)
    assert first_done < results[-1][1][-1] and last_started < results[-1][1][-1]


# ---- sampling params -----------------------------------------------------------------------


def test_sampling_seed_top_k_and_length(engine):
    p = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
    a = generate(engine, input_ids=PROMPTS[1], sampling_params={**p, "sampling_seed": 7})["output_ids"]
    b = generate(engine, input_ids=PROMPTS[1], sampling_params={**p, "sampling_seed": 7})["output_ids"]
    c = generate(engine, input_ids=PROMPTS[1], sampling_params={**p, "sampling_seed": 8})["output_ids"]
    assert a == b and a != c
    copies = generate(engine, input_ids=PROMPTS[1], sampling_params={**p, "sampling_seed": 7, "n": 3})
    assert copies[0]["output_ids"] == a and copies[1]["output_ids"] == c  # copy j draws with seed + j
    assert len({tuple(x["output_ids"]) for x in copies}) == 3
    greedy = generate(engine, input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 16})["output_ids"]
    top1 = generate(engine, input_ids=PROMPTS[1], sampling_params={**p, "top_k": 1, "sampling_seed": 1})["output_ids"]
    assert top1 == greedy
    tiny_p = generate(engine, input_ids=PROMPTS[1], sampling_params={**p, "top_p": 1e-6, "sampling_seed": 2})[
        "output_ids"
    ]
    assert tiny_p == greedy
    min_p = generate(engine, input_ids=PROMPTS[1], sampling_params={**p, "min_p": 1.0, "sampling_seed": 2})[
        "output_ids"
    ]
    assert min_p == greedy


def test_sampling_follows_the_reported_distribution(engine):
    """Three tokens carry the mass (logit bias); frequencies over 400 draws match exp(logprob)."""
    bias = {"11": 40.0, "12": 40.7, "13": 41.1}
    params = {"temperature": 1.0, "max_new_tokens": 1, "ignore_eos": True, "logit_bias": bias, "n": 400}
    out = generate(engine, input_ids=PROMPTS[1], sampling_params=params, return_logprob=True)
    firsts = [o["meta_info"]["output_token_logprobs"][0] for o in out]
    probs = {t: float(torch.tensor(lp).exp()) for lp, t, _ in firsts}
    assert set(probs) == {11, 12, 13} and abs(sum(probs.values()) - 1) < 1e-3
    for t, p in probs.items():
        freq = sum(1 for _, tok, _ in firsts if tok == t) / len(firsts)
        assert abs(freq - p) < 0.08, (t, freq, p)


def test_stop_token_ids_stop_strings_and_trim(engine, tok):
    base = generate(engine, input_ids=PROMPTS[0], sampling_params=GREEDY)
    ids = base["output_ids"]
    k = 5
    stopped = generate(engine, input_ids=PROMPTS[0], sampling_params={**GREEDY, "stop_token_ids": [ids[k]]})
    first = ids.index(ids[k])
    assert stopped["output_ids"] == ids[: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert stopped["text"] == tok.decode(ids[:first], skip_special_tokens=True)  # the stop token's text is cut
    text = base["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "the tiny model's text has a usable stop string"
    cut = generate(engine, input_ids=PROMPTS[0], sampling_params={**GREEDY, "stop": stop})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.index(stop)]
    kept = generate(engine, input_ids=PROMPTS[0], sampling_params={**GREEDY, "stop": [stop], "no_stop_trim": True})
    assert kept["text"].endswith(stop) or stop in kept["text"]
    assert kept["output_ids"] == cut["output_ids"]


def test_eos_stops_unless_ignored(engine, tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    biased = {"temperature": 0.0, "max_new_tokens": 10, "logit_bias": {str(eos): 100.0}}
    out = generate(engine, input_ids=PROMPTS[0], sampling_params=biased)
    assert out["output_ids"] == [eos] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    out = generate(engine, input_ids=PROMPTS[0], sampling_params={**biased, "ignore_eos": True})
    assert out["output_ids"] == [eos] * 10
    out = generate(engine, input_ids=PROMPTS[0], sampling_params={**biased, "min_new_tokens": 3})
    assert len(out["output_ids"]) == 4 and out["output_ids"][-1] == eos and eos not in out["output_ids"][:3]


def test_streaming_is_cumulative(engine):
    full = generate(engine, input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 6})
    chunks = []
    with httpx.stream(
        "POST",
        engine + "/generate",
        json={"input_ids": PROMPTS[1], "sampling_params": {**GREEDY, "max_new_tokens": 6}, "stream": True},
        timeout=60,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == full["output_ids"] and chunks[-1]["text"] == full["text"]
    assert "e2e_latency" in chunks[-1]["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]


# ---- abort and pause -----------------------------------------------------------------------


def server_state(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]


LONG = {"temperature": 0.0, "max_new_tokens": 1500, "ignore_eos": True}


def test_abort_mid_generation_returns_partial_tokens(engine):
    chunks = []
    with httpx.stream(
        "POST",
        engine + "/generate",
        json={"input_ids": PROMPTS[0], "sampling_params": LONG, "stream": True, "rid": "long-1"},
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 5:
                assert post(engine, "/abort_request", {"rid": "long-1"}).status_code == 200
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= last["meta_info"]["completion_tokens"] < 1500 == LONG["max_new_tokens"]
    assert len(last["output_ids"]) == last["meta_info"]["completion_tokens"]


def test_stream_client_disconnect_aborts(engine):
    """The request stops where the client left: counted as aborted, far short of its 1500 tokens."""
    aborted, generated = (
        metric_total(engine, "sglang:num_aborted_requests_total"),
        metric_total(engine, "sglang:generation_tokens_total"),
    )
    with httpx.stream(
        "POST",
        engine + "/generate",
        json={"input_ids": PROMPTS[0], "sampling_params": LONG, "stream": True},
        timeout=60,
    ) as r:
        for i, _ in enumerate(line for line in r.iter_lines() if line.startswith("data: {")):
            if i == 3:
                break
    wait_for(lambda: metric_total(engine, "sglang:num_aborted_requests_total") == aborted + 1)
    assert metric_total(engine, "sglang:generation_tokens_total") - generated < 300
    assert server_state(engine)["#running-req"] == 0 and server_state(engine)["#queue-req"] == 0


def test_abort_all_non_streaming(engine):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(
                client.post(engine + "/generate", json={"input_ids": PROMPTS[1], "sampling_params": LONG})
            )
            await asyncio.to_thread(wait_for, lambda: server_state(engine)["#running-req"] == 1)
            r = await client.post(engine + "/abort_request", json={"abort_all": True})
            assert r.status_code == 200 and r.content == b""
            return (await task).json()

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 1500


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keeps_requests_and_resumes_exactly(engine, mode):
    params = {**GREEDY, "max_new_tokens": 400}
    expected = generate(engine, input_ids=PROMPTS[2], sampling_params=params)["output_ids"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            task = asyncio.create_task(
                client.post(engine + "/generate", json={"input_ids": PROMPTS[2], "sampling_params": params})
            )
            await asyncio.to_thread(wait_for, lambda: server_state(engine)["#running-req"] == 1)
            r = await client.post(engine + "/pause_generation", json={"mode": mode})
            assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
            state = server_state(engine)
            assert (state["#running-req"], state["#queue-req"]) == ((0, 1) if mode == "retract" else (1, 0))
            assert not task.done()
            r = await client.post(engine + "/continue_generation", json={})
            assert r.json()["status"] == "ok"
            return (await task).json()

    out = asyncio.run(main())
    assert out["output_ids"] == expected
    assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


def test_pause_abort_and_requests_wait_while_paused(engine):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            running = asyncio.create_task(
                client.post(engine + "/generate", json={"input_ids": PROMPTS[1], "sampling_params": LONG})
            )
            await asyncio.to_thread(wait_for, lambda: server_state(engine)["#running-req"] == 1)
            await client.post(engine + "/pause_generation", json={"mode": "abort"})
            aborted = (await running).json()
            later = asyncio.create_task(
                client.post(engine + "/generate", json={"input_ids": PROMPTS[1], "sampling_params": GREEDY})
            )
            await asyncio.to_thread(wait_for, lambda: server_state(engine)["#queue-req"] == 1)
            assert not later.done()
            await client.post(engine + "/continue_generation", json={})
            return aborted, (await later).json()

    aborted, later = asyncio.run(main())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and aborted["output_ids"]
    assert later["meta_info"]["finish_reason"]["type"] == "length" and len(later["output_ids"]) == 24


# ---- control, info, metrics ----------------------------------------------------------------


def test_health_info_and_models(engine, tiny_model_dir):
    for path in ["/health", "/health_generate", "/ready"]:
        assert httpx.get(engine + path, timeout=30).status_code == 200
    info = httpx.get(engine + "/model_info").json()
    assert info == httpx.get(engine + "/get_model_info").json()
    assert info["model_path"] == str(tiny_model_dir.resolve()) and info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    server = httpx.get(engine + "/server_info").json()
    assert server.keys() == httpx.get(engine + "/get_server_info").json().keys()
    assert (
        server["tp_size"] == 1
        and server["dp_size"] == 1
        and server["max_running_requests"] == EngineConfig.max_running_requests
    )
    assert "api_key" not in server
    models = httpx.get(engine + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == info["served_model_name"]
    assert models["data"][0]["max_model_len"] == server["context_length"]


def test_metrics_count_tokens(engine, tiny_model_dir):
    """SGLang's names and labels, read by prometheus_client's parser; `cached_tokens_total` counts
    the prompt tokens replies report as cached."""
    prompt = list(range(400, 470))  # a whole 64-token page, then 6 more
    generate(engine, input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 1})
    names = ("sglang:generation_tokens_total", "sglang:prompt_tokens_total")
    before = [metric_total(engine, n, is_streaming="false") for n in names]
    cached_before = metric_total(engine, "sglang:cached_tokens_total", cache_source="total")
    out = generate(engine, input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 7})
    after = [metric_total(engine, n, is_streaming="false") for n in names]
    assert after[0] - before[0] == 7 and after[1] - before[1] == len(prompt)
    assert out["meta_info"]["cached_tokens"] == 64
    assert metric_total(engine, "sglang:cached_tokens_total", cache_source="total") - cached_before == 64
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(engine + "/metrics").text)}
    ranks = {
        "model_name": str(tiny_model_dir.resolve()),
        "engine_type": "unified",
        "tp_rank": "0",
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    assert families["sglang:num_running_reqs"].samples[0].labels == ranks
    cached = [s for s in families["sglang:cached_tokens"].samples if s.name == "sglang:cached_tokens_total"]
    assert [s.labels["cache_source"] for s in cached] == ["total"]


def test_weight_version_flush_and_memory_endpoints(engine, tiny_model_dir):
    r = post(engine, "/update_weight_version", {"new_version": "v7"})
    assert r.json() == {"success": True, "message": "Weight version updated to v7", "new_version": "v7"}
    assert (
        generate(engine, input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 2})["meta_info"][
            "weight_version"
        ]
        == "v7"
    )
    assert httpx.get(engine + "/model_info").json()["weight_version"] == "v7"
    assert post(engine, "/begin_weight_update", {}).json()["success"] is True
    again = post(engine, "/begin_weight_update", {})
    assert again.status_code == 400 and "already open" in again.json()["message"]
    assert post(engine, "/end_weight_update", {}).json()["success"] is True
    assert post(engine, "/end_weight_update", {}).status_code == 400
    flushed = post(engine, "/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    assert httpx.get(engine + "/flush_cache").status_code == 200
    for path in ["/release_memory_occupation", "/resume_memory_occupation"]:
        r = post(engine, path, {"tags": None})
        assert r.status_code == 200 and r.json() is None
    gone = post(engine, "/destroy_weights_update_group", {"group_name": "nope"})
    assert gone.status_code == 400 and gone.json() == {
        "success": False,
        "message": "The group to be destroyed does not exist.",
    }


def test_get_weights_by_name_matches_checkpoint(engine, hf):
    r = post(engine, "/get_weights_by_name", {"name": "model.layers.0.mlp.up_proj.weight", "truncate_size": 3})
    assert r.status_code == 200
    expected = hf.state_dict()["model.layers.0.mlp.up_proj.weight"][:3]
    assert torch.equal(torch.tensor(r.json()), expected)
    bad = post(engine, "/get_weights_by_name", {"name": "no.such.weight"})
    assert bad.status_code == 400 and "no.such.weight" in bad.json()["message"]


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1.0}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"foo": 1}}, "sampling_params.foo"),
        ({"input_ids": "x"}, "input_ids"),
        ({"input_ids": [1, 2], "stream": 1}, "stream"),
        ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
        ({}, "text` or `input_ids"),
        ({"text": "a", "input_ids": [1]}, "text` or `input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ],
)
def test_schema_errors_name_the_field(engine, body, field):
    r = post(engine, "/generate", body)
    assert r.status_code == 400
    assert isinstance(r.json()["error"], str) and field in r.json()["error"]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"input_ids": []}, "input_ids cannot be empty"),
        ({"input_ids": [1, 10**7]}, "outside the vocabulary"),
        ({"input_ids": [1] * 5000}, "context length"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}}, "max_new_tokens"),
        (
            {"input_ids": [1, 2], "sampling_params": {"regex": "a("}},
            "sampling_params.regex: Failed to compile regex grammar",
        ),
        ({"input_ids": [1, 2], "logprob_start_len": 5, "return_logprob": True}, "logprob_start_len"),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params.n"),
        # Found by tests/test_fuzz.py (each was a 500, or a scheduler step that aborted everyone):
        ({"text": []}, "text: an empty batch"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params: got 1 values for 2 prompts"),
        ({"input_ids": [[1], [2]], "logprob_start_len": [0]}, "logprob_start_len: got 1 values for 2 prompts"),
        (
            {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [2**70]}},
            "sampling_params.stop_token_ids: token id",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**64}}, "sampling_params.sampling_seed"),
        (
            {"input_ids": [1, 2], "sampling_params": {"stop_regex": "("}},
            "sampling_params.stop_regex: '(' is not a valid",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"\u00b2": 1.0}}}, "sampling_params.logit_bias: keys"),
        ({"text": "a\ud800"}, "lone surrogate"),
    ],
)
def test_request_errors_name_the_field(engine, body, words):
    r = httpx.post(engine + "/generate", content=json.dumps(body), timeout=60)  # ASCII JSON: "\ud800" escaped
    assert r.status_code == 400 and words in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "params, top",
    [
        ({"temperature": 5e-324}, 0),  # below SGLang's 1e-6: greedy, as SGLang
        ({"repetition_penalty": 5e-324}, 0),  # a logit divided by it is +inf
        ({"logit_bias": {"3": 1.7e308, "4": -1.7e308}}, 5),  # log 0 among the top logprobs
        ({"min_new_tokens": 2}, 2000),  # the masked EOS is -inf
        ({"min_new_tokens": 2, "temperature": 3.4028235677973366e38}, 0),  # inf in float32; -inf / inf is NaN
    ],
)
def test_extreme_sampling_values_give_finite_json(engine, params, top):
    """Each was a 500 (NaN or -inf logprobs are not JSON); -inf alternatives come back as null."""
    out = generate(
        engine,
        input_ids=PROMPTS[0],
        return_logprob=True,
        top_logprobs_num=top,
        sampling_params={"max_new_tokens": 2, **params},
    )
    lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert len(lps) == 2 and all(math.isfinite(lp) for lp in lps)
    if params.get("temperature", 1.0) < 1e-6:
        assert (
            out["output_ids"]
            == generate(engine, input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 2})["output_ids"]
        )


def test_malformed_json_and_server_keeps_serving(engine):
    r = httpx.post(engine + "/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(engine + "/generate", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert post(engine, "/pause_generation", {"mode": "sideways"}).status_code == 400
    assert httpx.get(engine + "/health_generate", timeout=30).status_code == 200
    router_keys = {
        "model": None,
        "log_metrics": True,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "return_hidden_states": False,
        "return_text_in_logprobs": False,
        "stream": False,
        "some_future_key": {"x": 1},
    }
    out = generate(engine, input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 3}, **router_keys)
    assert len(out["output_ids"]) == 3


def test_api_keys_guard_routes(tiny_model_dir):
    with engine_process(tiny_model_dir, api_key="serve-key", admin_api_key="admin-key") as proc:
        url = proc.url
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        assert httpx.post(url + "/generate", json=body).status_code == 401
        assert httpx.post(url + "/generate", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert (
            httpx.post(url + "/generate", json=body, headers={"Authorization": "Bearer serve-key"}).status_code == 200
        )
        assert httpx.get(url + "/health").status_code == 200
        pause = {"mode": "in_place"}
        assert (
            httpx.post(url + "/pause_generation", json=pause, headers={"Authorization": "Bearer serve-key"}).status_code
            == 401
        )
        assert (
            httpx.post(url + "/pause_generation", json=pause, headers={"Authorization": "Bearer admin-key"}).status_code
            == 200
        )
