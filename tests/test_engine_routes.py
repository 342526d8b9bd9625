"""Routes from the built-in engine in SGLang's protocol (docs/protocol.md 1.6): `meta_info.routed_experts`
read with a decoder written from SGLang's source (`helpers.decode_sglang_routes`, not slimish's own
protocol.py) and compared with the routers' top-k in one full-sequence HF forward of the same tokens
(fp32, so no route flips between the paged engine and the reference).

Three servers started together: the built-in engine on the tiny Qwen3-MoE with
`--enable-return-routed-experts` and 8-token pages (short prompts span pages and hit the prefix
cache); the built-in engine on the tiny Qwen2-MoE without the flag (the refusal); the SGLang double
(tests/sglang_double) without the flag (SGLang's silence). The capture itself (dense layers,
Qwen2-MoE's shared expert) is checked in-process on the runner.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from helpers import decode_sglang_routes, generate, generate_response, post, reference_routes
from transformers import AutoConfig, AutoModelForCausalLM

from slimish import moe
from slimish.engine.config import EngineConfig
from slimish.engine.items import Item, RequestError, check_routes
from slimish.engine.prefix_cache import PrefixCache
from slimish.engine.runner import KVBatch, Runner
from slimish.engine.scheduler import LogprobWish
from slimish.launch.local import engine_process
from slimish.launch.sglang import sglang_process
from slimish.processes import start_all
from slimish.protocol import SamplingParams

PAGE = 8
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
ROUTES = {"return_routed_experts": True}


def prompt(length: int, salt: int) -> list[int]:
    """Distinct prompts per salt, clear of the tiny models' special ids (0, 2, 3)."""
    return [(7 * i + 131 * salt) % 1000 + 4 for i in range(length)]


