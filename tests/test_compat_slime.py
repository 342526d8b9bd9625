"""slime's custom functions run unchanged (`--rollout-fn slime:...`, slimish/compat/slime/).
slime's examples and a 2-step `slimish train` on them are in tests/test_slime_examples.py.

The plugins in tests/slime_plugins/ are written as a slime user writes them (slime's signatures,
`from slime.utils.types import Sample` ...). They run through `slimish rollout` (in this
process: `slimish.cli.main`) against real engines; a fake router checks the headers, the abort
path and the retokenization counter on replies chosen to re-tokenize differently. `servers` and
`prompts` are conftest's (two engines behind the router; ten "What is i + i?" prompts).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from helpers import ROOT, rollout_once, serving
from transformers import AutoTokenizer

from slimish.client import Client
from slimish.compat import load_function
from slimish.compat.slime import adapters, calls, namespace, samples
from slimish.config import load_run_config
from slimish.launch.local import Servers
from slimish.plugins import LoadError
from slimish.rollout.api import RolloutContext, RolloutRuntime
from slimish.rollout.evaluation import eval_sets
from slimish.rollout.rewards import is_group_reward
from slimish.types import Sample, SampleStatus

PLUGINS = "tests/slime_plugins"
MAX_NEW = 6


@pytest.fixture(autouse=True)
def from_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugins' paths are relative to the repository's root, where `slimish` runs in the docs."""
    monkeypatch.chdir(ROOT)


def rendered(tok: Any, prompt: str) -> str:
    """A text prompt as slime's data loader hands it to a generate function (--apply-chat-template)."""
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def rollout_cli(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    model: Path,
    router: str,
    prompts: str,
    flags: list[str],
    *overrides: str,
) -> tuple[list[Sample], str]:
    """`rollout_once`, greedy: the samples it wrote and what it printed on stderr."""
    capsys.readouterr()
    samples = rollout_once(
        tmp_path,
        model,
        router,
        prompts,
        flags,
        f"rollout.max_new_tokens={MAX_NEW}",
        "rollout.temperature=0.0",
        *overrides,
    )
    return samples, capsys.readouterr().err


async def greedy(url: str, ids: list[int]) -> tuple[list[int], list[float]]:
    async with Client(url) as client:
        out = await client.generate(
            input_ids=ids, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0.0}, return_logprob=True
        )
    return out.output_ids, [e[0] for e in out.meta_info.output_token_logprobs]


# ---- loading ----------------------------------------------------------------------------------


def test_load_errors_name_the_flag_and_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def sync_generate(args, sample, sampling_params):\n    return sample\n\n"
        "async def two_params(args, sample):\n    return sample\n\nNOT_A_FUNCTION = 3\n"
    )
    cases = {
        ("slime:no_colon", "rollout"): "'slime:no_colon': expected `module:function`",
        (
            f"slime:{PLUGINS}/rewards.py:missing",
            "reward",
        ): "has no function 'missing'; it defines: group_rm, legacy_filter, nonzero_std, rm",
        (f"slime:{bad}:sync_generate", "rollout"): "must be an async function",
        (f"slime:{bad}:two_params", "rollout"): "write `async def two_params(args, sample, sampling_params)`",
        (f"slime:{bad}:NOT_A_FUNCTION", "rollout"): "NOT_A_FUNCTION is a int, not a function",
        ("slime:no_such_module_xyz:generate", "rollout"): "no module named 'no_such_module_xyz'",
        (f"slime:{PLUGINS}/rewards.py:rm", "sample_hook"): "drop the `slime:` prefix",
    }
    for (spec, kind), message in cases.items():
        with pytest.raises(LoadError, match=None) as err:
            load_function(spec, kind)
        assert message in str(err.value), (spec, str(err.value))
    assert not is_group_reward(load_function(f"slime:{PLUGINS}/rewards.py:rm", "reward"))
    assert is_group_reward(
        load_function(f"slime:{PLUGINS}/rewards.py:group_rm", "reward")
    )  # second parameter `samples`


