"""The rollout manager against two real built-in engines behind the real router (started as a run
starts them, `launch.local_servers`): groups, concurrency, failures, filters with over-sampling,
the end-of-step abort with requeue and partial rollout, accounting, state, evaluation, the CLI."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import accounted, make_cfg, run_manager
from transformers import AutoTokenizer

from rollout_plugins import math as math_plugin
from slimish.client import Client
from slimish.formats.model import ModelFormat
from slimish.launch.local import Servers
from slimish.protocol import DEFAULT_WEIGHT_VERSION
from slimish.rollout.evaluation import eval_sets
from slimish.rollout.filters import nonzero_std
from slimish.rollout.manager import RolloutManager
from slimish.rollout.rewards import group_reward, math_reward
from slimish.rollout.stats import RolloutStalled
from slimish.types import Sample, SampleStatus


async def greedy(url: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    async with Client(url) as client:
        out = await client.generate(
            input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0}, return_logprob=True
        )
    return out.output_ids, [e[0] for e in out.meta_info.output_token_logprobs]


def test_math_plugin_end_to_end(servers: Servers, tiny_model_dir: Path, prompts: str) -> None:
    """Groups of n with stream-position ids, the engine's exact tokens and logprobs, a reward each."""
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=3",
        "rollout.rollout_batch_size=2",
        "rollout.temperature=0.0",
    )

    async def body(m: RolloutManager) -> Any:
        stats = await m.run_step(0)
        batch = sorted(m.buffer.get_batch(10), key=lambda g: g[0].group_id)  # the buffer keeps finish order
        direct = [
            await greedy(servers.engine_urls[i % 2], g[0].tokens[: g[0].prompt_length], 8) for i, g in enumerate(batch)
        ]
        return stats, batch, direct, m

    stats, batch, direct, m = run_manager(cfg, servers.router_url, math_plugin.rollout, body)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert [[(s.group_id, s.index, s.metadata["row_id"]) for s in g] for g in batch] == [
        [(0, i, 0) for i in range(3)],
        [(1, i, 1) for i in range(3)],
    ]
    for group, (ids, logprobs) in zip(batch, direct):
        for s in group:
            s.check()
            assert s.tokens[: s.prompt_length] == ModelFormat(tok).chat().prompt_ids(
                [{"role": "user", "content": s.prompt[0]["content"]}]
            )
            assert s.response_ids == ids and s.loss_mask == [1] * len(ids)
            assert s.rollout_logprobs == pytest.approx(logprobs, abs=1e-4)
            assert s.weight_versions == [0] and s.reward == 0.0
            assert s.status == (SampleStatus.TRUNCATED if len(ids) == 8 else SampleStatus.COMPLETED)
    assert stats["groups_kept"] == 2 and stats["completed"] + stats["truncated"] == 6
    assert stats["prompts_taken"] == 2 and accounted(m) and stats["samples_per_s"] > 0


