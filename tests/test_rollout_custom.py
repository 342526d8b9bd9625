"""Rollout customization as a slime user ports it: plugin settings (`rollout.args`), hand-built
multi-turn samples under partial rollout, stop strings kept in text, routing keys, fan-out
siblings, the sample / reward-post / filter hooks, dict rewards with non-numeric values,
`keep_when_insufficient`, a run stopped by a failure that repeats, evaluation on two datasets.

Two real built-in engines behind the real router, as a run starts them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from helpers import accounted, make_cfg, run_manager, serving

from slimish.launch.local import Servers
from slimish.protocol import ROUTING_KEY_HEADER
from slimish.rollout.api import resumable
from slimish.rollout.config import EvalDataset
from slimish.rollout.evaluation import eval_sets, pass_at_k
from slimish.rollout.manager import RolloutManager
from slimish.rollout.stats import RolloutStalled
from slimish.types import Sample, SampleStatus

# ---- hand-built multi-turn samples under partial rollout -----------------------------------


async def search_like(ctx, sample: Sample) -> Sample:
    """A Search-R1 port: it renders the prompt itself (every call, as ported code does), then
    alternates model turns and observations with `ctx.generate` / `append_model` / `append_env`."""
    sample.set_prompt(ctx.prompt_ids(sample.prompt))
    turns = []
    for turn in range(1 + sample.group_id % 3 * ctx.args["more_turns"]):  # 1, 3 or 5 turns: the long ones get cut off
        result = await ctx.generate(sample.tokens, {"max_new_tokens": ctx.args["turn_tokens"], "ignore_eos": True})
        turns.append([len(sample.tokens), result.output_ids, []])
        ctx.append_model(result)
        if result.finish_reason == "abort":
            return sample
        turns[-1][2] = ctx.tokenizer.encode(f" <obs>{turn}</obs> ", add_special_tokens=False)
        ctx.append_env(turns[-1][2])
    sample.metadata["turns"] = turns
    sample.reward = float(sample.index % 2)
    return sample


def chains(s: Sample) -> bool:
    """Each turn's ids follow the ones before it: the model's (mask 1), then the observation's (0)."""
    at, mask = s.prompt_length, []
    for start, out, obs in s.metadata["turns"]:
        if (
            start != at
            or s.tokens[at : at + len(out)] != out
            or s.tokens[at + len(out) : at + len(out) + len(obs)] != obs
        ):
            return False
        at += len(out) + len(obs)
        mask += [1] * len(out) + [0] * len(obs)
    return at == len(s.tokens) and mask == s.loss_mask


def test_partial_rollout_restarts_hand_built_turns(servers: Servers, tiny_model_dir: Path, prompts: str) -> None:
    """Before: an aborted hand-built sample was handed back to the function half-built, and its
    `set_prompt` failed it ("set_prompt after N response tokens"). Now it restarts from its prompt."""
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=1",
        "rollout.over_sampling=4",
        "rollout.partial_rollout=true",
        "buffer.max_staleness=1",
        "rollout.max_new_tokens=64",
        "rollout.args.more_turns=2",
        "rollout.args.turn_tokens=5",
    )

    async def body(m: RolloutManager) -> Any:
        batches, aborted = [], 0
        for _ in range(4):
            stats = await m.run_step(0)
            aborted += stats["aborted"]
            batches += m.buffer.get_batch(len(m.buffer))
        return batches, aborted, m

    batches, aborted, m = run_manager(cfg, servers.router_url, search_like, body)
    assert aborted > 0 and m.counters["failed"] == 0 and m.counters["groups_failed"] == 0 and accounted(m)
    samples = [s for g in batches for s in g]
    assert len(samples) >= 8 and all(s.status == SampleStatus.TRUNCATED and chains(s) for s in samples)
    assert all(len(s.metadata["turns"]) == 1 + s.group_id % 3 * 2 for s in samples)


