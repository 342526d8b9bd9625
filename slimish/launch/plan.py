"""Where a run's trainer ranks and engines go, whether its sizes divide, and what each GPU holds:
what `slimish train --dry-run` prints without starting anything, and the placement the launcher
uses (`engine_gpus`), so the two cannot disagree.

Placement on rank 0's node (`launch.mode: local`): trainer rank r on GPU r (torchrun's
LOCAL_RANK); GPU engines after the trainer's GPUs, `tp` consecutive GPUs each, as slime places
its engines (`--base-gpu-id` per engine). A `--base-gpu-id` in `launch.sglang_args` (or
`device=cuda:K` for a built-in engine) places them instead, sharing the trainer's GPUs if told.
Under `launch.mode: ray` each engine gets the GPUs of its Ray bundle, on whichever node Ray picks.

Memory per GPU counts what a run keeps for its whole life: weights, gradients and optimiser
states on a trainer rank; weights and the KV cache on an engine. Activations, CUDA graphs and
allocator slack are not counted: leave room for them.

Model shapes are megatron_bridge's `BridgeConfig` (Llama, Qwen2, Qwen3, Qwen3-MoE), read from
a config.json: no weights are loaded. Everything here but `model_source`/`load_model` is a pure
function of the run's config and that shape.
"""

from __future__ import annotations

import shlex
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slimish.launch.commands import (
    engine_command,
    engine_flags,
    run_launch,
    teacher_launch_config,
)
from slimish.launch.cpus import cpu_placement
from slimish.launch.sglang import flag_value, sglang_tp

if TYPE_CHECKING:
    from megatron_bridge.config import BridgeConfig
    from slimish.config import RunConfig
    from slimish.engine.config import EngineConfig
    from slimish.launch.config import LaunchConfig

GIB = float(1 << 30)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# Bytes a trained parameter keeps beside its weight: an fp32 gradient, Adam's fp32 m and v, and
# an fp32 main copy when the weights are not fp32. Megatron (slimish/trainer/megatron_backend.py)
# keeps its weights in trainer.dtype with fp32 main weights and gradients; the torch backend keeps
# every weight, frozen ones too, in fp32 and runs its forward under autocast to trainer.dtype.
GRAD_BYTES, MASTER_BYTES, ADAM_BYTES = 4, 4, 8
LORA_SHAPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Machine:
    """The GPU nodes a plan is for: this machine's when it has GPUs, else what the user says."""

    gpus_per_node: int
    gpu_memory_gib: float
    assumed: bool = False  # no GPU here: the numbers are the dry run's flags (or their defaults)


ASSUMED = Machine(
    gpus_per_node=8, gpu_memory_gib=80.0, assumed=True
)  # a dry run's nodes when it runs on none: 8 x 80 GiB (H100)

# ---- the model ------------------------------------------------------------------------------


def layer_params(m: "BridgeConfig") -> int:
    """Parameters of one decoder layer: attention (q/k/v/o, a qkv bias, q/k norms), the MLP (or
    every expert and the router), two norms."""
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    attn = 2 * h * q + 2 * h * kv + (q + 2 * kv if m.qkv_bias else 0) + (2 * m.head_dim if m.qk_norm else 0)
    mlp = m.num_experts * (3 * h * m.moe_ffn_hidden_size + h) if m.num_experts else 3 * h * m.ffn_hidden_size
    return attn + mlp + 2 * h


