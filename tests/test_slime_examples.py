"""slime's examples, as slime users write them, on slimish (issue 35): the plugins in
tests/slime_plugins/ follow slime's examples (ReTool's tool loop, multi_agent's fan-out) and slime's
own `generate_and_rm` / `rm_hub.async_rm` with every rm type, through `slimish rollout` (run
in-process: `slimish.cli.main`) and one 2-step `slimish train`; every model token is the engine's,
its logprob equal to the engine's replay of the whole sample within 1e-4, every observation mask 0.
Then the compat layer under a package laid out like the real slime, the args slimish maps, and
the four bugs of the issue. `engine` (the session's generate-only engine: a router's protocol)
and `prompts` are conftest's.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, generate, rollout_once

from slimish import cli
from slimish.compat import load_function
from slimish.compat.slime import namespace
from slimish.config import load_run_config
from slimish.rollout import graders
from slimish.types import Sample, SampleStatus

PLUGINS = "tests/slime_plugins"
GENERATE_ONLY = True  # the session's shared engine, in place of a router: the plugins only generate
# The text options of slime's sampling params (slimish.compat.slime.namespace.slime_sampling_params).
SLIME_TEXT = {"skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": True}
RETOOL_ARGS = ("rollout.args.max_turns=3", "rollout.args.turn_max_tokens=3", "rollout.args.max_tokens_per_gpu=512")


@pytest.fixture(autouse=True)
def from_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    """As `slimish` started at the repository's root: module specs (`tests.slime_plugins...`,
    as slime's `examples.multi_agent...`) import from the working directory."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))


def rollout(tmp_path: Path, model: Path, router: str, source: str, flags: list[str], *overrides: str) -> list[Sample]:
    """`rollout_once`, sampled at temperature 1, 8 new tokens."""
    return rollout_once(
        tmp_path, model, router, source, flags, "rollout.max_new_tokens=8", "rollout.temperature=1.0", *overrides
    )


def replayed(engine_url: str, s: Sample) -> list[float]:
    """The engine's logprobs of the sample's response tokens, from one forward of all its tokens."""
    out = generate(
        engine_url,
        input_ids=s.tokens,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=s.prompt_length,
    )
    return [e[0] for e in out["meta_info"]["input_token_logprobs"]]


def check_turns(engine_url: str, s: Sample, turns: list[dict[str, Any]]) -> None:
    """Model turns (mask 1) are the engine's replies, observations mask 0 with logprob 0 and
    version -1, and every trained logprob is the engine's replay within 1e-4."""
    assert s.response_ids == [t for turn in turns for t in turn["output_ids"] + turn["obs_ids"]]
    assert s.loss_mask == [m for turn in turns for m in [1] * len(turn["output_ids"]) + [0] * len(turn["obs_ids"])]
    assert s.rollout_logprobs == [lp for turn in turns for lp in turn["logprobs"] + [0.0] * len(turn["obs_ids"])]
    assert s.token_versions == [v if m else -1 for v, m in zip([0] * len(s.loss_mask), s.loss_mask)]
    replay = replayed(engine_url, s)
    trained = [(lp, r) for lp, r, m in zip(s.rollout_logprobs, replay, s.loss_mask) if m]
    assert trained and all(abs(lp - r) <= 1e-4 for lp, r in trained), trained


# ---- the examples through `slimish rollout` -----------------------------------------------------


def test_a_retool_tool_loop_with_a_local_sandbox(
    engine: str, tiny_model_dir: Path, prompts: str, tmp_path: Path
) -> None:
    """Turns of 3 tokens, each run as code by a fresh interpreter whose output comes back as an
    observation; the context bound from slime's defaults (`context_parallel_size` 1) and
    `rollout.args.max_tokens_per_gpu`; DAPO's reward (-1: the random model gives no answer)."""
    samples = rollout(
        tmp_path,
        tiny_model_dir,
        engine,
        prompts,
        [
            "--rollout-fn",
            f"slime:{PLUGINS}/retool.py:generate",
            "--reward-fn",
            f"slime:{PLUGINS}/retool.py:reward_func",
        ],
        "rollout.filter_fn=null",
        *RETOOL_ARGS,
    )
    assert sorted((s.group_id, s.index) for s in samples) == [(g, i) for g in range(2) for i in range(2)]
    for s in samples:
        turns = s.metadata["turns"]
        assert len(turns) == 3
        ran = subprocess.run([sys.executable, "-I", "-c", turns[0]["text"]], capture_output=True, text=True)
        assert turns[0]["obs"] == f"\n<interpreter>\n{(ran.stdout + ran.stderr)[-120:]}\n</interpreter>\n"
        assert turns[-1]["obs_ids"] == [] and all(t["obs_ids"] for t in turns[:-1])
        assert s.tokens[: s.prompt_length] == s.metadata["prompt_ids"]
        check_turns(engine, s, turns)
        written = sum(len(t["output_ids"]) for t in turns)
        assert s.reward == -1.0 and s.status == (SampleStatus.TRUNCATED if written == 8 else SampleStatus.COMPLETED)