@resumable
async def search_like_resuming(ctx, sample: Sample) -> Sample:
    """The same port, written to continue a sample it is handed back (and marked so)."""
    if not sample.tokens:
        sample.set_prompt(ctx.prompt_ids(sample.prompt))
    turns = sample.metadata.setdefault("turns", [])
    if turns and len(turns[-1][1]) < ctx.args["turn_tokens"]:
        turns.pop()  # cut off mid-turn: that turn's tokens stay, the turn is redone after them
    while len(turns) < 1 + sample.group_id % 3 * ctx.args["more_turns"]:
        at = len(sample.tokens)
        result = await ctx.generate(sample.tokens, {"max_new_tokens": ctx.args["turn_tokens"], "ignore_eos": True})
        ctx.append_model(result)
        if result.finish_reason == "abort":
            turns.append([at, result.output_ids, []])
            return sample
        obs = ctx.tokenizer.encode(f" <obs>{len(turns)}</obs> ", add_special_tokens=False)
        ctx.append_env(obs)
        turns.append([at, result.output_ids, obs])
    sample.reward = float(sample.index % 2)
    return sample


def test_a_resumable_plugin_gets_its_partial_samples_back(servers: Servers, tiny_model_dir: Path, prompts: str) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=1",
        "rollout.over_sampling=4",
        "rollout.partial_rollout=true",
        "buffer.max_staleness=1",
        "rollout.max_new_tokens=64",
        "rollout.args.more_turns=2",
        "rollout.args.turn_tokens=5",
    )

    async def body(m: RolloutManager) -> Any:
        batches = []
        for _ in range(4):
            await m.run_step(0)
            batches += m.buffer.get_batch(len(m.buffer))
        return batches, m

    batches, m = run_manager(cfg, servers.router_url, search_like_resuming, body)
    assert m.counters["partial_resumed"] > 0 and m.counters["failed"] == 0 and accounted(m)
    samples = [s for g in batches for s in g]
    assert len(samples) >= 8 and all(s.status == SampleStatus.TRUNCATED for s in samples)
    assert all(
        len(s.metadata["turns"]) == 1 + s.group_id % 3 * 2
        and s.prompt_length + sum(len(o) + len(e) for _, o, e in s.metadata["turns"]) <= len(s.tokens)
        for s in samples
    )


# ---- text, routing, siblings ------------------------------------------------------------------