def test_math_reward_scores_the_boxed_answer(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    class Ctx:
        tokenizer = tok

    def sample(text: str, label: str, **metadata: Any) -> Sample:
        s = Sample(prompt="p", label=label, tokens=[1], metadata=metadata)
        ids = tok(text)["input_ids"]
        s.append_model(ids, [0.0] * len(ids))
        return s

    assert asyncio.run(math_reward(Ctx(), sample("so \\boxed{ 42 }", "42"))) == 1.0
    assert asyncio.run(math_reward(Ctx(), sample("\\boxed{41}", "42"))) == 0.0
    assert asyncio.run(math_reward(Ctx(), sample("\\boxed{1 2 3}", "1 2 3", task="sort"))) == 1.0
    assert asyncio.run(math_reward(Ctx(), sample("1 2 3", "1 2 3", task="sort"))) == 0.0  # format is part of the task


async def raise_on_row_3(ctx, sample):
    if sample.metadata["row_id"] == 3:
        raise ValueError("tool crashed on row 3")
    await ctx.generate_sample()
    sample.reward = float(sample.index)
    return sample


def test_a_raising_rollout_fn_fails_one_sample_and_the_run_goes_on(
    servers: Servers, tiny_model_dir: Path, prompts: str
) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=1",
        "rollout.rollout_batch_size=9",
        "rollout.max_new_tokens=4",
    )
    dropped: list[tuple[list[Sample], str | None]] = []

    async def body(m: RolloutManager) -> Any:
        m.on_group = lambda g, reason: dropped.append((g, reason)) if reason else None
        first = await m.run_step(0)
        second = await m.run_step(0)  # the run goes on: the next epoch's row 3 fails again
        return first, second, m

    first, second, m = run_manager(cfg, servers.router_url, raise_on_row_3, body)
    assert (first["completed"] + first["truncated"], first["failed"], first["groups_failed"], first["groups_kept"]) == (
        9,
        1,
        1,
        9,
    )
    assert first["prompts_taken"] == 10 and first["errors"][0].startswith(
        "3/0: rollout fn: ValueError: tool crashed on row 3 (at "
    )
    assert "test_rollout_manager.py" in first["errors"][0]
    (failed,), reason = dropped[0]
    at = failed.metadata.pop("error_at")  # the line in this file that raised
    assert failed.status == SampleStatus.FAILED and failed.metadata == {"row_id": 3, "epoch": 0, "dropped": reason}
    assert (
        at.startswith(f"{__file__}:")
        and "tool crashed" in Path(__file__).read_text().splitlines()[int(at.rpartition(":")[2]) - 1]
    )
    assert "tool crashed on row 3" in failed.error and reason.startswith("failed: rollout fn: ValueError")
    assert second["groups_kept"] == 9 and second["failed"] == 1 and len(m.buffer) == 18 and accounted(m)


@group_reward
async def reward_even_groups_flat(ctx, samples):
    """Even groups all score 0 (no variance: filtered); odd groups score by index."""
    return [0.0 if s.group_id % 2 == 0 else float(s.index) for s in samples]


async def short_rollout(ctx, sample):
    await ctx.generate_sample({"max_new_tokens": 2})
    return sample


@pytest.mark.parametrize("over_sampling", [1.0, 2.0])
def test_zero_variance_groups_are_dropped_and_over_sampling_fills_the_batch(
    servers: Servers, tiny_model_dir: Path, prompts: str, over_sampling: float
) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=3",
        f"rollout.over_sampling={over_sampling}",
    )

    async def body(m: RolloutManager) -> Any:
        return await m.run_step(0), m.buffer.get_batch(10), m

    stats, batch, m = run_manager(cfg, servers.router_url, short_rollout, body, reward_even_groups_flat, nonzero_std)
    assert len(batch) >= 3 and all(g[0].group_id % 2 == 1 for g in batch)
    assert [[s.reward for s in g] for g in batch] == [[0.0, 1.0]] * len(batch)
    assert stats["groups_filtered"] >= 3 and stats["filtered"] == 2 * stats["groups_filtered"]
    assert stats["filter_reasons"] == {"zero reward variance (all 2 rewards 0.0)": stats["groups_filtered"]}
    assert (
        accounted(m)
        and stats["prompts_taken"] == stats["groups_kept"] + stats["groups_filtered"] + stats["requeued_pending"]
    )


def test_a_step_that_spends_its_prompt_cap_trains_on_the_groups_that_survived(
    servers: Servers, tiny_model_dir: Path, prompts: str
) -> None:
    """A model that has solved most prompts leaves few groups with variance: a short batch, not a crash."""
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=4",
        "rollout.max_prompts_factor=1",
    )

    async def body(m: RolloutManager) -> Any:
        return await m.run_step(0), m.buffer.get_batch(10), m

    stats, batch, m = run_manager(cfg, servers.router_url, short_rollout, body, reward_even_groups_flat, nonzero_std)
    assert stats["prompts_taken"] == 4 and stats["groups_kept"] == 2 and stats["groups_short"] == 2
    assert [g[0].group_id % 2 for g in batch] == [1, 1] and accounted(m)


async def always_raises(ctx, sample):
    raise RuntimeError("no API key for the judge")


