"""A training or rollout run's configuration: `slimish train|rollout --config C.yaml [key=value ...]`.

RunConfig composes the components' schemas, each with its defaults beside the code it configures
(slimish/engine/config.py, router/, rollout/, trainer/, launch/config.py, BufferConfig in
buffer.py, MetricsConfig in metrics.py); here live only what spans sections: the run's own keys,
the checks across sections, and keys renamed since the last release.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slimish.buffer import BufferConfig
from slimish.flags import describe_config
from slimish.gateway.config import GatewayConfig
from slimish.launch.commands import engine_flags
from slimish.launch.config import LaunchConfig
from slimish.launch.cpus import check_split
from slimish.launch.sglang import sglang_tp
from slimish.metrics import MetricsConfig
from slimish.rollout.config import ZERO_VARIANCE_FILTER, DataConfig, EvalConfig, RolloutConfig
from slimish.schema import doc, doc_factory, one_of
from slimish.trainer.config import (
    SGLANG_LORA,
    AlgorithmConfig,
    CheckpointConfig,
    CriticConfig,
    PolicyConfig,
    SFTConfig,
    TrainerConfig,
    WeightSyncConfig,
    check_policies,
)

log = logging.getLogger(__name__)


@dataclass
class RunConfig:
    model: str = doc(MISSING, "HF model directory (policy initial weights and tokenizer)")
    run_dir: str = "runs/latest"
    steps: int = doc(10, "RL steps")
    seed: int = doc(0, "the one seed: python, numpy and torch, and data.seed / trainer.seed unless set")
    async_training: bool = doc(
        False,
        "true: the rollout keeps going while the trainer trains, on weights up to buffer.max_staleness (>= 1) "
        "versions old. false: rollout, then train, then push.",
    )
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  # used with algorithm.advantage=gae
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    policies: list[PolicyConfig] = doc_factory(
        list, "several policies in one run, each a LoRA adapter (docs/policies.md); empty: one policy"
    )

    def __post_init__(self) -> None:
        check_split(self.launch)
        if self.policies:
            check_policies(self)
        if self.async_training and self.buffer.max_staleness < 1:
            raise ValueError(
                "async_training needs buffer.max_staleness >= 1: a rollout beside training samples from weights "
                "at least one push behind the trainer"
            )
        opd = self.algorithm.opd
        if opd.coef > 0 and not self.launch.teacher.configured:
            raise ValueError(
                "algorithm.opd.coef > 0 needs a teacher: set launch.teacher.model (an HF directory; the run starts "
                "its engines), launch.teacher.router_url (a running teacher server) or launch.teacher.served_name "
                "(a teacher registered by name on launch.router_url)"
            )
        if not opd.task_reward and self.rollout.filter_fn == ZERO_VARIANCE_FILTER:
            raise ValueError(
                f"algorithm.opd.task_reward=false (pure distillation) trains every group whatever its rewards: "
                f"set rollout.filter_fn=null (or a filter that does not judge by reward), not {ZERO_VARIANCE_FILTER}"
            )
        if self.algorithm.advantage == "gae" and self.trainer.backend != "torch":
            raise ValueError(
                f"algorithm.advantage=gae (PPO with a critic) needs trainer.backend=torch, got {self.trainer.backend!r}: "
                "the Megatron backend has no value model"
            )
        if self.algorithm.advantage == "gae" and self.trainer.lora.enabled:
            raise ValueError(
                "algorithm.advantage=gae with trainer.lora: the critic would be a second full model trained in full, "
                "which LoRA is meant to avoid; use a reward-only advantage (e.g. grpo) with LoRA"
            )
        if self.algorithm.true_on_policy:
            check_true_on_policy(self)
        if self.launch.colocate:
            check_colocate(self)
        sync = self.weight_sync
        if (
            self.trainer.lora.enabled
            and self.launch.engine_kind == "sglang"
            and (sync.transport, sync.pause_mode) != ("disk", "abort")
        ):
            raise ValueError(f"trainer.lora with launch.engine_kind=sglang: {SGLANG_LORA}")
        for section in (self.data, self.trainer):
            if section.seed is None:
                section.seed = self.seed
        # The one place weight_sync.master_address is resolved: engines on a Ray cluster's other
        # nodes cannot reach rank 0 at the default loopback.
        if (
            sync.master_address == WeightSyncConfig.master_address
            and self.launch.mode == "ray"
            and self.launch.ray_address
        ):
            import ray.util

            sync.master_address = ray.util.get_node_ip_address()


def check_true_on_policy(cfg: RunConfig) -> None:
    """algorithm.true_on_policy's requirements: both sides must run slimish's batch-invariant kernels."""
    needs = {
        "launch.engine_kind=builtin (SGLang's kernels are not the trainer's)": cfg.launch.engine_kind == "builtin",
        "trainer.backend=torch (Megatron's kernels are not the engine's)": cfg.trainer.backend == "torch",
        "trainer.lora.enabled=false": not cfg.trainer.lora.enabled,
        "async_training=false (an async step trains on older weights' samples)": not cfg.async_training,
        "trainer.dtype=float32 (or its CPU default)": cfg.trainer.dtype in (None, "float32"),
    }
    missing = [what for what, ok in needs.items() if not ok]
    if missing:
        raise ValueError(f"algorithm.true_on_policy needs {'; '.join(missing)}")


def check_colocate(cfg: RunConfig) -> None:
    """What `launch.colocate` needs of the rest of the run, refused by name (docs/colocate.md): one
    trainer process, and on CPU fp32 parameters the engines map (async is fine there: the engines
    pause for each optimiser step, slimish/trainer/colocated.py); with SGLang engines one engine on
    the trainer's GPU, sync, the whole policy pushed (slimish/trainer/colocated_sglang.py)."""
    flags = engine_flags(cfg.launch.engine_flag)
    needs = {
        "trainer.backend=torch (Megatron's parameters are its own, sharded)": cfg.trainer.backend == "torch",
        "trainer.nproc=1 (one trainer process beside the engines)": cfg.trainer.nproc == 1,
        "no policies (several adapters: not supported colocated yet)": not cfg.policies,
    }
    if cfg.launch.engine_kind == "sglang":
        needs |= {
            "async_training=false with launch.engine_kind=sglang (its memory is released while the trainer trains)": (
                not cfg.async_training
            ),
            "trainer.lora.enabled=false with launch.engine_kind=sglang (the whole policy is pushed)": (
                not cfg.trainer.lora.enabled
            ),
            "launch.engines=1 and --tp-size 1 with launch.engine_kind=sglang (one engine on the trainer's one GPU)": (
                cfg.launch.engines == 1 and sglang_tp(cfg.launch.sglang_args) == 1
            ),
        }
    else:
        needs |= {
            "trainer.dtype=float32 (or its CPU default): the engines compute on the trainer's fp32 weights": (
                cfg.trainer.dtype in (None, "float32")
            ),
            "launch.engine_flag dtype=float32 (the store holds the trainer's fp32 weights)": (
                flags.get("dtype", "float32") == "float32"
            ),
            "launch.engine_flag device=cpu (the store is host memory)": flags.get("device", "cpu") == "cpu",
        }
    if missing := [need for need, ok in needs.items() if not ok]:
        raise ValueError(f"launch.colocate needs {'; '.join(missing)}")