def test_a_multi_agent_fan_out_keeps_each_agents_reward(
    engine: str, tiny_model_dir: Path, prompts: str, tmp_path: Path
) -> None:
    """Two solvers and a selector per input sample, each its own trajectory with the reward
    `batched_async_rm` gave it (rm_type f1), all stamped with slime's rollout_id; a module spec
    found from the working directory, as slime's `examples.multi_agent...`."""
    samples = rollout(
        tmp_path,
        tiny_model_dir,
        engine,
        prompts,
        ["--rollout-fn", "slime:tests.slime_plugins.multi_agent:generate_with_multi_agents"],
        "rollout.filter_fn=null",
        "rollout.args.num_parallel=2",
        "rollout.args.rollout_max_context_len=256",
        "rollout.args.rm_type=f1",
    )
    assert len(samples) == 2 * 2 * 3
    for s in samples:
        reply = s.metadata["engine"]
        turns = [{"output_ids": reply["output_ids"], "logprobs": reply["logprobs"], "obs_ids": []}]
        check_turns(engine, s, turns)
        assert s.metadata["slime"]["rollout_id"] == s.index
    by_call: dict[tuple[int, int], list[Sample]] = {}
    for s in samples:
        by_call.setdefault((s.group_id, s.index), []).append(s)
    for (group, index), siblings in by_call.items():
        siblings.sort(key=lambda s: s.trajectory_id)
        assert [s.trajectory_id for s in siblings] == [f"{group}-{index}/{k}" for k in range(3)]
        *solvers, selector = siblings
        for solver in solvers:
            assert solver.reward == graders.f1_score(solver.metadata["engine"]["text"], solver.label)[0]
        assert selector.reward == max(solver.reward for solver in solvers)