def test_a_step_that_cannot_fill_its_batch_stops_with_the_reason(
    servers: Servers, tiny_model_dir: Path, prompts: str
) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=2",
        "rollout.max_prompts_factor=2",
    )

    async def body(m: RolloutManager) -> Any:
        with pytest.raises(RolloutStalled) as info:
            await m.run_step(0)
        return str(info.value), m

    message, m = run_manager(cfg, servers.router_url, always_raises, body)
    assert (
        "took 4 prompts" in message
        and "0 groups survived: 4 failed" in message
        and "no API key for the judge" in message
    )
    assert m.counters["failed"] == 8 and accounted(m)


async def reward_raises(ctx, sample):
    raise KeyError("judge unavailable")


@group_reward
async def group_reward_short(ctx, samples):
    return [1.0]


async def reward_dict(ctx, sample):
    return {"correct": 1.0, "format": float(sample.index)}


def filter_returns_number(ctx, group):
    return 0


@pytest.mark.parametrize(
    ("reward_fn", "filter_fn", "overrides", "error"),
    [
        (reward_raises, None, [], "reward fn: KeyError: 'judge unavailable'"),
        (group_reward_short, None, [], "the group reward fn returned list [1.0]; expected a list of 2 rewards"),
        (reward_dict, None, [], "dict reward ['correct', 'format'] needs rollout.reward_key"),
        (
            reward_dict,
            None,
            ["rollout.reward_key=accuracy"],
            "rollout.reward_key 'accuracy' is not in its reward ['correct', 'format']",
        ),
        (
            reward_dict,
            filter_returns_number,
            ["rollout.reward_key=correct"],
            "filter fn: TypeError: the filter fn returned int 0",
        ),
    ],
)
def test_bad_reward_and_filter_fns_fail_the_group_with_the_error(
    servers: Servers,
    tiny_model_dir: Path,
    prompts: str,
    reward_fn: Any,
    filter_fn: Any,
    overrides: list[str],
    error: str,
) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=1",
        "rollout.max_prompts_factor=1",
        *overrides,
    )

    async def body(m: RolloutManager) -> Any:
        with pytest.raises(RolloutStalled) as info:
            await m.run_step(0)
        return str(info.value), m

    message, m = run_manager(cfg, servers.router_url, short_rollout, body, reward_fn, filter_fn)
    assert error in message and m.counters["groups_failed"] == 1 and m.counters["failed"] == 2 and accounted(m)


async def reward_raises_on_even_groups(ctx, sample):
    if sample.group_id % 2 == 0:
        raise KeyError("judge unavailable")
    return float(sample.index)


def test_a_batch_past_failed_groups_says_why_they_failed(
    servers: Servers, tiny_model_dir: Path, prompts: str, caplog
) -> None:
    """The run goes on without the failed groups, and its console says why they failed (the
    metrics only count them)."""
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=2",
        "rollout.max_prompts_factor=4",
    )

    async def body(m: RolloutManager) -> Any:
        return await m.next_batch(0)

    with caplog.at_level(logging.WARNING, logger="slimish.rollout.manager"):
        groups, metrics = run_manager(cfg, servers.router_url, short_rollout, body, reward_raises_on_even_groups)
    assert len(groups) == 2 and all(g[0].group_id % 2 == 1 for g in groups) and metrics["rollout/groups_failed"] >= 1
    said = [r.getMessage() for r in caplog.records if "groups failed" in r.getMessage()]
    assert len(said) == 1 and "reward fn: KeyError: 'judge unavailable'" in said[0], said


def test_a_batch_comes_in_the_order_its_prompts_were_taken(
    servers: Servers, tiny_model_dir: Path, prompts: str
) -> None:
    """Group 0 finishes after group 1 (its reward waits for group 1's), and the batch still
    starts with group 0: the trainer's sums follow the batch's order, so a run whose groups finish
    in another order would train to other last bits (1-2 ulp in loss, entropy, grad norm)."""
    cfg = make_cfg(tiny_model_dir, prompts, "rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=2")
    second_scored = asyncio.Event()

    async def reward_first_group_last(ctx, sample):
        if sample.group_id == 0:
            await asyncio.wait_for(second_scored.wait(), timeout=60)
        elif sample.index == 1:
            second_scored.set()
        return float(sample.index)

    async def body(m: RolloutManager) -> Any:
        groups, _ = await m.next_batch(0)
        return groups, list(m.tally.kept)

    groups, finished = run_manager(cfg, servers.router_url, short_rollout, body, reward_first_group_last)
    assert [g[0].group_id for g in finished] == [1, 0]  # the finishing order this test forces
    assert [[(s.group_id, s.index) for s in g] for g in groups] == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]


