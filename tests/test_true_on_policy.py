"""True on-policy: the engine's batch-invariant inference, rollout and trainer log-probs equal bit
for bit, sync runs that reproduce bit for bit, and a resumed run that trains on the same tokens."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch
from helpers import ROOT, SHORT_QUICKSTART, quickstart_argv, run_quickstart
from test_train_resume import KILLER

from slimish.launch.local import engine_process
from slimish.metrics import read_metrics
from slimish.trainer.batch import check_exact

PROMPTS = 32
rng = random.Random(0)
MIXED = [[rng.randrange(10, 1000) for _ in range(rng.randrange(3, 70))] for _ in range(PROMPTS)]


def _params(i: int) -> dict:
    return {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1000 + i, "ignore_eos": True}


async def _post(session: aiohttp.ClientSession, url: str, path: str, body: dict) -> object:
    async with session.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json(content_type=None) if path == "/generate" else None


async def _outputs(url: str, alone: bool, flush: bool = True) -> list[tuple[list[int], list[float], int]]:
    """Each prompt's (output ids, their log-probs, cached prompt tokens): one request per prompt
    with the cache flushed before each (`alone`), else all 32 in one batch."""
    async with aiohttp.ClientSession() as s:
        if alone:
            replies = []
            for i, ids in enumerate(MIXED):
                await _post(s, url, "/flush_cache", {})
                replies.append(
                    await _post(
                        s, url, "/generate", {"input_ids": ids, "sampling_params": _params(i), "return_logprob": True}
                    )
                )
        else:
            if flush:
                await _post(s, url, "/flush_cache", {})
            body = {"input_ids": MIXED, "sampling_params": [_params(i) for i in range(PROMPTS)], "return_logprob": True}
            replies = await _post(s, url, "/generate", body)
    return [
        (r["output_ids"], [t[0] for t in r["meta_info"]["output_token_logprobs"]], r["meta_info"]["cached_tokens"])
        for r in replies
    ]


def test_engine_outputs_do_not_depend_on_the_batch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """32 prompts of 3-69 tokens, sampled at T=1 with seeds: each one's tokens and log-probs are
    bitwise the same alone, in one batch of 32, after prefix-cache hits (pages of 8), and on an
    engine that runs 3 at a time. (Without the flag, log-probs differ by up to ~1e-6.)"""
    flags = {"enable_deterministic_inference": True, "page_size": 8}
    with (
        engine_process(tiny_model_dir, log_path=tmp_path / "a.log", **flags) as wide,
        engine_process(tiny_model_dir, log_path=tmp_path / "b.log", max_running_requests=3, **flags) as narrow,
    ):
        alone = asyncio.run(_outputs(wide.url, alone=True))
        batch = asyncio.run(_outputs(wide.url, alone=False))
        hit = asyncio.run(_outputs(wide.url, alone=False, flush=False))
        three = asyncio.run(_outputs(narrow.url, alone=False))
    assert sum(cached for *_, cached in hit) > 0  # the second batch's prompts came from the cache
    expected = [(ids, logprobs) for ids, logprobs, _ in alone]
    for name, got in (("batch of 32", batch), ("prefix-cache hit", hit), ("max_running_requests=3", three)):
        assert [(ids, logprobs) for ids, logprobs, _ in got] == expected, name


def test_batch_invariant_attention_is_attention_and_trains() -> None:
    """The fixed-point attention against HF's SDPA (causal, GQA): the same values up to rounding,
    the same gradients for q, k and v (the trainer learns through it), and the forward's bits the
    same with and without gradient (the training forward is the one checked against the rollout)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from slimish.batch_invariant import attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 16, requires_grad=True) for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    ours, _ = attention(module, q, k, v, None)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True)
    torch.testing.assert_close(ours, theirs)
    weights = torch.randn_like(ours)
    for a, b in zip(
        torch.autograd.grad((ours * weights).sum(), (q, k, v)), torch.autograd.grad((theirs * weights).sum(), (q, k, v))
    ):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        assert torch.equal(attention(module, q, k, v, None)[0], ours.detach())


def test_the_samplers_log_softmax_is_the_trainers_bit_for_bit() -> None:
    """The engine's sampler takes its log-probs with the exponentials it draws from; they are
    `log_softmax`'s bits (the trainer's) at vocabularies of these models and others, with masked
    (-inf) logits, and the exponentials are exp(x - max)."""
    from slimish.batch_invariant import log_softmax, logsumexp_and_exp

    g = torch.Generator().manual_seed(0)
    for shape in [(32, 8192), (1, 151936), (5, 1000), (3, 17), (2, 128256)]:
        for scale in (1.0, 30.0):
            x = torch.randn(shape, generator=g) * scale
            x[0, ::7] = float("-inf")
            lse, weights = logsumexp_and_exp(x)
            assert torch.equal(x - lse, log_softmax(x)), (shape, scale)
            assert torch.equal(weights, (x - x.amax(-1, keepdim=True)).exp())