def test_eval_datasets_get_slime_functions_from_the_loader_handed_down(
    tiny_model_dir: Path, prompts: str, tmp_path: Path
) -> None:
    """The rollout side never imports compat: `slimish train` hands slimish.compat's loader to
    `eval_sets`, which adapts an eval dataset's `slime:` functions; slimish.plugins' own loader
    refuses them, naming the key and the loader that reads them."""
    dataset = {
        "name": "slime",
        "source": prompts,
        "rollout_fn": f"slime:{PLUGINS}/single_turn.py:generate",
        "reward_fn": f"slime:{PLUGINS}/rewards.py:group_rm",
    }
    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps({"model": str(tiny_model_dir), "data": {"source": "task:add"}, "eval": {"datasets": [dataset]}})
    )
    cfg = load_run_config(str(config), [])

    async def rollout(ctx: Any, sample: Sample) -> Sample:
        return sample

    (only,) = eval_sets(cfg, rollout, None, load_function)
    assert only.rollout_fn.__slime_function__.__name__ == "generate" and is_group_reward(only.reward_fn)
    with pytest.raises(
        LoadError, match=r"eval\.datasets\[0\]\.rollout_fn .* adapted by slimish\.compat\.load_function"
    ):
        eval_sets(cfg, rollout, None)