def test_dict_rewards_with_a_reward_key_are_kept(servers: Servers, tiny_model_dir: Path, prompts: str) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=1",
        "rollout.reward_key=format",
    )

    async def body(m: RolloutManager) -> Any:
        return await m.run_step(0), m.buffer.get_batch(1)

    stats, [group] = run_manager(cfg, servers.router_url, short_rollout, body, reward_dict, nonzero_std)
    assert [s.reward for s in group] == [{"correct": 1.0, "format": 0.0}, {"correct": 1.0, "format": 1.0}]
    assert stats["reward_mean"] == 0.5


LONG = {"max_new_tokens": 2000}  # the long rows' budget; the test shortens it to finish them


async def long_and_short(ctx, sample):
    """Rows 0 and 1 finish fast, the others run until the end-of-step abort cuts them off. The
    short ones first make the engines decode 32 tokens, so the long ones are surely mid-way."""
    if sample.metadata["row_id"] < 2:
        await ctx.generate(sample.tokens or ctx.prompt_ids(sample.prompt), {"max_new_tokens": 32, "ignore_eos": True})
        await ctx.generate_sample({"max_new_tokens": 2, "ignore_eos": True})
    else:
        await ctx.generate_sample({**LONG, "ignore_eos": True})
    sample.reward = 1.0
    return sample


@pytest.mark.parametrize("partial_rollout", [True, False])
def test_leftovers_are_aborted_requeued_and_partial_samples_resumed(
    servers: Servers, tiny_model_dir: Path, prompts: str, partial_rollout: bool
) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=1",
        "rollout.rollout_batch_size=2",
        "rollout.over_sampling=3",
        f"rollout.partial_rollout={partial_rollout}",
        "buffer.max_staleness=1",
    )

    async def first_step(m: RolloutManager) -> Any:
        stats = await m.run_step(0)
        assert len(m.buffer.get_batch(10)) == 2  # the step trains on them; the rest is saved
        return stats, json.loads(json.dumps(m.state_dict())), m

    stats, state, m = run_manager(cfg, servers.router_url, long_and_short, first_step)
    assert (stats["groups_kept"], stats["aborted"], stats["requeued"], stats["requeued_pending"]) == (2, 4, 4, 4)
    assert stats["prompts_taken"] == 6 and accounted(m)
    partial = {p["group_id"]: p["partial"] for p in state["requeued"]}
    assert sorted(partial) == [2, 3, 4, 5]
    if not partial_rollout:
        assert all(not p for p in partial.values())
    else:
        # Kept: every cut-off sample that had tokens (the short rows' warm-up makes that all of
        # them unless an engine was starved of CPU), pending, to be continued.
        assert sum(len(p) for p in partial.values()) >= 1
        assert all(p[0]["status"] == "pending" and 0 < p[0]["response_length"] < 2000 for p in partial.values() if p)

    # A new process resumes from the saved state: the requeued prompts come first and, with
    # partial rollout, continue from their kept tokens up to the (now reachable) budget.
    longest = max((p[0]["response_length"] for p in partial.values() if p), default=0)
    LONG["max_new_tokens"] = longest + 6
    cfg.rollout.rollout_batch_size, cfg.rollout.over_sampling = 4, 1.0

    async def second_step(m: RolloutManager) -> Any:
        m.load_state_dict(state)
        return await m.run_step(0), m.buffer.get_batch(10), m

    try:
        stats, batch, m = run_manager(cfg, servers.router_url, long_and_short, second_step)
    finally:
        LONG["max_new_tokens"] = 2000
    assert sorted(g[0].group_id for g in batch) == [2, 3, 4, 5] and stats["prompts_taken"] == 0 and accounted(m)
    assert m.counters["prompts_taken"] == 6 and m.counters["groups_kept"] == 6 and m.next_group_id == 6
    for (s,) in batch:
        s.check()
        assert s.response_length == longest + 6 and s.status == SampleStatus.TRUNCATED
        if partial_rollout:
            kept = Sample.from_dict(partial[s.group_id][0])
            assert (
                s.tokens[: len(kept.tokens)] == kept.tokens
                and s.rollout_logprobs[: kept.response_length] == kept.rollout_logprobs
            )
    assert stats["partial_resumed"] == sum(len(p) for p in partial.values())


