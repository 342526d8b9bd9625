"""How engines are started: an engine's command line (`python -m MODULE ARGV`) from the launch
settings, and the launch settings derived from a run's for the engines of its LoRA adapter and of
its teacher. Pure functions of the config: the launcher (local.py, ray_engines.py) and the dry
run's plan (plan.py) both build their command lines here, so the two cannot disagree."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from slimish.launch.sglang import MODULE, sglang_argv

if TYPE_CHECKING:
    from slimish.config import RunConfig
    from slimish.launch.config import LaunchConfig
    from slimish.rollout.config import RolloutConfig
    from slimish.trainer.config import AlgorithmConfig, LoraConfig


def engine_command(
    launch: "LaunchConfig",
    model: str | Path,
    host: str,
    port: int | str,
    gpus: tuple[int, ...] = (),
    threads: int = 0,
) -> tuple[str, list[str]]:
    """One engine of `launch.engine_kind` (builtin or sglang) as `python -m MODULE ARGV`: the
    module and the arguments. `gpus`: its GPUs on its node (slimish/launch/plan.py
    `engine_gpus`) where the launcher places it; none under Ray, whose bundle sets the GPUs the
    engine sees, and none for a CPU engine. `threads`: a built-in engine's `cpu_threads` where
    `launch.cpu_placement` places it (slimish/launch/cpus.py), unless launch.engine_flag sets them."""
    if launch.engine_kind == "sglang":
        return MODULE, sglang_argv(model, host, port, launch.sglang_args, launch.api_key, gpus[0] if gpus else None)
    flags = engine_flags(launch.engine_flag)
    if gpus and flags.get("device") == "cuda":
        flags["device"] = f"cuda:{gpus[0]}"
    if owned := {"model", "host", "port"} & set(flags):
        raise ValueError(
            f"launch.engine_flag: {', '.join(sorted(owned))} set by the launcher (the run's model; "
            "127.0.0.1, or the node's address under launch.mode=ray; a free port); remove it"
        )
    if launch.api_key:
        flags.setdefault("api_key", launch.api_key)
    if threads:
        flags.setdefault("cpu_threads", threads)
    return "slimish.cli", engine_argv(model, host, port, flags)


def engine_argv(model: str | Path, host: str, port: int | str, flags: dict[str, object]) -> list[str]:
    """`slimish engine`'s arguments; `flags` as it reads them: `--flag value`
    (`max_running_requests=8`), a list `--flag v1 v2 ...` (`lora_paths=[...]`), and a boolean
    field a bare flag as SGLang's: `--enable-lora` for True, `--no-enable-lora` for False. A
    boolean may also be the text of a NAME=VALUE pair (`launch.engine_flag: [enable_lora=true]`)."""
    from slimish.engine.config import EngineConfig

    hints, argv = (
        typing.get_type_hints(EngineConfig),
        ["engine", "--model", str(model), "--host", host, "--port", str(port)],
    )
    for key, value in flags.items():
        flag = key.replace("_", "-")
        if hints.get(key) is bool:
            on = value if isinstance(value, bool) else {"true": True, "false": False}.get(str(value).lower())
            if on is None:
                raise ValueError(f"engine flag {key}: true or false, got {value!r}")
            argv.append(f"--{flag}" if on else f"--no-{flag}")
        else:
            argv += [f"--{flag}", *map(str, value if isinstance(value, list) else [value])]
    return argv


def engine_flags(pairs: list[str], field: str = "launch.engine_flag") -> dict[str, object]:
    """NAME=VALUE pairs (`field`, for errors) by name; a NAME given again adds a value: a list
    flag's values. `--max-running-requests=8` and `max_running_requests=8` are the same."""
    values: dict[str, list[str]] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not name:
            raise ValueError(f"{field}: expected NAME=VALUE, got {pair!r}")
        values.setdefault(name, []).append(value)
    return {name: v[0] if len(v) == 1 else v for name, v in values.items()}


def run_launch(cfg: "RunConfig") -> "LaunchConfig":
    """The run's `launch` section with the engine flags its other settings need: serving the
    trained adapter (`lora_launch`), returning routes to replay (`routing_replay_launch`),
    deterministic inference (`true_on_policy_launch`), a running batch as wide as the rollout
    (`rollout_batch_launch`) and memory a colocated trainer can take (`colocate_launch`). What `slimish train`, `slimish rollout` and the dry run
    start engines with."""
    launch = routing_replay_launch(lora_launch(cfg.launch, cfg.trainer.lora), cfg.algorithm)
    return colocate_launch(rollout_batch_launch(true_on_policy_launch(launch, cfg.algorithm), cfg.rollout))