def test_a_matched_stop_string_stays_in_the_text(servers: Servers, tiny_model_dir: Path, prompts: str) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=1",
        "rollout.rollout_batch_size=1",
        "rollout.temperature=0.0",
        "rollout.max_new_tokens=12",
    )
    found: dict[str, Any] = {}

    async def rollout(ctx, sample):
        ids = ctx.prompt_ids(sample.prompt)
        free = await ctx.generate(ids, {"ignore_eos": True})
        assert len(free.text) >= 8
        found["stop"] = stop = free.text[len(free.text) // 2 :][:3]  # text the model writes mid-answer
        stopped = await ctx.generate(ids, {"ignore_eos": True, "stop": [stop]})
        trimmed = await ctx.client.generate(
            input_ids=ids, sampling_params={**ctx.sampling_params, "ignore_eos": True, "stop": [stop]}
        )
        found["texts"] = free.text, stopped.text, stopped.finish_reason, trimmed.text
        sample.set_prompt(ids)
        ctx.append_model(stopped)
        sample.reward = 0.0
        return sample

    async def body(m: RolloutManager) -> Any:
        await m.run_step(0)
        return m.buffer.get_batch(1)[0][0], m

    sample, m = run_manager(cfg, servers.router_url, rollout, body)
    free, stopped, reason, trimmed = found["texts"]
    stop = found["stop"]
    assert (
        reason == "stop" and stop in stopped and free.startswith(stopped)
    )  # up to the token that completed the stop string
    assert stop not in trimmed and stopped.startswith(trimmed)  # what SGLang sends by default: cut at the match
    assert sample.response == m.runtime.tokenizer.decode(sample.response_ids) and sample.response == stopped


@pytest.fixture(scope="module")
def recording(servers: Servers) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A pass-through in front of the router that records each /generate request's headers."""
    seen: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        seen.append({"key": request.headers.get(ROUTING_KEY_HEADER), "prompt_tokens": len(body["input_ids"])})
        async with httpx.AsyncClient(timeout=60) as client:
            return (await client.post(servers.router_url + "/generate", json=body)).json()

    with serving(app, "recording proxy") as url:
        yield url, seen


async def planner_and_worker(ctx, sample):
    await ctx.chat(sample.prompt, sampling_params={"max_new_tokens": 3})
    worker = ctx.new_sample(prompt=[{"role": "user", "content": "Check it."}])
    turn = await worker.chat(worker.sample.prompt, sampling_params={"max_new_tokens": 3})
    await worker.chat(
        [*worker.sample.prompt, turn.message, {"role": "user", "content": "Sure?"}],
        sampling_params={"max_new_tokens": 3},
    )
    for s in (sample, worker.sample):
        s.reward = float(sample.index)
    return [sample, worker.sample]


def test_each_conversation_sends_one_routing_key_and_siblings_share_a_trajectory(
    recording: tuple[str, list], tiny_model_dir: Path, prompts: str
) -> None:
    url, seen = recording
    cfg = make_cfg(tiny_model_dir, prompts, "rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=2")

    async def body(m: RolloutManager) -> Any:
        await m.run_step(0)
        return m.buffer.get_batch(2)

    groups = run_manager(cfg, url, planner_and_worker, body)
    keys = [r["key"] for r in seen]
    assert len(seen) == 12 and None not in keys and len(set(keys)) == 8  # 4 planners (1 call), 4 workers (2 calls)
    assert sorted(keys.count(k) for k in set(keys)) == [1] * 4 + [2] * 4
    for group in groups:
        assert (
            len(group) == 4 and len({s.trajectory_id for s in group}) == 2
        )  # planner + its worker: one trajectory each


# ---- hooks and rewards ------------------------------------------------------------------------


async def answer(ctx, sample):
    await ctx.generate_sample()
    return sample


async def judged(ctx, sample):
    """slime's reward shape: a score, a flag and the parsed answer."""
    return {"score": float(sample.index % 2), "acc": sample.index % 2 == 1, "pred": sample.response[-3:]}


async def mark(ctx, sample):
    sample.metadata["hooked"] = len(sample.response)
    sample.exclude_from_loss = sample.index == 0


def halve(ctx, group):
    return [{**s.reward, "score": s.reward["score"] / 2} for s in group]


def keep_with_setting(ctx, group):
    return None if ctx.args["keep"] else "setting says drop"


def test_hooks_see_ctx_and_dict_rewards_keep_their_text(servers: Servers, tiny_model_dir: Path, prompts: str) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=2",
        "rollout.reward_key=score",
        "rollout.args.keep=true",
    )

    async def body(m: RolloutManager) -> Any:
        stats = await m.run_step(0)
        return stats, m.buffer.get_batch(2), m

    stats, groups, m = run_manager(
        cfg, servers.router_url, answer, body, judged, keep_with_setting, sample_hook=mark, reward_post=halve
    )
    samples = [s for g in groups for s in g]
    assert len(samples) == 4 and stats["failed"] == 0 and accounted(m)
    for s in samples:
        assert s.response == m.runtime.tokenizer.decode(s.response_ids) and s.metadata["hooked"] == len(s.response)
        assert s.reward == {"score": 0.5 * (s.index % 2), "acc": s.index % 2 == 1, "pred": s.response[-3:]}
        assert s.metadata["raw_reward"]["score"] == float(s.index % 2) and s.exclude_from_loss == (s.index == 0)
        assert s.train_mask == ([0] * s.response_length if s.index == 0 else s.loss_mask)
    assert stats["reward_mean"] == 0.25
    json.dumps([s.to_dict() for s in samples])  # everything a sample carries is saved as JSON

    cfg.rollout.reward_key = "pred"  # a string: named as such, every group failed with the reason

    async def fails(m: RolloutManager) -> Any:
        with pytest.raises(
            RolloutStalled, match=r"rollout.reward_key 'pred' names a str .*numeric keys: \['acc', 'score'\]"
        ):
            await m.run_step(0)

    cfg.rollout.max_prompts_factor = 1.0
    run_manager(cfg, servers.router_url, answer, fails, judged)


def drop_all(ctx, group):
    return "never enough"