# Old key -> its new name: still read for a release, with a warning.
RENAMED_KEYS = {
    "data.eval_source": "eval.source",
    "rollout.eval_n_prompts": "eval.n_prompts",
    "rollout.eval_n_samples_per_prompt": "eval.n_samples_per_prompt",
    "rollout.eval_temperature": "eval.temperature",
    "launch.router_workers": "launch.router_processes",
}


def _rename(values: Any, where: str) -> Any:
    """Move renamed keys of a YAML mapping to their new place, warning once per key."""
    for old, new in RENAMED_KEYS.items():
        section, key = old.split(".")
        node = values.get(section) if isinstance(values, dict) else None
        if isinstance(node, dict) and key in node:
            log.warning("%s: %s is now %s; the old name will stop working in the next release", where, old, new)
            values.setdefault(new.split(".")[0], {})[new.split(".")[1]] = node.pop(key)
    return values


def _old_mode(values: Any, where: str) -> str | None:
    """The top-level `mode: sync|async` of the last release (async_training now; `mode` is only
    launch.mode, where the engines run), taken out of a YAML mapping with a warning."""
    if not isinstance(values, dict) or "mode" not in values:
        return None
    log.warning(
        "%s: mode is now async_training (true|false; async ran only with buffer.max_staleness >= 1); "
        "the old name will stop working in the next release",
        where,
    )
    mode = values.pop("mode")
    one_of("mode", mode, ("sync", "async"))
    return mode


def _declared(schema: type) -> dict[str, Any]:
    """Each field's default as its schema declares it. OmegaConf makes a section's defaults by
    calling the section, whose __post_init__ may resolve a default from the others (None ->
    launch.start_timeout for builtin engines): merged back, that resolution happens once, from
    the values the run gives."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.default_factory):
            values[f.name] = _declared(f.default_factory)
        elif f.default_factory is dataclasses.MISSING and f.default is not MISSING:
            values[f.name] = f.default
    return values


def load_run_config(path: str | None, overrides: list[str] = (), **named: Any) -> RunConfig:
    """YAML file, then `key=value` overrides (dotted keys), then named flags (e.g. rollout.rollout_fn)."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), _declared(RunConfig))
        given = [(OmegaConf.to_container(OmegaConf.load(path)), path)] if path else []
        given.append((OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides))), "key=value"))
        mode = None
        for values, where in given:
            mode = _old_mode(values, where) or mode
            cfg = OmegaConf.merge(cfg, _rename(values, where))
        for key, value in named.items():
            if value is not None:
                OmegaConf.update(cfg, key, value, merge=True)
        if mode is not None:  # mode=async with max_staleness 0 ran as sync
            cfg.async_training = mode == "async" and cfg.buffer.max_staleness > 0
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except (ValueError, TypeError, OmegaConfBaseException, FileNotFoundError) as exc:
        raise SystemExit(f"bad config{f' {path}' if path else ''}: {exc}") from None


def document_run_config(parser: argparse.ArgumentParser) -> None:
    """`--help` ends with every `key=value` a run takes, its default and its help."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "every key (default): what it does\n" + "\n".join(describe_config(RunConfig))