def test_slimes_generate_and_rm_with_every_rm_type(engine: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """slime's own `generate_and_rm` as the rollout fn (greedy): each prompt's `rm_type` (a data
    column, read by `async_rm` from the sample's metadata) decides its reward, graded on the
    engine's text; DAPO's is a dict."""
    rm_types = ["math", "deepscaler", "dapo", "f1", "gpqa", "random", "boxed_f1"]
    source = tmp_path / "rows.jsonl"
    source.write_text(
        "".join(
            json.dumps({"prompt": f"Q{i}: 1+1?", "label": "2", "rm_type": t}) + "\n" for i, t in enumerate(rm_types)
        )
    )
    samples = rollout(
        tmp_path,
        tiny_model_dir,
        engine,
        str(source),
        ["--rollout-fn", "slime:slime.rollout.sglang_rollout:generate_and_rm"],
        "rollout.filter_fn=null",
        f"rollout.rollout_batch_size={len(rm_types)}",
        "rollout.reward_key=score",
        "rollout.temperature=0.0",
    )
    assert len(samples) == 2 * len(rm_types)
    for s in samples:
        rm_type = s.metadata["rm_type"]
        reply = generate(
            engine,
            input_ids=s.tokens[: s.prompt_length],
            sampling_params=dict(SLIME_TEXT, max_new_tokens=8, temperature=0.0),
            return_logprob=True,
        )
        assert reply["output_ids"] == s.response_ids
        text = reply["text"]
        expected = {
            "math": float(graders.math_equal(graders.extract_boxed(text), "2")),
            "deepscaler": 0.0,  # no </think>: no answer to grade
            "dapo": graders.dapo_score(text, "2"),
            "f1": graders.f1_score(text, "2")[0],
            "boxed_f1": graders.f1_score(graders.extract_boxed(text) or "", "2")[0],
        }
        if rm_type in expected:
            assert s.reward == expected[rm_type], (rm_type, text)
        else:
            assert s.reward in (0.0, 1.0)
        check_turns(engine, s, [{"output_ids": s.response_ids, "logprobs": s.rollout_logprobs, "obs_ids": []}])


# ---- a 2-step `slimish train` ---------------------------------------------------------------------


def test_slimish_train_runs_the_examples(tiny_model_dir: Path, prompts: str, tmp_path: Path) -> None:
    """ReTool's loop trains with slime's `check_reward_nonzero_std` filter (every group flat at
    -1, so refilled under `keep_when_insufficient`); the multi-agent fan-out, slime's
    `generate_and_rm` + `async_rm`, and the search-style generate with a group rm run as eval
    datasets: two steps, nothing failed, the second on the weights pushed after the first."""
    config = tmp_path / "run.yaml"
    datasets = [
        {
            "name": "agents",
            "source": prompts,
            "rollout_fn": "slime:tests.slime_plugins.multi_agent:generate_with_multi_agents",
            "reward_fn": "slime:slime.rollout.rm_hub:async_rm",
        },
        {"name": "default", "source": prompts, "rollout_fn": "slime:slime.rollout.sglang_rollout:generate_and_rm"},
        {
            "name": "search",
            "source": prompts,
            "rollout_fn": f"slime:{PLUGINS}/search.py:generate",
            "reward_fn": f"slime:{PLUGINS}/rewards.py:group_rm",
        },
    ]
    config.write_text(json.dumps({"eval": {"every": 2, "n_prompts": 1, "datasets": datasets}}))
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "slimish.cli",
        "train",
        "--config",
        str(config),
        "--rollout-fn",
        f"slime:{PLUGINS}/retool.py:generate",
        "--reward-fn",
        f"slime:{PLUGINS}/retool.py:reward_func",
        "--filter-fn",
        "slime:slime.rollout.filter_hub.dynamic_sampling_filters:check_reward_nonzero_std",
        f"model={tiny_model_dir}",
        f"run_dir={run_dir}",
        f"data.source={prompts}",
        *RETOOL_ARGS,
        "rollout.args.rm_type=math",
        "rollout.args.num_parallel=2",
        "rollout.args.rollout_max_context_len=256",
        "rollout.args.eval_max_context_len=256",
        "rollout.args.search_payload=alternate",
        "rollout.keep_when_insufficient=true",
        "rollout.max_prompts_factor=1",  # every group is flat: refill after the batch's own prompts
        "steps=2",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=6",
        "checkpoint.every=0",
        "launch.engines=1",
    ]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    from slimish.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if r["step"] >= 1 and "rollout/groups_failed" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/groups_failed"] == 0 and r["rollout/groups_refilled"] == 2 for r in rows)
    assert all("rollout/retokenized_mismatch" in r for r in rows)
    evals = [r for r in read_metrics(run_dir) if "eval/agents/reward" in r]
    assert evals and all("eval/default/reward" in r and "eval/search/reward" in r for r in evals), evals
    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert [t["versions"] for t in trained] == [[[0], [0]], [[1], [1]]]


# ---- slime's args --------------------------------------------------------------------------------


class Ctx:
    def __init__(self, cfg: Any) -> None:
        from slimish.client import Client

        self.config, self.args = cfg, cfg.rollout.args
        self.client = Client("http://10.1.2.3:4567")