def test_check_exact_names_the_tokens_that_differ() -> None:
    """The per-step check: equal log-probs pass; one token off by one ulp stops the run, masked
    positions do not count."""
    rollout = torch.tensor([[-1.5, -0.25, -3.0], [-2.0, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    check_exact(rollout.clone(), rollout, mask)
    padded = rollout.clone()
    padded[1, 2] = 7.0  # padding: not a trained token
    check_exact(padded, rollout, mask)
    off = rollout.clone()
    off[0, 1] = torch.nextafter(off[0, 1], torch.tensor(0.0))
    with pytest.raises(RuntimeError, match=r"true_on_policy: 1 of 5 trained tokens"):
        check_exact(off, rollout, mask)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.backend=megatron", "trainer.backend=torch"),
        ("launch.engine_kind=sglang", "launch.engine_kind=builtin"),
        ("trainer.lora.enabled=true", "trainer.lora.enabled=false"),
        ("async_training=true buffer.max_staleness=1", "async_training=false"),
    ],
)
def test_true_on_policy_refuses_what_it_cannot_make_exact(override: str, named: str) -> None:
    from slimish.config import load_run_config

    with pytest.raises(SystemExit, match=f"algorithm.true_on_policy needs .*{re.escape(named)}"):
        load_run_config(None, ["model=m", "data.source=x", "algorithm.true_on_policy=true", *override.split()])


def test_deterministic_engine_refuses_lora_and_gpus() -> None:
    from slimish.engine.config import EngineConfig

    with pytest.raises(ValueError, match="enable_deterministic_inference .*not with LoRA"):
        EngineConfig(model="m", enable_deterministic_inference=True, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="enable_deterministic_inference .*device is 'cuda'"):
        EngineConfig(model="m", enable_deterministic_inference=True, device="cuda")


TRUE_ON_POLICY = (*SHORT_QUICKSTART, "steps=3", "algorithm.true_on_policy=true")
TIMING = ("time", "_per_s", "idle_fraction")


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def _killed_after_training_step_two(tmp_path: Path, model: Path) -> None:
    """The run SIGKILLed once step 2's update is applied, nothing of it pushed or saved
    (tests/test_train_resume.py's killer): it resumes from step 1's checkpoint."""
    argv = quickstart_argv(tmp_path, *TRUE_ON_POLICY, "checkpoint.every=1", model=model)
    killer = [sys.executable, "-c", KILLER, "train", "2", *argv[3:]]
    first = subprocess.run(
        killer, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the shared SFT warm start, when this test is the first to need it
def test_true_on_policy_run_is_exact_and_reproduces_across_a_kill(
    quickstart_sft: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The quickstart from its SFT warm start in true on-policy mode, 3 steps: train/mismatch is
    exactly 0.0 at every step (and the per-step check passed, or the run would have failed); a
    second run of the same config and seed, colocated (`launch.colocate`: the engine maps the
    trainer's weights, no push copies them), and a third SIGKILLed in step 2 and resumed, write
    identical metrics, timings aside (the trainer's loss, entropy and grad norm too: a batch is in
    the order its prompts were taken, whatever order they finished in). So runs reproduce, and a
    colocated run is the broadcast run, bit for bit, and learns as the quickstart test shows."""
    rows = [
        _untimed(run_quickstart(tmp_path_factory.mktemp(f"run{i}"), *TRUE_ON_POLICY, *more, model=quickstart_sft))
        for i, more in enumerate(([], ["launch.colocate=true"]))
    ]
    trained = [r for r in rows[0] if "train/mismatch" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(r["train/mismatch"] == 0.0 and r["train/mismatch_seq_max"] == 0.0 for r in trained), trained
    assert rows[1] == rows[0]

    resumed = tmp_path_factory.mktemp("resumed")
    _killed_after_training_step_two(resumed, quickstart_sft)
    argv = [*quickstart_argv(resumed, *TRUE_ON_POLICY, "checkpoint.every=1", model=quickstart_sft), "--resume", "auto"]
    done = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    after = _untimed(read_metrics(resumed / "run"))
    assert after[:2] == rows[0][:2]  # steps 0 and 1, before the kill (and the resumed run's push at 1)
    assert after[2:] == rows[0][2:]