def test_keep_when_insufficient_fills_the_batch_with_filtered_groups(
    servers: Servers, tiny_model_dir: Path, prompts: str
) -> None:
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=2",
        "rollout.max_prompts_factor=2",
        "rollout.reward_key=score",
        "rollout.keep_when_insufficient=true",
    )
    recorded: list[tuple[int, str | None]] = []

    async def body(m: RolloutManager) -> Any:
        m.on_group = lambda group, dropped: recorded.append((group[0].group_id, dropped))
        stats = await m.run_step(0)
        return stats, m.buffer.get_batch(2), m

    stats, groups, m = run_manager(cfg, servers.router_url, answer, body, judged, drop_all)
    assert (
        stats["groups_refilled"] == 2
        and stats["groups_kept"] == 2
        and stats["groups_filtered"] == 2
        and stats["groups_short"] == 0
    )
    assert stats["filter_reasons"] == {"never enough": 2} and accounted(m) and m.counters["prompts_taken"] == 4
    assert all(s.metadata["refilled"] == "never enough" and "dropped" not in s.metadata for g in groups for s in g)
    assert sorted(gid for gid, dropped in recorded if dropped is None) == sorted(g[0].group_id for g in groups)

    cfg.rollout.keep_when_insufficient = False

    async def stalls(m: RolloutManager) -> Any:
        with pytest.raises(RolloutStalled, match="never enough"):
            await m.run_step(0)

    run_manager(cfg, servers.router_url, answer, stalls, judged, drop_all)


# ---- overlong handling (DAPO) -------------------------------------------------------------


async def lengths_by_index(ctx, sample: Sample) -> Sample:
    """Responses of exactly 3, 5, 7 and 8 (= rollout.max_new_tokens) tokens; the shorter ones
    stand for responses that ended by themselves. Every one is right (reward 1)."""
    n = (3, 5, 7, 8)[sample.index]
    sample.set_prompt(ctx.prompt_ids(sample.prompt))
    ctx.append_model(await ctx.generate(sample.tokens, {"max_new_tokens": n, "ignore_eos": True}))
    if n < 8:
        sample.status = SampleStatus.COMPLETED
    sample.reward = 1.0
    return sample


def test_overlong_penalty_and_filter_shape_a_group_before_its_filter(
    servers: Servers, tiny_model_dir: Path, prompts: str
) -> None:
    """Soft penalty over the last 4 of 8 tokens: 0, -0.25, -0.75, -1; the truncated sample is out
    of the loss but in the baseline; the group, uniform in raw reward, survives `nonzero_std`."""
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "rollout.n_samples_per_prompt=4",
        "rollout.rollout_batch_size=1",
        "rollout.overlong_buffer=4",
        "rollout.overlong_filter=true",
    )

    async def body(m: RolloutManager) -> Any:
        stats = await m.run_step(0)
        return stats, m.buffer.get_batch(1)[0]

    from slimish.rollout.filters import nonzero_std

    stats, group = run_manager(cfg, servers.router_url, lengths_by_index, body, filter_fn=nonzero_std)
    assert [s.response_length for s in group] == [3, 5, 7, 8] and stats["groups_filtered"] == 0
    assert [s.reward for s in group] == [1.0, 0.75, 0.25, 0.0]
    assert [s.metadata["overlong_penalty"] for s in group] == [0.0, -0.25, -0.75, -1.0]
    assert [s.exclude_from_loss for s in group] == [False, False, False, True] and sum(group[3].train_mask) == 0
    assert stats["truncated_fraction"] == 0.25


def test_overlong_penalty_falls_linearly_over_the_buffer() -> None:
    from slimish.rollout.rewards import overlong_penalty

    assert [overlong_penalty(n, 8, 4) for n in (1, 4, 5, 6, 7, 8, 20)] == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(7, 8, 4, penalty=0.5) == -0.375 and overlong_penalty(8, 8, 0) == 0.0
    with pytest.raises(SystemExit, match=r"rollout.overlong_buffer \(9\) must be at most .* 8"):
        make_cfg(Path("m"), "task:max_digit", "rollout.overlong_buffer=9")


BROKEN = """
async def reward(ctx, sample):
    scores = {"a": 1.0}
    return scores[sample.label]  # the label is never "a"
"""


def test_a_reward_that_always_raises_stops_the_run_naming_its_line(
    servers: Servers, tiny_model_dir: Path, prompts: str, tmp_path: Path
) -> None:
    (tmp_path / "broken.py").write_text(BROKEN)
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
            "--reward-fn",
            f"{tmp_path / 'broken.py'}:reward",
            "--out",
            str(out),
            f"model={tiny_model_dir}",
            f"data.source={prompts}",
            f"launch.router_url={servers.router_url}",
            "rollout.n_samples_per_prompt=2",
            "rollout.rollout_batch_size=2",
            "rollout.max_new_tokens=4",
            "rollout.max_consecutive_failures=3",
            "rollout.max_concurrency=2",
            f"run_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert (
        "3 groups in a row failed the same way (rollout.max_consecutive_failures=3): reward fn: KeyError" in proc.stderr
    )
    assert f"(at {tmp_path / 'broken.py'}:4)" in proc.stderr, proc.stderr[-2000:]