def test_async_production_runs_ahead_by_the_staleness_bound(
    servers: Servers, tiny_model_dir: Path, prompts: str
) -> None:
    """`produce` starts groups only while the buffer owes the trainer at most 1 + max_staleness
    batches: with bound 1 and no push, exactly two batches' prompts are taken; a push (the
    engines' version and `weights_pushed`) releases one more batch, made by the new version."""
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=2",
        "buffer.max_staleness=1",
        "async_training=true",
    )

    async def set_engines_version(version: str) -> None:
        for url in servers.engine_urls:
            async with Client(url) as client:
                assert (await client.update_weight_version(version)).success

    async def body(m: RolloutManager) -> Any:
        await m.start(0)
        try:
            first, _ = await m.next_batch(0)
            second, metrics = await m.next_batch(0)
            taken_before_push = m.counters["prompts_taken"], len(m._inflight)
            await set_engines_version("1")
            await m.weights_pushed(1)
            third, _ = await m.next_batch(1)
        finally:
            await m.stop()
            await set_engines_version(DEFAULT_WEIGHT_VERSION)
        return first, second, third, metrics, taken_before_push, m

    first, second, third, metrics, taken_before_push, m = run_manager(
        cfg, servers.router_url, math_plugin.rollout, body
    )
    assert taken_before_push == (4, 0)
    assert sorted(g[0].group_id for g in first + second) == [0, 1, 2, 3]  # groups finish in any order
    assert {v for g in first + second for s in g for v in s.weight_versions} == {0}  # the engines' "default"
    assert sorted(g[0].group_id for g in third) == [4, 5] and {
        v for g in third for s in g for v in s.weight_versions
    } == {1}
    assert 0.0 <= metrics["rollout/engine_idle_fraction"] <= 1.0 and metrics["rollout/staleness_max"] == 0
    assert accounted(m) and m.counters["prompts_taken"] == 6 + len(m.requeued)


async def set_versions(urls: list[str], version: str) -> None:
    for url in urls:
        async with Client(url) as client:
            assert (await client.update_weight_version(version)).success


def test_a_sync_step_rolls_out_again_for_the_groups_too_stale_to_train(
    servers: Servers, tiny_model_dir: Path, prompts: str
) -> None:
    """Sync mode, the trainer at version 1 while the engines still serve "default" (0): both of
    the step's groups are too stale and dropped. The step rolls out again for them, and once the
    engines serve 1 (set when the first round's last sample is done, before the second round
    starts) the batch is full, of fresh groups only, instead of empty."""
    cfg = make_cfg(tiny_model_dir, prompts, "rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=2")
    first_round = []

    async def catching_up(ctx, sample):
        done = await math_plugin.rollout(ctx, sample)
        if sample.group_id < 2:
            first_round.append(sample)
            if len(first_round) == 4:  # nothing is generating now: the second round starts after this
                await set_versions(servers.engine_urls, "1")
        return done

    async def body(m: RolloutManager) -> Any:
        try:
            return await m.next_batch(1), m
        finally:
            await set_versions(servers.engine_urls, DEFAULT_WEIGHT_VERSION)

    (groups, metrics), m = run_manager(cfg, servers.router_url, catching_up, body)
    assert [[(s.group_id, s.weight_versions[0]) for s in g] for g in groups] == [[(2, 1), (2, 1)], [(3, 1), (3, 1)]]
    assert m.buffer.dropped_stale == 2 and metrics["rollout/groups_kept"] == 4 and metrics["rollout/groups_short"] == 0