def test_the_slime_namespace_appears_only_when_a_slime_spec_is_loaded() -> None:
    code = f"""
import importlib.util, sys
assert importlib.util.find_spec("slime") is None
from slimish.compat import load_function
load_function("rollout_plugins.math:rollout", "rollout")
assert importlib.util.find_spec("slime") is None
load_function("slime:{PLUGINS}/search.py:generate", "rollout")
import slime
from slime.utils.types import Sample
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.sglang_rollout import GenerateState, generate
from slime.utils.http_utils import post
assert slime.STAND_IN and [s.value for s in Sample.Status] == ["pending", "completed", "truncated", "aborted", "failed"]
s = Sample(index=1, group_index=2, prompt="p", label="l")
assert (s.tokens, s.response_length, s.loss_mask, s.rollout_log_probs, s.reward, s.status) == ([], 0, None, None, None, Sample.Status.PENDING)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_filter_answers_map_to_drop_reasons() -> None:
    namespace.use_slime_namespace()
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput

    assert adapters._drop_reason(DynamicFilterOutput(keep=True), "f") is None
    assert adapters._drop_reason(DynamicFilterOutput(keep=False, reason="zero_std_1.0"), "f") == "zero_std_1.0"
    assert adapters._drop_reason(DynamicFilterOutput(keep=False), "mine") == "slime filter mine"
    assert adapters._drop_reason(True, "f") is None and adapters._drop_reason(False, "legacy") == "slime filter legacy"


def test_replies_align_only_with_trained_tokens() -> None:
    """A reply's output found among mask-1 tokens only (an observation holding the same id is not
    it); a reply the function cut short is not matched (its tokens need their own logprobs)."""
    replies = [
        calls.Reply([1, 2], [7], [-0.5], [3], "stop"),
        calls.Reply(None, [8, 9, 9], [-0.1, -0.2, -0.3], [4, 4, 4], "length"),
    ]
    logprobs, versions = samples._match([7, 7, 8, 9], [0, 1, 1, 1], replies)
    assert logprobs == [None, -0.5, None, None] and versions == [-1, 3, -1, -1]
    tokens, length, mask, lps = samples._chain(
        "w", [calls.Reply([1, 2], [7], [-0.5], [3], "stop"), calls.Reply([1, 2, 7, 5], [6], [-0.2], [3], "stop")]
    )
    assert (tokens, length, mask, lps) == ([1, 2, 7, 5, 6], 3, [1, 0, 1], [-0.5, 0.0, -0.2])
    with pytest.raises(ValueError, match="do not extend one another"):
        samples._chain(
            "w", [calls.Reply([1, 2], [7], [-0.5], [3], "stop"), calls.Reply([1, 3], [6], [-0.2], [3], "stop")]
        )


def test_a_reply_to_reshaping_sampling_is_marked() -> None:
    """A slime function's request with reshaping sampling (here `min_new_tokens`) gets log-probs
    that are not pi_old: its reply is marked, and so is the sample copied back from it."""
    reply = {
        "output_ids": [7],
        "meta_info": {"output_token_logprobs": [[-0.5, 7, None]], "finish_reason": {"type": "stop"}},
    }
    call = calls.Call(ctx=None, record=True)
    call.observe({"input_ids": [1, 2], "sampling_params": {"temperature": 1.0}}, reply)
    call.observe({"input_ids": [1, 2, 7], "sampling_params": [{"min_new_tokens": 1}]}, reply)
    assert [r.reshaped for r in call.replies] == [False, True]


# ---- through `slimish rollout` ------------------------------------------------------------------


def test_slimes_default_generate_with_a_dict_reward_and_filter(
    servers: Servers, tiny_model_dir: Path, prompts: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """slime's own default `generate`, a dict rm with string fields and a DynamicFilterOutput
    filter: exact engine tokens and logprobs, all trained (slime sets no mask), versions."""
    samples, stderr = rollout_cli(
        capsys,
        tmp_path,
        tiny_model_dir,
        servers.router_url,
        prompts,
        [
            "--rollout-fn",
            "slime:slime.rollout.sglang_rollout:generate",
            "--reward-fn",
            f"slime:{PLUGINS}/rewards.py:rm",
            "--filter-fn",
            f"slime:{PLUGINS}/rewards.py:nonzero_std",
        ],
        "rollout.reward_key=score",
    )
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert sorted((s.group_id, s.index) for s in samples) == [(g, i) for g in range(2) for i in range(2)]
    for s in samples:
        prompt_ids = tok.encode(rendered(tok, s.prompt[0]["content"]), add_special_tokens=False)
        ids, logprobs = asyncio.run(greedy(servers.engine_urls[0], prompt_ids))
        assert s.tokens[: s.prompt_length] == prompt_ids and s.response_ids == ids
        assert s.loss_mask == [1] * len(ids) and s.rollout_logprobs == pytest.approx(logprobs, abs=1e-4)
        assert s.token_versions == [0] * len(ids) and s.weight_versions == [0]
        assert s.status == (SampleStatus.TRUNCATED if len(ids) == MAX_NEW else SampleStatus.COMPLETED)
        score = 1.0 if s.index == 0 else 0.0
        assert s.reward == {"score": score, "acc": score == 1.0, "pred": "42"}
        assert s.metadata["retokenized_mismatch"] == 0 and "dropped" not in s.metadata
    assert "step 1: 2 groups kept" in stderr


@pytest.mark.filterwarnings("ignore:a slime function re-sent text")  # counted below; warned of on the fake router
def test_a_multi_turn_search_generate_with_a_group_rm(
    servers: Servers,
    tiny_model_dir: Path,
    prompts: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Model turns mask 1 with the engine's logprobs and versions, fake retrieval observations
    mask 0; text re-sent by the function counted where it re-tokenizes differently; a group rm;
    the filter's reason on the dropped group."""
    monkeypatch.setattr(calls, "_warned", False)  # this process's once-only warning stays for the test that checks it
    samples, _ = rollout_cli(
        capsys,
        tmp_path,
        tiny_model_dir,
        servers.router_url,
        prompts,
        [
            "--rollout-fn",
            f"slime:{PLUGINS}/search.py:generate",
            "--reward-fn",
            f"slime:{PLUGINS}/rewards.py:group_rm",
            "--filter-fn",
            f"slime:{PLUGINS}/rewards.py:nonzero_std",
        ],
        "rollout.args.search_payload=alternate",
    )
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    assert sorted(by_group) == [0, 1, 2] and all(len(g) == 2 for g in by_group.values())
    for s in samples:
        turns = s.metadata["turns"]
        assert len(turns) >= 2  # the random model never answers: it is searched for at least once
        assert s.response_ids == [t for turn in turns for t in turn["output_ids"] + turn["obs_ids"]]
        assert s.loss_mask == [m for turn in turns for m in [1] * len(turn["output_ids"]) + [0] * len(turn["obs_ids"])]
        assert s.rollout_logprobs == [lp for turn in turns for lp in turn["logprobs"] + [0.0] * len(turn["obs_ids"])]
        assert s.token_versions == [
            v for turn in turns for v in [0] * len(turn["output_ids"]) + [-1] * len(turn["obs_ids"])
        ]
        assert s.tokens[: s.prompt_length] == s.metadata["prompt_ids"]
        mode = "text" if s.index % 2 else "input_ids"
        assert {turn["mode"] for turn in turns} == {mode}
        assert s.metadata["retokenized_mismatch"] == (
            expected_mismatches(tok, rendered(tok, s.prompt[0]["content"]), turns) if mode == "text" else 0
        )
    assert [s.reward for s in sorted(by_group[0], key=lambda s: s.index)] == [1.0, 0.0]
    assert all(s.reward == 0.5 and s.metadata["dropped"] == "zero_std_0.5" for s in by_group[1])
    assert all("dropped" not in s.metadata for s in by_group[0] + by_group[2])