def test_unmapped_slime_args_take_slimes_defaults_and_unknown_ones_warn_once(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug 4: what the examples read and slimish does not map is slime's default, not an
    AttributeError; an argument nobody knows reads None with one warning naming it."""
    cfg = load_run_config(
        None, [f"model={tiny_model_dir}", "data.source=task:add", "rollout.args.max_tokens_per_gpu=9"]
    )
    args = namespace.slime_args(Ctx(cfg))
    assert (args.rollout_max_context_len, args.eval_max_context_len, args.context_parallel_size) == (None, None, 1)
    assert args.max_tokens_per_gpu == 9  # rollout.args wins
    monkeypatch.setattr(namespace, "_warned_args", set())
    with caplog.at_level(logging.WARNING, logger=namespace.__name__):
        assert args.no_such_flag is None and args.no_such_flag is None
    (record,) = caplog.records
    assert record.getMessage().startswith("slime argument args.no_such_flag is not mapped")
    assert "set it as rollout.args.no_such_flag=VALUE" in record.getMessage()


def test_custom_paths_name_the_users_slime_functions_as_slime_loads_them(tiny_model_dir: Path) -> None:
    """Bug 1: `args.custom_rm_path` (and the generate and filter paths) are slime's dotted paths
    of the user's functions, which slime's `load_function` (what `async_rm` calls) imports; slime's
    own functions and slimish functions are slime's default, None."""
    specs = {
        "rollout.rollout_fn": "slime:slime.rollout.sglang_rollout:generate_and_rm",
        "rollout.reward_fn": f"slime:{PLUGINS}/rewards.py:rm",
        "rollout.filter_fn": "slime:tests.slime_plugins.rewards:nonzero_std",
    }
    for key, kind in (
        ("rollout.rollout_fn", "rollout"),
        ("rollout.reward_fn", "reward"),
        ("rollout.filter_fn", "filter"),
    ):
        load_function(specs[key], kind)
    cfg = load_run_config(None, [f"model={tiny_model_dir}", "data.source=task:add"], **specs)
    args = namespace.slime_args(Ctx(cfg))
    from slime.utils.misc import load_function as slime_load

    assert args.custom_generate_function_path is None
    assert slime_load(args.custom_rm_path).__name__ == "rm"
    assert slime_load(args.dynamic_sampling_filter_path).__name__ == "nonzero_std"
    cfg = load_run_config(
        None, [f"model={tiny_model_dir}", "data.source=task:add", "rollout.reward_fn=slimish.rollout.graders:f1_reward"]
    )
    assert namespace.slime_args(Ctx(cfg)).custom_rm_path is None


# ---- the commands --------------------------------------------------------------------------------


def test_the_slimish_command_imports_modules_of_the_working_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Bug 2: the `slimish` console script finds `my_examples.gen` in the directory it runs in,
    as `python -m slimish.cli` does (here found, then refused for its shape: nothing starts)."""
    (tmp_path / "my_examples").mkdir()
    (tmp_path / "my_examples" / "gen.py").write_text("async def generate(args, sample):\n    return sample\n")
    argv = [str(Path(sys.executable).parent / "slimish"), "rollout", "--rollout-fn", "slime:my_examples.gen:generate"]
    argv += ["--out", str(tmp_path / "out.jsonl"), f"model={tiny_model_dir}", "data.source=task:add"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no module named" not in done.stderr, done.stderr[-2000:]
    assert "write `async def generate(args, sample, sampling_params)`" in done.stderr, done.stderr[-2000:]


def test_a_run_failing_the_same_way_says_how_to_go_on_with_its_own_command(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug 3: `slimish rollout` has no --resume: it says to run it again; `slimish train` says
    to resume with --resume auto."""
    import contextlib
    import types

    import slimish.launch
    import slimish.rollout.cli
    import slimish.train
    from slimish.rollout.pipeline import IdleClock
    from slimish.rollout.stats import RolloutFailing, Tally

    overrides = [f"model={tiny_model_dir}", "data.source=task:add", f"run_dir={tmp_path}"]
    cfg = load_run_config(None, [*overrides, "rollout.max_consecutive_failures=2"])
    tally = Tally(cfg.rollout, IdleClock())
    failed = Sample(
        prompt="p", status=SampleStatus.FAILED, error="reward fn: KeyError: 'x'", metadata={"error_at": "r.py:4"}
    )
    with pytest.raises(RolloutFailing) as failing:
        for _ in range(2):
            tally.count_failures([failed])
    assert "--resume" not in str(failing.value)

    def fails(*args: Any) -> None:
        raise failing.value

    async def fails_async(*args: Any) -> None:
        fails()

    monkeypatch.setattr(
        slimish.launch, "start_servers", lambda *a: contextlib.nullcontext(types.SimpleNamespace(router_url=""))
    )
    monkeypatch.setattr(slimish.rollout.cli, "rollout_to_jsonl", fails_async)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["rollout", "--out", str(tmp_path / "out.jsonl"), *overrides])
    assert str(stopped.value).endswith("Fix it (at r.py:4), then run it again") and "--resume" not in str(stopped.value)

    monkeypatch.setattr(slimish.train, "train", fails)
    with pytest.raises(SystemExit) as stopped:
        slimish.train.checked_train(cfg)
    assert str(stopped.value).endswith("Fix it (at r.py:4), then resume with --resume auto")


# ---- with the real slime's package layout on PYTHONPATH ------------------------------------------