def test_a_sync_step_whose_engines_keep_serving_old_weights_fails_naming_them(
    servers: Servers, tiny_model_dir: Path, prompts: str
) -> None:
    """An engine that never got the trainer's weights makes every group too stale, every round:
    after a bounded number of rounds the step fails naming each engine's weight version, and
    no empty batch reaches the trainer."""
    cfg = make_cfg(tiny_model_dir, prompts, "rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=2")

    async def body(m: RolloutManager) -> Any:
        with pytest.raises(RolloutStalled) as failed:
            await m.next_batch(1)
        return failed.value, m

    error, m = run_manager(cfg, servers.router_url, math_plugin.rollout, body)
    assert "too stale for the trainer at version 1" in str(error), error
    assert all(f"{url}: default" in str(error) for url in servers.engine_urls), error
    assert m.buffer.dropped_stale == m.counters["groups_kept"] >= 4 and not m.buffer.groups


async def record_temperature(ctx, sample):
    await ctx.generate_sample()
    sample.metadata["temperature"] = ctx.sampling_params["temperature"]
    return sample


def test_evaluate_uses_the_eval_temperature(servers: Servers, tiny_model_dir: Path, prompts: str) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        "task:add",
        "data.task_size=20",
        "eval.source=task:add",
        "eval.n_samples_per_prompt=2",
        "eval.n_prompts=3",
    )
    seen: list[Sample] = []

    async def judge(ctx, sample):
        seen.append(sample)
        return 1.0 if sample.index == 0 else 0.0

    async def body(m: RolloutManager) -> Any:
        (only,) = eval_sets(cfg, m.fns.rollout_fn, m.fns.reward_fn)
        return await m.evaluate(only), m

    result, m = run_manager(cfg, servers.router_url, record_temperature, body, judge)
    assert (
        result["eval/samples"] == 6
        and result["eval/failed"] == 0
        and result["eval/reward"] == 0.5
        and result["eval/accuracy"] == 0.5
    )
    assert (result["eval/pass@1"], result["eval/pass@2"], result["eval/mean@2"]) == (
        0.5,
        1.0,
        0.5,
    )  # one of two right per prompt
    assert 0 < result["eval/response_length"] <= 8
    assert {s.metadata["temperature"] for s in seen} == {0.0} and all(s.metadata["eval"] for s in seen)
    by_row = {}
    for s in seen:  # greedy: both samples of a prompt are the same tokens
        by_row.setdefault(s.group_id, []).append(s.tokens)
    assert all(a == b for a, b in by_row.values())
    assert m.counters["prompts_taken"] == 0 and len(m.buffer) == 0  # evaluation never touches training state


def test_rollout_cli_writes_every_sample(servers: Servers, tiny_model_dir: Path, prompts: str, tmp_path: Path) -> None:
    out = tmp_path / "samples.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimish.cli",
            "rollout",
            "--rollout-fn",
            "rollout_plugins/math.py:rollout",
            "--steps",
            "2",
            "--out",
            str(out),
            f"model={tiny_model_dir}",
            f"data.source={prompts}",
            f"launch.router_url={servers.router_url}",
            "rollout.filter_fn=null",
            "rollout.n_samples_per_prompt=2",
            "rollout.rollout_batch_size=2",
            "rollout.max_new_tokens=4",
            f"run_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = [Sample.from_dict(json.loads(line)) for line in out.read_text().splitlines()]
    assert sorted((s.group_id, s.index) for s in samples) == [
        (g, i) for g in range(4) for i in range(2)
    ]  # in finish order
    assert all(s.response_length and s.reward == 0.0 and s.weight_versions == [0] for s in samples)
    assert "step 2: 2 groups kept" in proc.stderr


def test_the_engine_idle_fraction_is_read_at_the_instant_given() -> None:
    """The async test above once read `rollout/engine_idle_fraction` 1.27 in CI: the batch was
    ready at once, so the interval since the last read was short, and the idle clock counted up
    to the moment it was called rather than to the read's instant. Here a read comes 50 ms after
    its instant, 1 ms after the previous one, nothing in flight: exactly idle, not 50x."""
    from slimish.rollout.pipeline import IdleClock

    clock = IdleClock()
    first = time.perf_counter()
    clock.fraction_since_last(first)
    now = first + 0.001
    while time.perf_counter() < now + 0.05:  # the read is late, as on a loaded machine
        pass
    assert clock.fraction_since_last(now) == pytest.approx(1.0)