def expected_mismatches(tok: Any, prompt: str, turns: list[dict[str, Any]]) -> int:
    """Re-sent text whose tokenization does not extend the ids the engine held after the last turn."""
    count, text, held = 0, prompt, None
    for turn in turns:
        ids = tok.encode(text)
        if held is not None and ids[: len(held)] != held[: len(ids)]:
            count += 1
        held = ids + turn["output_ids"]
        text += turn["text"] + turn["obs"]
    return count


# ---- in process: hand-written generate functions ------------------------------------------------


def run_slime(
    spec: str, cfg_overrides: list[str], router: str, model: Path, samples: list[Sample], **ctx_kw: Any
) -> list[Any]:
    cfg = load_run_config(
        None, [f"model={model}", "data.source=task:add", f"rollout.max_new_tokens={MAX_NEW}", *cfg_overrides]
    )
    fn = load_function(spec, "rollout")

    async def main() -> list[Any]:
        runtime = await RolloutRuntime.create(cfg, router)
        try:
            return [await fn(RolloutContext(runtime, s, **ctx_kw), s) for s in samples]
        finally:
            await runtime.close()

    return asyncio.run(main())


def test_hand_written_single_turn_generates(servers: Servers, tiny_model_dir: Path) -> None:
    """One that keeps tokens and logprobs but no mask (all ones, slime's default), and one that
    keeps nothing at all (rebuilt from the recorded reply; status from its finish reason)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "What is 4 + 4?"}]
    kept = Sample(prompt=messages, label="8", group_id=3, index=1)
    (out,) = run_slime(
        f"slime:{PLUGINS}/single_turn.py:generate",
        ["rollout.temperature=0.0"],
        servers.router_url,
        tiny_model_dir,
        [kept],
    )
    assert out is kept and out.metadata["prompt_ids"] == tok.encode(
        rendered(tok, "What is 4 + 4?"), add_special_tokens=False
    )
    ids, logprobs = asyncio.run(greedy(servers.engine_urls[0], out.metadata["prompt_ids"]))
    assert out.response_ids == ids and out.loss_mask == [1] * len(ids)
    assert out.rollout_logprobs == out.metadata["engine_logprobs"] == pytest.approx(logprobs, abs=1e-4)
    assert out.token_versions == [0] * len(ids) and out.status in (SampleStatus.TRUNCATED, SampleStatus.COMPLETED)

    bare = Sample(prompt="Largest digit: 1 2 3", label="3", metadata={"eval": True})
    (out,) = run_slime(
        f"slime:{PLUGINS}/single_turn.py:generate_minimal",
        ["rollout.temperature=0.0"],
        servers.router_url,
        tiny_model_dir,
        [bare],
    )
    assert out.tokens == out.metadata["engine_prompt_ids"] + out.metadata["engine_output_ids"]
    assert (
        out.response_length == len(out.metadata["engine_output_ids"]) > 0 and out.loss_mask == [1] * out.response_length
    )
    ids, logprobs = asyncio.run(greedy(servers.engine_urls[0], out.metadata["engine_prompt_ids"]))
    assert out.response_ids == ids and out.rollout_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert out.status == (SampleStatus.TRUNCATED if len(ids) == MAX_NEW else SampleStatus.COMPLETED)
    assert out.metadata["evaluation"] is True  # `evaluation=` passed where the function takes it


# ---- a fake router: headers, abort, retokenization, versions ---------------------------------


def split_token(tok: Any) -> tuple[str, list[int]]:
    """A text the tokenizer writes as one token, and the ids of its characters one by one: model
    output ids that re-tokenize differently once sent back as text."""
    for token_id in range(len(tok)):
        text = tok.decode([token_id])
        if len(text) >= 2 and text.isalpha() and tok.encode(text, add_special_tokens=False) == [token_id]:
            parts = [tok.encode(c, add_special_tokens=False) for c in text]
            if all(len(p) == 1 for p in parts):
                return text, [p[0] for p in parts]
    raise AssertionError("no mergeable token in the vocabulary")


def fake_router(tok: Any, output_ids: list[int], seen: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append({"body": body, "headers": dict(request.headers)})
        prompt = tok.encode(body["text"]) if "text" in body else body["input_ids"]
        meta = {
            "id": f"r{len(seen)}",
            "finish_reason": {"type": "length"},
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output_ids),
            "weight_version": "7",
            "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(output_ids)],
        }
        return {"text": tok.decode(output_ids), "output_ids": output_ids, "meta_info": meta}

    return app


def test_headers_versions_retokenization_and_abort_on_a_fake_router(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    merged, output_ids = split_token(tok)
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(calls, "_warned", False)
    overrides = ["launch.api_key=sekret", "rollout.args.search_payload=text", "rollout.args.my_flag=3"]
    with serving(fake_router(tok, output_ids, seen), "fake router") as url:
        sample = Sample(prompt="hello", label=None, group_id=5, index=0)
        with pytest.warns(RuntimeWarning, match="re-sent text"):
            (out,) = run_slime(
                f"slime:{PLUGINS}/search.py:generate", overrides, url, tiny_model_dir, [sample], routing_key="rk-5-0"
            )
        assert len(seen) == 3  # three turns
        for call in seen:
            assert (
                call["headers"]["x-smg-routing-key"] == "rk-5-0" and call["headers"]["authorization"] == "Bearer sekret"
            )
            assert call["body"]["return_logprob"] is True and call["body"]["sampling_params"]["no_stop_trim"] is True
        # Turns 2 and 3 re-send the model's ids as text, where the engine merges them into `merged`.
        assert tok.encode(merged, add_special_tokens=False) != output_ids
        assert out.metadata["retokenized_mismatch"] == 2
        assert out.loss_mask == [
            m for t in out.metadata["turns"] for m in [1] * len(output_ids) + [0] * len(t["obs_ids"])
        ]
        assert out.token_versions == [
            v for t in out.metadata["turns"] for v in [7] * len(output_ids) + [-1] * len(t["obs_ids"])
        ]
        assert out.weight_versions == [7] and out.status == SampleStatus.TRUNCATED

        bare = Sample(prompt="hello", label=None)
        (out,) = run_slime(f"slime:{PLUGINS}/single_turn.py:generate_minimal", [], url, tiny_model_dir, [bare])
        assert (
            seen[-1]["body"]["return_logprob"] is True and "authorization" not in seen[-1]["headers"]
        )  # asked for anyway; no key set
        assert out.rollout_logprobs == [-0.25 * (i + 1) for i in range(len(output_ids))] and out.token_versions == [
            7
        ] * len(output_ids)

        aborted = asyncio.Event()
        aborted.set()
        before = len(seen)
        (out,) = run_slime(
            f"slime:{PLUGINS}/search.py:generate", overrides, url, tiny_model_dir, [Sample(prompt="hi")], abort=aborted
        )
        assert len(seen) == before and out.status == SampleStatus.ABORTED  # the step is ending: no request was sent


def test_slime_args_map_the_run_config(tiny_model_dir: Path) -> None:
    cfg = load_run_config(
        None,
        [
            f"model={tiny_model_dir}",
            "data.source=task:add",
            "rollout.max_new_tokens=9",
            "rollout.temperature=0.5",
            "rollout.top_k=4",
            "rollout.stop=[STOP]",
            "rollout.n_samples_per_prompt=3",
            "rollout.args.topk=2",
        ],
    )

    class Ctx:
        config, args = cfg, cfg.rollout.args
        client = Client("http://10.1.2.3:4567")
        sampling_params = {"max_new_tokens": 9, "temperature": 0.0}

    args = namespace.slime_args(Ctx())
    assert (args.sglang_router_ip, args.sglang_router_port, args.hf_checkpoint) == (
        "10.1.2.3",
        4567,
        str(tiny_model_dir),
    )
    assert (args.rollout_max_response_len, args.rollout_temperature, args.rollout_top_p, args.rollout_top_k) == (
        9,
        0.5,
        1.0,
        4,
    )
    assert (args.rollout_stop, args.n_samples_per_prompt, args.apply_chat_template, args.topk) == (["STOP"], 3, True, 2)
    assert args.sglang_router_policy is None  # unknown to slimish: None, with a warning (tests/test_slime_examples.py)
    params = namespace.slime_sampling_params(Ctx())
    assert params["temperature"] == 0.0 and params["no_stop_trim"] is True and params["stop"] is None