def stage_params(m: "BridgeConfig", pp: int) -> list[int]:
    """Parameters on each pipeline stage: its layers, the embedding on the first, the final norm
    and output layer on the last (tied embeddings: a second copy there when pp > 1, as Megatron
    keeps)."""
    embed = m.vocab_size * m.hidden_size
    stages = [m.num_layers // pp * layer_params(m)] * pp
    stages[0] += embed
    stages[-1] += m.hidden_size + (embed if not m.tie_word_embeddings or pp > 1 else 0)
    return stages


def model_params(m: "BridgeConfig") -> int:
    return stage_params(m, 1)[0]


def lora_params(m: "BridgeConfig", rank: int, targets: list[str]) -> int:
    """Adapter parameters: rank x (in + out) for each targeted linear layer of every layer."""
    h, q, kv, f = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim, m.ffn_hidden_size
    sizes = dict(zip(LORA_SHAPES, (h + q, h + kv, h + kv, q + h, h + f, h + f, f + h)))
    names = LORA_SHAPES if {"all", "all-linear"} & set(targets) else targets
    return m.num_layers * sum(rank * sizes[n] for n in names if n in sizes)


def kv_bytes_per_token(m: "BridgeConfig", tp: int, dtype_bytes: int) -> int:
    """KV cache per token on one of an engine's GPUs: K and V of every layer for the KV heads
    that GPU holds (SGLang replicates them when tp exceeds their number)."""
    return 2 * m.num_layers * max(1, m.num_query_groups // tp) * m.head_dim * dtype_bytes


def model_source(model: str, config_path: str | None) -> Path:
    """The directory whose config.json describes `model`: `model` itself when it is a local
    checkpoint, else configs/models/<its last path part>/ beside the run's YAML, which a recipe
    ships so that its dry run needs neither the checkpoint nor a download."""
    if (Path(model) / "config.json").is_file():
        return Path(model)
    shipped = Path(config_path or ".").parent / "models" / Path(model).name
    if (shipped / "config.json").is_file():
        return shipped
    raise ValueError(
        f"model: no config.json in {model} nor in {shipped} (the dry run reads the architecture from one of them)"
    )


def load_model(source: Path) -> "BridgeConfig":
    """The shape in `source`/config.json; a model megatron_bridge does not map fails naming the field."""
    from megatron_bridge.config import load_hf_config

    return load_hf_config(source)


# ---- placement ------------------------------------------------------------------------------


def first_free_gpu(cfg: "RunConfig", cuda: bool) -> int:
    """The first GPU of rank 0's node no trainer rank uses: one GPU per local rank on a CUDA
    machine (slimish/trainer/*_backend.py), none on CPU. Colocated (`launch.colocate`), the
    engines go on the trainer's GPUs: from GPU 0."""
    return cfg.trainer.nproc if cuda and not cfg.launch.colocate else 0


def engine_gpus(launch: "LaunchConfig", first_gpu: int) -> list[tuple[int, ...]]:
    """Each engine's GPU ids on rank 0's node, in launch order: `tp` consecutive GPUs per SGLang
    engine from `--base-gpu-id` in launch.sglang_args when given, else from `first_gpu`; one each
    for built-in engines with device=cuda (device=cuda:K keeps them all on K). Empty for CPU and
    external engines, and under Ray (the bundle's GPUs are the engine's)."""
    from slimish.engine.config import EngineConfig

    if launch.engine_kind == "external":
        return []
    if launch.mode == "ray":
        return [()] * launch.engines
    if launch.engine_kind == "sglang":
        tp, base = sglang_tp(launch.sglang_args), flag_value(launch.sglang_args, "--base-gpu-id")
        first = first_gpu if base is None else int(base)
        return [tuple(range(first + i * tp, first + (i + 1) * tp)) for i in range(launch.engines)]
    device = str(engine_flags(launch.engine_flag).get("device", EngineConfig.device))
    if device == "cuda":
        return [(first_gpu + i,) for i in range(launch.engines)]
    return [(int(device.partition(":")[2]),) if device.startswith("cuda:") else ()] * launch.engines


def next_gpu(launch: "LaunchConfig", first_gpu: int) -> int:
    """The first GPU after `launch`'s engines placed from `first_gpu` (not before it): where the
    next engines, the teacher's, start."""
    return max([first_gpu, *(g + 1 for ids in engine_gpus(launch, first_gpu) for g in ids)])


def engines_tp(launch: "LaunchConfig") -> int:
    return sglang_tp(launch.sglang_args) if launch.engine_kind == "sglang" else 1


def check_placement(
    launch: "LaunchConfig", nproc: int, first_gpu: int, gpus_per_node: int, teacher: "LaunchConfig | None" = None
) -> None:
    """Every trainer rank (`nproc`, on GPUs below `first_gpu`) and local engine on a GPU the node
    has; an engine's GPUs on one node."""
    if first_gpu and nproc > gpus_per_node:
        raise ValueError(
            f"trainer.nproc ({nproc}) exceeds the node's {gpus_per_node} GPUs: torchrun starts every rank on rank 0's node"
        )
    if launch.mode == "ray" and engines_tp(launch) > gpus_per_node:
        raise ValueError(
            f"launch.sglang_args --tp-size {engines_tp(launch)}: one engine's GPUs must be on one node of {gpus_per_node} GPUs"
        )
    groups = [("launch", launch, first_gpu)] + (
        [("launch.teacher", teacher, next_gpu(launch, first_gpu))] if teacher else []
    )
    for name, lc, first in groups:
        for i, gpus in enumerate(engine_gpus(lc, first)):
            if gpus and max(gpus) >= gpus_per_node:
                raise ValueError(
                    f"{name}.engines: engine {i} would use GPU {max(gpus)} but the node has {gpus_per_node} "
                    f"(GPUs 0-{gpus_per_node - 1}): {lc.engines} engines x tp {engines_tp(lc)} from GPU {first} "
                    f"after trainer.nproc={nproc} trainer GPUs; use fewer engines or GPUs each, or place them "
                    "with --base-gpu-id in launch.sglang_args"
                )


# ---- sizes ----------------------------------------------------------------------------------


def check_sizes(cfg: "RunConfig", m: "BridgeConfig") -> None:
    """The parallel sizes divide the model and the trainer's ranks; each error names the field."""
    t = cfg.trainer
    if t.backend == "megatron":
        if t.nproc % (t.tp * t.pp):
            raise ValueError(
                f"trainer.nproc ({t.nproc}) must be a multiple of trainer.tp x trainer.pp ({t.tp} x {t.pp}): "
                "the data-parallel size is the quotient"
            )
        try:
            m.check_parallel(t.tp, t.pp)
        except ValueError as exc:
            raise ValueError(f"trainer.tp={t.tp}, trainer.pp={t.pp}: {exc}") from None
        if m.num_experts and t.tp > 1:
            raise ValueError(
                f"trainer.tp={t.tp} with an MoE model (num_experts={m.num_experts}): Megatron trains MoE at TP > 1 "
                "only with sequence parallelism, which megatron_bridge leaves off; split it with trainer.pp"
            )
    if cfg.launch.engine_kind == "sglang":
        check_sglang_sizes(cfg.launch.sglang_args, m)


def check_sglang_sizes(args: list[str], m: "BridgeConfig") -> None:
    """SGLang's splits of the model: heads by --tp-size, KV heads split or replicated, experts by --ep-size."""
    tp, ep = sglang_tp(args), int(flag_value(args, "--ep-size", "--expert-parallel-size", "--ep") or 1)
    where = f"launch.sglang_args --tp-size {tp}"
    if m.num_attention_heads % tp:
        raise ValueError(f"{where}: num_attention_heads={m.num_attention_heads} must be divisible by it")
    if m.num_query_groups % tp and tp % m.num_query_groups:
        raise ValueError(f"{where}: num_key_value_heads={m.num_query_groups} must divide it or be divisible by it")
    if ep > 1 and (not m.num_experts or m.num_experts % ep or tp % ep):
        raise ValueError(
            f"launch.sglang_args --ep-size {ep}: needs an MoE model whose num_experts ({m.num_experts}) it divides, "
            f"and must divide --tp-size ({tp})"
        )


def teacher_launch(cfg: "RunConfig") -> "LaunchConfig | None":
    """The teacher's own engines (on-policy distillation), when the run starts them."""
    t = cfg.launch.teacher
    return teacher_launch_config(cfg.launch) if cfg.algorithm.opd.coef > 0 and t.model and not t.router_url else None


# ---- memory ---------------------------------------------------------------------------------

Part = tuple[str, float]  # (what, GiB)


def trainer_memory(cfg: "RunConfig", m: "BridgeConfig") -> list[Part]:
    """One trainer rank: its share of the weights (Megatron: the heaviest pipeline stage over
    TP), and gradients, main weights and Adam states of what it trains (LoRA: the adapter only);
    a frozen reference copy with kl_coef > 0, the critic's own with advantage=gae."""
    t = cfg.trainer
    megatron = t.backend == "megatron"
    held = max(stage_params(m, t.pp)) / t.tp if megatron else model_params(m)
    trained = lora_params(m, t.lora.rank, list(t.lora.target_modules)) if t.lora.enabled else held
    weight = DTYPE_BYTES[t.compute_dtype("cuda")] if megatron else 4
    parts = [("weights", (held + (trained if t.lora.enabled else 0)) * weight), ("grads", trained * GRAD_BYTES)]
    if weight != 4:
        parts.append(("fp32 main weights", trained * MASTER_BYTES))
    parts.append(("Adam", trained * ADAM_BYTES))
    if cfg.algorithm.kl_coef > 0 and not t.lora.enabled:  # LoRA's reference is the base with the adapter off
        parts.append(("reference", held * weight))
    if cfg.algorithm.advantage == "gae":
        parts.append(("critic", held * (weight + GRAD_BYTES + ADAM_BYTES + (MASTER_BYTES if weight != 4 else 0))))
    return [(what, n / GIB) for what, n in parts]


def builtin_engine_config(launch: "LaunchConfig", model: str) -> "EngineConfig":
    """The built-in engine's settings from launch.engine_flag, validated as `slimish engine` would."""
    from omegaconf import OmegaConf

    from slimish.engine.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    flags = {
        k: [v] if typing.get_origin(hints.get(k)) is list and not isinstance(v, list) else v
        for k, v in engine_flags(launch.engine_flag).items()
    }
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EngineConfig), {"model": model, **flags}))  # type: ignore[return-value]


