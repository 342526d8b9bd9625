"""`--rollout-fn` / `--reward-fn` / `--filter-fn` specs: a bad one fails at start-up, saying which and how to fix it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slimish.plugins import LoadError, load_function
from slimish.rollout.rewards import group_reward, is_group_reward

PLUGIN = """
from slimish.rollout.rewards import group_reward

async def rollout(ctx, sample):
    return sample

def not_async(ctx, sample):
    return sample

async def one_arg(ctx):
    return None

async def extra(ctx, sample, tries):
    return sample

async def with_default(ctx, sample, tries=3):
    return sample

@group_reward
async def judge(ctx, samples):
    return [0.0] * len(samples)

@group_reward
async def bad_group(samples):
    return []

def keep_all(group):
    return None

async def keep_all_async(group):
    return None

CONSTANT = 3
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plugins") / "my_plugin.py"
    path.write_text(PLUGIN)
    return path


def test_good_specs_load(plugin: Path) -> None:
    from rollout_plugins import math as math_plugin

    assert load_function("rollout_plugins.math:rollout", "rollout") is math_plugin.rollout
    assert load_function("rollout_plugins/math.py:reward", "reward").__name__ == "reward"
    assert load_function(f"{plugin}:rollout", "rollout").__name__ == "rollout"
    assert load_function(f"{plugin}:with_default", "rollout").__name__ == "with_default"
    assert load_function("slimish.rollout.filters:nonzero_std", "filter").__name__ == "nonzero_std"
    assert load_function(f"{plugin}:keep_all_async", "filter").__name__ == "keep_all_async"
    judge = load_function(f"{plugin}:judge", "reward")
    assert is_group_reward(judge) and not is_group_reward(load_function(f"{plugin}:rollout", "reward"))
    assert load_function(f"{plugin}:rollout", "rollout") is load_function(
        f"{plugin}:rollout", "rollout"
    )  # one module per file


@pytest.mark.parametrize(
    ("spec", "kind", "message"),
    [
        ("rollout_plugins.math", "rollout", "expected `module:function`"),
        ("rollout_plugins.math:", "rollout", "expected `module:function`"),
        ("no_such_pkg.mod:rollout", "rollout", "--rollout-fn 'no_such_pkg.mod:rollout': no module named 'no_such_pkg'"),
        ("rollout_plugins.nope:rollout", "rollout", "no module named 'rollout_plugins.nope'"),
        ("missing/dir/plugin.py:rollout", "rollout", "no file missing/dir/plugin.py"),
        ("rollout_plugins.math:rollout_fn", "rollout", "has no function 'rollout_fn'; it defines: reward, rollout"),
        ("{plugin}:nope", "reward", "--reward-fn"),
        ("{plugin}:CONSTANT", "rollout", "CONSTANT is a int, not a function"),
        (
            "{plugin}:not_async",
            "rollout",
            "must be an async function (it is called with await); write `async def not_async(ctx, sample)`",
        ),
        (
            "{plugin}:one_arg",
            "rollout",
            "one_arg(ctx) cannot be called with (ctx, sample); write `async def one_arg(ctx, sample)`",
        ),
        ("{plugin}:extra", "reward", "cannot be called with (ctx, sample)"),
        (
            "{plugin}:bad_group",
            "reward",
            "bad_group(samples) cannot be called with (ctx, samples); write `async def bad_group(ctx, samples)`",
        ),
        ("{plugin}:extra", "filter", "--filter-fn"),
        (
            "slime:{plugin}:rollout",
            "rollout",
            "a `slime:` spec is adapted by slimish.compat.load_function (as `slimish train` and `slimish rollout` load)",
        ),
        (
            "slime:{plugin}:rollout",
            "credit",
            "algorithm.segment_credit takes a slimish function: drop the `slime:` prefix",
        ),
    ],
)
def test_bad_specs_say_which_and_how_to_fix(plugin: Path, spec: str, kind: str, message: str) -> None:
    with pytest.raises(LoadError) as info:
        load_function(spec.format(plugin=plugin), kind)
    assert message in str(info.value)


def test_a_plugin_that_raises_on_import_names_the_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import json\nraise RuntimeError('no API key')\n")
    with pytest.raises(LoadError, match=r"running .*broken.py raised RuntimeError: no API key"):
        load_function(f"{path}:rollout", "rollout")
    path.write_text("import not_installed_dependency\n")
    with pytest.raises(LoadError, match="No module named 'not_installed_dependency'"):
        load_function(f"{path}:rollout", "rollout")


def test_group_reward_marks_the_function() -> None:
    async def fn(ctx, samples):
        return []

    assert group_reward(fn) is fn and is_group_reward(fn)


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_cli_fails_at_start_up_before_any_server(tmp_path: Path, command: str) -> None:
    """The bad spec is reported before engines start: no engine log is ever written."""
    run_dir = tmp_path / "run"
    out = ["--out", str(tmp_path / "out.jsonl")] if command == "rollout" else []
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimish.cli",
            command,
            "--rollout-fn",
            "rollout_plugins.math:rollout_fn",
            *out,
            "model=/nonexistent",
            "data.source=task:add",
            f"run_dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert (
        "--rollout-fn 'rollout_plugins.math:rollout_fn': rollout_plugins.math has no function 'rollout_fn'"
        in proc.stderr
    )
    assert not run_dir.exists()


def test_the_run_loads_each_rollout_function_once_into_its_field(tmp_path: Path) -> None:
    """What `slimish train` and `slimish rollout` load at start-up and hand to the manager: each
    key's function, loaded once, in its field; a bad one fails naming its key."""
    from slimish.compat import load_function as run_loader
    from slimish.config import load_run_config
    from slimish.rollout.functions import RolloutFunctions

    path = tmp_path / "hooks.py"
    path.write_text(
        "async def rollout(ctx, sample):\n    return sample\n\n"
        "async def reward(ctx, sample):\n    return 1.0\n\n"
        "async def hook(ctx, sample):\n    return None\n\n"
        "def post(ctx, group):\n    return [0.0] * len(group)\n\n"
        "def keep(ctx, group):\n    return None\n\n"
        "def sync_hook(ctx, sample):\n    return None\n"
    )
    named = {"rollout_fn": "rollout", "reward_fn": "reward", "filter_fn": "keep", "sample_hook": "hook"}
    keys = [f"rollout.{key}={path}:{name}" for key, name in named.items()] + [f"rollout.reward_post_fn={path}:post"]
    loads: list[tuple[str, str]] = []

    def counting(spec: str, kind: str, flag: str | None = None):
        loads.append((spec.rpartition(":")[2], kind))
        return run_loader(spec, kind, flag)

    base = ["model=/nonexistent", "data.source=task:add"]
    cfg = load_run_config(None, [*base, *keys])
    fns = RolloutFunctions.load(cfg.rollout, counting)
    kinds = {"rollout": "rollout", "reward": "reward", "keep": "filter", "hook": "sample_hook", "post": "reward_post"}
    assert sorted(loads) == sorted(kinds.items())
    fields = [*named, "reward_post"]
    assert {key: getattr(fns, key).__name__ for key in fields} == {**named, "reward_post": "post"}
    bad = load_run_config(None, [*base, keys[0], f"rollout.sample_hook={path}:sync_hook"])
    with pytest.raises(LoadError, match=r"rollout\.sample_hook '.*:sync_hook': sync_hook must be an async function"):
        RolloutFunctions.load(bad.rollout, run_loader)