# A package laid out like slime (github THUDM/slime), reduced to what the test reads: its own
# `post` (which would need slime's HTTP client), `load_function`, `Sample`, and an `async_rm` that
# calls the run's custom rm by `args.custom_rm_path`, as slime's does.
FAKE_SLIME = {
    "slime/__init__.py": "",
    "slime/utils/__init__.py": "",
    "slime/utils/http_utils.py": (
        "async def post(url, payload, max_retries=60, headers=None):\n"
        "    raise RuntimeError('slime HTTP client not initialised')\n\n"
        "async def get(url, headers=None):\n"
        "    raise RuntimeError('slime HTTP client not initialised')\n"
    ),
    "slime/utils/misc.py": (
        "import importlib\n\n"
        "def load_function(path):\n"
        "    module, _, name = path.rpartition('.')\n"
        "    return getattr(importlib.import_module(module), name)\n"
    ),
    "slime/utils/types.py": (
        "from dataclasses import dataclass, field\nfrom enum import Enum\n\n"
        "@dataclass\nclass Sample:\n"
        "    group_index: int = None\n    index: int = None\n    rollout_id: int = None\n    prompt: str = ''\n"
        "    tokens: list = field(default_factory=list)\n    response: str = ''\n    response_length: int = 0\n"
        "    label: str = None\n    reward: float = None\n    loss_mask: list = None\n"
        "    weight_versions: list = field(default_factory=list)\n    rollout_log_probs: list = None\n"
        "    remove_sample: bool = False\n    metadata: dict = field(default_factory=dict)\n"
        "    custom_rm_path: str = None\n    session_id: str = None\n\n"
        "    class Status(Enum):\n        PENDING = 'pending'\n        COMPLETED = 'completed'\n"
        "        TRUNCATED = 'truncated'\n        ABORTED = 'aborted'\n        FAILED = 'failed'\n\n"
        "    status: Status = Status.PENDING\n"
    ),
    "slime/rollout/__init__.py": "",
    "slime/rollout/rm_hub/__init__.py": (
        "from slime.utils.misc import load_function\n\n"
        "async def async_rm(args, sample, **kwargs):\n"
        "    return await load_function(args.custom_rm_path)(args, sample, **kwargs)\n"
    ),
}

USES_REAL_SLIME = """
from slime.rollout.rm_hub import async_rm
from slime.utils.http_utils import post
from slime.utils.types import Sample


async def generate(args, sample, sampling_params):
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    ids = [1, 2, 3]
    out = await post(url, {"input_ids": ids, "sampling_params": sampling_params})
    pairs = out["meta_info"]["output_token_logprobs"]
    sample.tokens = ids + [p[1] for p in pairs]
    sample.response_length = len(pairs)
    sample.rollout_log_probs = [p[0] for p in pairs]
    sample.status = Sample.Status.COMPLETED
    sample.reward = await async_rm(args, sample)
    sample.metadata["real_slime"] = not hasattr(__import__("slime"), "STAND_IN")
    return sample


async def rm(args, sample, **kwargs):
    return float(sample.response_length)
"""


def test_the_compat_layer_under_a_package_laid_out_like_slime(
    engine: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With a real `slime` importable, its modules are used, its `post` replaced by slimish's,
    and its `async_rm` finds the run's rm by `args.custom_rm_path` (bug 1: it was slimish's spec)."""
    for name, text in FAKE_SLIME.items():
        (tmp_path / "site" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / name).write_text(text)
    (tmp_path / "plugin.py").write_text(USES_REAL_SLIME)
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "slimish.cli", "rollout", "--steps", "1", "--out", str(out)]
    argv += [
        "--rollout-fn",
        f"slime:{tmp_path / 'plugin.py'}:generate",
        "--reward-fn",
        f"slime:{tmp_path / 'plugin.py'}:rm",
    ]
    argv += [f"model={tiny_model_dir}", "data.source=task:add", f"launch.router_url={engine}", f"run_dir={tmp_path}"]
    argv += [
        "rollout.n_samples_per_prompt=2",
        "rollout.rollout_batch_size=1",
        "rollout.max_new_tokens=3",
        "rollout.filter_fn=null",
    ]
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = [Sample.from_dict(json.loads(line)) for line in out.read_text().splitlines()]
    assert len(samples) == 2
    for s in samples:
        assert s.metadata["real_slime"] is True and s.tokens[:3] == [1, 2, 3]
        assert s.reward == float(s.response_length) > 0 and s.loss_mask == [1] * s.response_length