def engine_memory(launch: "LaunchConfig", m: "BridgeConfig", model: str, gpu_gib: float) -> tuple[list[Part], str]:
    """One GPU of one engine: its share of the weights and its KV cache, and a note on the KV
    figure. SGLang: the KV pool is what --mem-fraction-static leaves beside the weights. The
    built-in engine: its bound, max_running_requests full contexts plus the prefix cache."""
    if launch.engine_kind == "sglang":
        args, tp = launch.sglang_args, sglang_tp(launch.sglang_args)
        dtype = flag_value(args, "--dtype") or "bfloat16"
        weight = DTYPE_BYTES.get(dtype, 2)
        weights = model_params(m) * weight / tp / GIB
        fraction = flag_value(args, "--mem-fraction-static")
        if fraction is None:
            return [("weights", weights)], "KV cache: SGLang sizes it (give --mem-fraction-static for a figure)"
        kv = float(fraction) * gpu_gib - weights
        if kv <= 0:
            raise ValueError(
                f"launch.sglang_args --mem-fraction-static {fraction}: {float(fraction) * gpu_gib:.1f} of {gpu_gib:g} GiB "
                f"leaves no KV cache beside {weights:.1f} GiB of weights per GPU; raise it or --tp-size"
            )
        kv_dtype = flag_value(args, "--kv-cache-dtype") or "auto"
        tokens = kv * GIB / kv_bytes_per_token(m, tp, 1 if kv_dtype.startswith("fp8") else weight)
        return [("weights", weights), ("KV cache", kv)], f"mem_fraction_static {fraction}: {tokens / 1e3:,.0f}k tokens"
    ec = builtin_engine_config(launch, model)
    weight = DTYPE_BYTES[ec.dtype]
    context = ec.context_length or m.max_position_embeddings
    tokens = ec.max_running_requests * context + (0 if ec.disable_radix_cache else ec.radix_cache_max_tokens)
    kv = tokens * kv_bytes_per_token(m, 1, weight) / GIB
    return [("weights", model_params(m) * weight / GIB), ("KV cache", kv)], (
        f"at most {ec.max_running_requests} x {context} tokens + {0 if ec.disable_radix_cache else ec.radix_cache_max_tokens} cached"
    )