def colocate_launch(launch: "LaunchConfig") -> "LaunchConfig":
    """`launch` with SGLang engines able to give their GPU memory to a colocated trainer
    (`launch.colocate`): `--enable-memory-saver` (sglang 0.5.23:
    python/sglang/srt/arg_groups/fields/exec_.py), unless given."""
    if not (launch.colocate and launch.engine_kind == "sglang"):
        return launch
    return _with_flags(launch, {"enable_memory_saver": []}, switches={"enable_memory_saver"}, sglang_only=True)


def rollout_batch_launch(launch: "LaunchConfig", rollout: "RolloutConfig") -> "LaunchConfig":
    """`launch` with built-in CPU engines whose running batch holds their share of the samples
    the rollout keeps in flight (`rollout.max_concurrency` over `launch.engines`), where that is
    more than the engine's default `max_running_requests`: an engine of 32 rows serving 64
    samples decodes them in two waves, twice the decode steps, each step's fixed cost paid twice
    (on a small model nearly all of a step). A value the user set stands; GPU engines keep theirs,
    since the dry run plans their KV bound against the card's memory."""
    from slimish.engine.config import EngineConfig

    flags = engine_flags(launch.engine_flag)
    rows = -(-rollout.max_concurrency // max(launch.engines, 1))
    if (
        launch.engine_kind != "builtin"
        or "max_running_requests" in flags
        or str(flags.get("device", EngineConfig.device)) != "cpu"
        or rows <= EngineConfig.max_running_requests
    ):
        return launch
    return dataclasses.replace(launch, engine_flag=[*launch.engine_flag, f"max_running_requests={rows}"])


def lora_launch(launch: "LaunchConfig", lora: "LoraConfig") -> "LaunchConfig":
    """`launch` with the flags engines it starts need to serve the run's adapter (`trainer.lora`):
    LoRA on, its rank, its target modules (SGLang's flag names, for the built-in engine too). A
    flag the user set already is left as set."""
    if not lora.enabled:
        return launch
    flags = {
        "enable_lora": ["true"],
        "max_lora_rank": [str(lora.rank)],
        "lora_target_modules": list(lora.target_modules),
    }
    return _with_flags(launch, flags, switches={"enable_lora"})


def routing_replay_launch(launch: "LaunchConfig", algorithm: "AlgorithmConfig") -> "LaunchConfig":
    """`launch` with routes returned by the engines it starts where the run replays them
    (`algorithm.routing_replay: r3`): SGLang's `--enable-return-routed-experts`, the built-in
    engine's `enable_return_routed_experts`. A flag the user set already is left as set."""
    if algorithm.routing_replay != "r3":
        return launch
    return _with_flags(launch, {"enable_return_routed_experts": ["true"]}, switches={"enable_return_routed_experts"})


def true_on_policy_launch(launch: "LaunchConfig", algorithm: "AlgorithmConfig") -> "LaunchConfig":
    """`launch` with deterministic inference in the engines it starts where the run is true on-policy
    (`algorithm.true_on_policy`): the built-in engine's `enable_deterministic_inference`."""
    if not algorithm.true_on_policy:
        return launch
    flag = "enable_deterministic_inference"
    return _with_flags(launch, {flag: ["true"]}, switches={flag})


def _with_flags(
    launch: "LaunchConfig", flags: dict[str, list[str]], switches: set[str], sglang_only: bool = False
) -> "LaunchConfig":
    """`launch` with `flags` (SGLang's names and values) added to both engine kinds' arguments
    (`sglang_only`: SGLang's alone), except those the user set; `switches` are bare flags on
    SGLang's command line."""
    given = {pair.split("=", 1)[0].lstrip("-").replace("-", "_") for pair in launch.engine_flag}
    given_sglang = {
        arg.split("=", 1)[0].removeprefix("--sglang-").lstrip("-").replace("-", "_") for arg in launch.sglang_args
    }
    engine_flag = [
        f"{name}={v}" for name, values in flags.items() if name not in given and not sglang_only for v in values
    ]
    sglang_args = [
        arg
        for name, values in flags.items()
        if name not in given_sglang
        for arg in ["--" + name.replace("_", "-"), *(v for v in values if name not in switches)]
    ]
    return dataclasses.replace(
        launch, engine_flag=[*launch.engine_flag, *engine_flag], sglang_args=[*launch.sglang_args, *sglang_args]
    )


def teacher_launch_config(launch: "LaunchConfig") -> "LaunchConfig":
    """The teacher's engines (`launch.teacher`) as a launch of their own, on this machine."""
    from slimish.launch.config import LaunchConfig

    t = launch.teacher
    return LaunchConfig(
        router_url=t.router_url,
        engines=t.engines,
        engine_kind=t.engine_kind,
        engine_flag=list(t.engine_flag),
        sglang_args=list(t.sglang_args),
        policy=launch.policy,
        api_key=launch.api_key,
        start_timeout=launch.start_timeout,
    )