@pytest.fixture(scope="module")
def urls(sglang_double, moe_routes_engine, tiny_qwen3_moe_dir, tiny_qwen2_moe_dir, tmp_path_factory) -> dict[str, str]:
    logs = tmp_path_factory.mktemp("routes-logs")
    procs = {
        "no_flag": engine_process(tiny_qwen2_moe_dir, log_path=logs / "no_flag.log", page_size=PAGE),
        "sglang_no_flag": sglang_process(tiny_qwen3_moe_dir, [], log_path=logs / "sglang_no_flag.log"),
    }
    try:
        start_all(list(procs.values()), timeout=120)
        yield {"qwen3_moe": moe_routes_engine} | {arch: p.url for arch, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def models(tiny_qwen3_moe_dir, tiny_qwen2_moe_dir) -> dict[str, torch.nn.Module]:
    """The same checkpoints in this process, fp32, for the reference forwards."""
    return {
        arch: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for arch, d in (("qwen3_moe", tiny_qwen3_moe_dir), ("qwen2_moe", tiny_qwen2_moe_dir))
    }


def check_reply(model: torch.nn.Module, reply: dict, ids: list[int], start: int) -> np.ndarray:
    """SGLang's coverage: rows [start, seqlen - 1), each the reference's choice for that token."""
    cfg = model.config
    routes = decode_sglang_routes(reply["meta_info"]["routed_experts"], cfg.num_hidden_layers, cfg.num_experts_per_tok)
    seq = ids + reply["output_ids"][:-1]  # the last token is never fed forward
    assert routes.shape == (len(seq) - start, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    np.testing.assert_array_equal(routes, reference_routes(model, seq)[start:])
    return routes


def test_routes_of_32_requests_are_the_routers_choices(urls, models):
    """Mixed prompt lengths over several pages, n=2 copies (one shared prefill each), sampled and
    greedy, starts 0, 5 and the prompt length (1 new token and start = prompt: zero rows), all in
    flight at once so decode rows interleave across requests."""
    url, model = urls["qwen3_moe"], models["qwen3_moe"]
    batches = [  # (prompts, sampling params per prompt, n, start; None: the prompt's length)
        ([prompt(n, 1 + i) for i, n in enumerate([3, 8, 13, 17, 24, 30])], [1, 5, 9, 12, 3, 7], 2, SAMPLED, 0),
        ([prompt(n, 10 + i) for i, n in enumerate([5, 9, 16, 21, 6, 11])], [4, 6, 2, 8, 5, 3], 1, GREEDY, 5),
        ([prompt(10, 20 + i) for i in range(4)], [1, 4, 6, 8], 2, SAMPLED, 10),
        *[([prompt(n, 30 + n)], [6], 1, GREEDY, None) for n in (2, 7, 12, 19, 26, 33)],
    ]

    def send(batch):
        prompts, new, n, params, start = batch
        start = len(prompts[0]) if start is None else start
        body = {
            "input_ids": prompts if len(prompts) > 1 else prompts[0],
            "sampling_params": [{**params, "n": n, "max_new_tokens": m} for m in new],
            "routed_experts_start_len": start,
            **ROUTES,
        }
        if len(prompts) == 1:
            body["sampling_params"] = body["sampling_params"][0]
        out = generate(url, **body)
        return [(reply, prompts[k // n], start) for k, reply in enumerate(out if isinstance(out, list) else [out])]

    with ThreadPoolExecutor(len(batches)) as pool:
        replies = [r for done in pool.map(send, batches) for r in done]
    assert len(replies) == 32
    for reply, ids, start in replies:
        check_reply(model, reply, ids, start)
    empty = [r for r, ids, start in replies if start == len(ids) and len(r["output_ids"]) == 1]
    assert empty and all(r["meta_info"]["routed_experts"] == "" for r in empty)  # present, not None, as SGLang
    assert httpx.get(url + "/server_info", timeout=10).json()["enable_return_routed_experts"] is True


def test_a_prefix_cache_hit_returns_the_same_routes(urls, models):
    """The cached pages' routes come with their KV: the reply is byte-identical with and without a
    hit, and a request that shares only the prefix gets that prefix's routes."""
    url, model = urls["qwen3_moe"], models["qwen3_moe"]
    ids = prompt(27, 40)
    body = {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 5}, **ROUTES}
    first, again = generate(url, **body), generate(url, **body)
    assert (first["meta_info"]["cached_tokens"], again["meta_info"]["cached_tokens"]) == (0, 24)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["routed_experts"] == first["meta_info"]["routed_experts"]
    check_reply(model, first, ids, 0)
    other = ids[:16] + prompt(5, 41)
    reply = generate(url, **{**body, "input_ids": other})
    assert reply["meta_info"]["cached_tokens"] == 16
    check_reply(model, reply, other, 0)


def test_streamed_retracted_then_aborted_request(urls, models):
    """Non-final chunks carry no routes; a retraction re-prefills the generated tokens and replaces
    the routes (no row twice); the aborted request's final chunk carries every row up to its last
    token."""
    url, model = urls["qwen3_moe"], models["qwen3_moe"]
    ids, chunks, resumed = prompt(11, 50), [], 0
    body = {
        "input_ids": ids,
        "sampling_params": {**GREEDY, "max_new_tokens": 1500},
        "stream": True,
        "rid": "routes-long",
        "routed_experts_start_len": 4,
        **ROUTES,
    }
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 3:
                assert post(url, "/pause_generation", {"mode": "retract"}).status_code == 200
                assert post(url, "/continue_generation").status_code == 200
            resumed += chunks[-1]["meta_info"]["num_retractions"] == 1
            if resumed == 3:
                assert post(url, "/abort_request", {"rid": "routes-long"}).status_code == 200
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and last["meta_info"]["num_retractions"] == 1
    assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
    check_reply(model, last, ids, 4)


def test_refusals(urls):
    """Without the server flag a request for routes is a 400 (slimish's extension: SGLang omits
    them silently); a start outside [0, prompt length] is SGLang's 400, checked per batch item."""
    r = generate_response(
        urls["no_flag"], input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, status=400, **ROUTES
    )
    assert "return_routed_experts: this engine was started without --enable-return-routed-experts" in r.text
    assert httpx.get(urls["no_flag"] + "/server_info", timeout=10).json()["enable_return_routed_experts"] is False
    quiet = generate(urls["sglang_no_flag"], input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, **ROUTES)
    assert "routed_experts" not in quiet["meta_info"]  # SGLang without the flag: no key, no error
    assert (
        httpx.get(urls["sglang_no_flag"] + "/server_info", timeout=10).json()["enable_return_routed_experts"] is False
    )
    url = urls["qwen3_moe"]
    for start, why in ((-1, "-1 is lower than 0"), (4, "4 is higher than the number of input tokens 3")):
        r = generate_response(
            url, input_ids=[5, 6, 7], routed_experts_start_len=start, status=400, sampling_params={}, **ROUTES
        )
        assert f"routed_experts_start_len: {why}" in r.text
    r = generate_response(
        url, input_ids=[[5, 6, 7, 8, 9], [5, 6]], routed_experts_start_len=3, status=400, sampling_params={}, **ROUTES
    )
    assert "3 is higher than the number of input tokens 2" in r.text
    item = Item([5, 6, 7], SamplingParams(), "r", LogprobWish(return_routed_experts=True))
    with pytest.raises(RequestError, match="return_routed_experts: this model has no MoE router"):
        check_routes(item, EngineConfig(model="m", enable_return_routed_experts=True), moe_model=False)


def test_qwen2_moe_routes_hold_top_k_columns_only(models):
    """The shared expert (always on) is no routed column: K = num_experts_per_tok, as SGLang cuts
    its fused shared-expert column off."""
    model, ids = models["qwen2_moe"], prompt(19, 60)
    out = Runner(model, PAGE, None, capture_routes=True).prefill(ids, None, ())
    assert out.routes.shape == (19, 2, model.config.num_experts_per_tok) == (19, 2, 2)
    np.testing.assert_array_equal(out.routes.numpy(), reference_routes(model, ids))


def test_capture_zeros_dense_layers_and_stays_off_without_the_flag(tiny_qwen3_moe_dir):
    """A dense layer (`mlp_only_layers`) has rows of 0, as SGLang's zero-filled buffer; without
    capture no hook is installed, so the default path pays nothing."""
    cfg = AutoConfig.from_pretrained(tiny_qwen3_moe_dir)
    cfg.mlp_only_layers = [1]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert list(moe.routers(model)) == [0]
    ids = prompt(13, 70)
    runner = Runner(model, 4, PrefixCache(4, 64), capture_routes=True)
    out = runner.prefill(ids, None, ())
    batch = KVBatch(model)
    batch.add([out.slab], [len(ids)])
    runner.decode(batch, [9])
    routes = torch.cat([out.routes, runner.decode_routes]).numpy()
    np.testing.assert_array_equal(routes, reference_routes(model, ids + [9]))
    assert (routes[:, 1] == 0).all() and routes.shape == (14, 2, 2)
    plain = Runner(AutoModelForCausalLM.from_config(cfg).eval(), 4, None)
    assert plain.capture is None and not any(r._forward_hooks for r in moe.routers(plain.model).values())