def billions(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def total(parts: list[Part]) -> float:
    return sum(gib for _, gib in parts)


def show(parts: list[Part]) -> str:
    return " + ".join(f"{what} {gib:.1f}" for what, gib in parts)


# ---- the plan -------------------------------------------------------------------------------

Use = tuple[str, list[Part], str]  # who, what it holds, a note on the figure


def describe(
    cfg: "RunConfig", m: "BridgeConfig", source: Path, machine: Machine, cpus: tuple[int, ...] = ()
) -> list[str]:
    """The plan as lines of text; raises ValueError (naming the field) when a size does not
    divide, a GPU is missing, or a GPU's memory does not hold what is put on it. With `cpus`
    (rank 0's usable CPUs), where the trainer and the local engines run on them
    (slimish/launch/cpus.py)."""
    t, teacher = cfg.trainer, teacher_launch(cfg)
    launch = run_launch(cfg)
    placement = cpu_placement(cfg, cpus) if cpus else None
    first = first_free_gpu(cfg, cuda=True)
    check_sizes(cfg, m)
    check_placement(launch, t.nproc, first, machine.gpus_per_node, teacher)
    experts = f", {m.num_experts} experts (top {m.moe_topk})" if m.num_experts else ""
    parallel = f" = tp {t.tp} x pp {t.pp} x dp {t.nproc // (t.tp * t.pp)}" if t.backend == "megatron" else ""
    lines = [
        f"model {cfg.model}: {m.model_type} ({source / 'config.json'}), {billions(model_params(m))} parameters, "
        f"{m.num_layers} layers, {m.num_attention_heads} attention heads, {m.num_query_groups} KV heads{experts}",
        f"GPUs: {machine.gpus_per_node} per node, {machine.gpu_memory_gib:g} GiB each"
        + (" (assumed, this machine has none: --gpus-per-node, --gpu-memory-gib)" if machine.assumed else ""),
        f"trainer: {t.backend}, trainer.nproc {t.nproc}{parallel}, {t.compute_dtype('cuda')}"
        + (", LoRA" if t.lora.enabled else ""),
        *(f"  trainer rank {r}: node 0 GPU {r}" for r in range(t.nproc)),
    ]
    on_gpu: dict[int, list[Use]] = {r: [(f"trainer rank {r}", trainer_memory(cfg, m), "")] for r in range(t.nproc)}
    on_ray: list[Use] = []
    commands = []
    groups = [("engine", launch, cfg.model, first)]
    if teacher:
        groups.append(("teacher engine", teacher, str(cfg.launch.teacher.model), next_gpu(launch, first)))
    for who, lc, model, start in groups:
        lines.append(f"{who}s: {lc.engines} x {lc.engine_kind}, tp {engines_tp(lc)}, launch.mode {lc.mode}")
        for i, gpus in enumerate(engine_gpus(lc, start)):
            name = f"{who} {i}"
            if lc.mode == "ray":
                lines.append(
                    f"  {name}: a Ray bundle of {lc.engine_gpus:g} GPUs ({lc.placement_strategy}), on the node Ray picks"
                )
            else:
                lines.append(
                    f"  {name}: node 0 "
                    + (f"GPU{'s' * (len(gpus) > 1)} {', '.join(map(str, gpus))}" if gpus else "cpu")
                )
            threads = placement.engines[i].threads if placement and placement.engines and who == "engine" else 0
            host = "NODE_IP" if lc.mode == "ray" else "127.0.0.1"
            module, argv = engine_command(lc, model, host, "PORT", gpus, threads)
            commands.append(f"  {name}: python -m {module} {shlex.join(argv)}")
            if who == "engine" and (gpus or (lc.mode == "ray" and lc.engine_gpus)):  # the teacher is another model
                parts, note = engine_memory(lc, m, model, machine.gpu_memory_gib)
                for gpu in gpus:
                    on_gpu.setdefault(gpu, []).append((name, parts, note))
                if not gpus:
                    on_ray.append((name, parts, note))
    ws = cfg.weight_sync
    sync = f" over {ws.backend or 'nccl'}, master_address {ws.master_address}, {1 + launch.engines * engines_tp(launch)} ranks"
    how = ws.transport + (sync if ws.transport == "distributed" else "")
    if cfg.launch.colocate and launch.engine_kind == "sglang":
        how = "colocated on the trainer's GPU: memory released while training, CUDA IPC handles (docs/colocate.md)"
    elif cfg.launch.colocate:
        how = "colocated: one shared weight store, a push is a version flip (docs/colocate.md)"
    return [
        *lines,
        "memory per GPU, GiB (activations, CUDA graphs and allocator slack not counted):",
        *memory_lines(on_gpu, on_ray, machine.gpu_memory_gib, t.nproc),
        "weight sync: " + how,
        *(placement.lines() if placement else []),
        "command lines (PORT: a free port picked at start):",
        *commands,
    ]


def memory_lines(on_gpu: dict[int, list[Use]], on_ray: list[Use], gpu_gib: float, nproc: int) -> list[str]:
    """A line per GPU of rank 0's node and per Ray engine; a GPU holding more than it has fails,
    naming the fields that would make room."""
    lines = []
    for gpu, uses in sorted(on_gpu.items()):
        gib = sum(total(parts) for _, parts, _ in uses)
        held = "; ".join(f"{who}: {show(parts)}" + (f" ({note})" if note else "") for who, parts, note in uses)
        lines.append(f"  node 0 GPU {gpu}: {held} = {gib:.1f} of {gpu_gib:g}")
        if gib > gpu_gib:
            fixes = (
                ["raise trainer.tp / trainer.pp (Megatron) or train a LoRA adapter (trainer.lora)"]
                if gpu < nproc
                else []
            )
            if len(uses) > 1 or gpu >= nproc:
                fixes.append(
                    "give engines other GPUs or less memory (launch.sglang_args --base-gpu-id, --tp-size, --mem-fraction-static; "
                    "launch.engine_flag max_running_requests, context_length)"
                )
            raise ValueError(
                f"node 0 GPU {gpu} would hold {gib:.1f} GiB ({', '.join(who for who, _, _ in uses)}) of its {gpu_gib:g}: "
                + "; ".join(fixes)
            )
    return lines + [
        f"  each GPU of {who}: {show(parts)} ({note}) = {total(parts):.1f} of {gpu_gib:g}"
        for who, parts, note in on_ray
    ]