# ---- evaluation -------------------------------------------------------------------------------

JUDGES = """
async def first_right(ctx, sample):
    return 1.0 if sample.index == 0 else 0.0

async def by_temperature(ctx, sample):
    return float(sample.metadata["temperature"] > 0)

async def record_temperature(ctx, sample):
    await ctx.generate_sample()
    sample.metadata["temperature"] = ctx.sampling_params["temperature"]
    sample.metadata["max_new_tokens"] = ctx.sampling_params["max_new_tokens"]
    return sample
"""


def test_two_eval_datasets_report_pass_at_k_and_mean_at_k(
    servers: Servers, tiny_model_dir: Path, prompts: str, tmp_path: Path
) -> None:
    judges = tmp_path / "judges.py"
    judges.write_text(JUDGES)
    cfg = make_cfg(
        tiny_model_dir,
        prompts,
        "data.task_size=20",
        "eval.source=task:add",
        "eval.n_prompts=3",
        "eval.n_samples_per_prompt=2",
    )
    cfg.eval.datasets = [
        EvalDataset(name=n, **kw)
        for n, kw in (
            (
                "add4",
                {"source": "task:add", "n_samples_per_prompt": 4, "n_prompts": 2, "reward_fn": f"{judges}:first_right"},
            ),
            (
                "hot",
                {
                    "source": prompts,
                    "temperature": 1.0,
                    "max_new_tokens": 3,
                    "reward_fn": f"{judges}:by_temperature",
                    "rollout_fn": f"{judges}:record_temperature",
                },
            ),
        )
    ]

    async def body(m: RolloutManager) -> Any:
        metrics: dict[str, float] = {}
        for eval_set in eval_sets(cfg, m.fns.rollout_fn, m.fns.reward_fn):
            metrics.update(await m.evaluate(eval_set))
        return metrics

    async def none_right(ctx, sample):
        return 0.0

    from rollout_plugins import math as math_plugin

    metrics = run_manager(cfg, servers.router_url, math_plugin.rollout, body, none_right)
    assert (
        metrics["eval/samples"] == 6
        and metrics["eval/pass@1"] == metrics["eval/pass@2"] == metrics["eval/mean@2"] == 0.0
    )
    # add4: one right of 4 per prompt
    assert (metrics["eval/add4/samples"], metrics["eval/add4/accuracy"], metrics["eval/add4/mean@4"]) == (
        8.0,
        0.25,
        0.25,
    )
    assert (metrics["eval/add4/pass@1"], metrics["eval/add4/pass@2"], metrics["eval/add4/pass@4"]) == (0.25, 0.5, 1.0)
    # hot: its own rollout fn, sampled at its temperature: every sample right
    assert metrics["eval/hot/samples"] == 6.0 and metrics["eval/hot/pass@1"] == metrics["eval/hot/mean@2"] == 1.0
    assert 0 < metrics["eval/hot/response_length"] <= 3


def test_pass_at_k_is_the_chance_a_draw_of_k_holds_a_right_one() -> None:
    from itertools import combinations

    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                draws = list(combinations([1] * c + [0] * (n - c), k))
                assert abs(pass_at_k(n, c, k) - sum(any(d) for d in draws) / len(draws)) < 1e-12


# ---- fan-out through `slimish train` ----------------------------------------------------------


@pytest.mark.slow
def test_a_fan_out_plugin_trains_with_per_trajectory_reduction(
    tiny_model_dir: Path, prompts: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimish.train",
            "--rollout-fn",
            "rollout_plugins.fanout_agent:rollout",
            f"model={tiny_model_dir}",
            f"data.source={prompts}",
            f"run_dir={run_dir}",
            "steps=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.rollout_batch_size=2",
            "rollout.max_new_tokens=4",
            "rollout.filter_fn=null",
            "rollout.args.solvers=3",
            "algorithm.loss_reduction=trajectory",
            "eval.every=0",
            "checkpoint.every=0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2 and all(
        r["rollout/segments_per_trajectory"] == 4.0 for r in steps
    )  # a planner and 3 solvers
    assert all(r["rollout/groups_kept"] == 2 and r["rollout/failed"] == 0 for r in steps)
