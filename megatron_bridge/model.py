"""Build a Megatron-Core GPTModel for the current parallel state and fill it from an HF checkpoint.

Why here and not in the trainer: the model's shape, its layer spec and its weight layout are all
decided by the bridge. A trainer only chooses TP/PP (`initialize_model_parallel`) and the dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_bridge import cpu
from megatron_bridge.config import BridgeConfig, load_hf_config
from megatron_bridge.hf_io import hf_tensors
from megatron_bridge.weights import hf_to_megatron, stage_params


def build_model(
    cfg: BridgeConfig,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    layer_spec: Any = None,
    **config_overrides: Any,
):
    """An (unloaded) GPTModel holding this rank's TP/PP/EP shard; needs `initialize_model_parallel` first.

    Every parameter is on this rank's device (the current CUDA device, else the CPU) in `dtype`,
    as Megatron's own `get_model` leaves them (`.cuda()`, then bf16/fp16): the local spec's torch
    norms are built on the CPU in fp32 whatever the config says, and on a GPU Megatron's bf16/fp16
    optimizer refuses CPU parameters. Buffers keep their dtype (the MoE router's fp32 counters).

    Seeds Megatron's RNG tracker (`model_parallel_cuda_manual_seed(seed)`), which dropout and init
    need. `layer_spec` replaces `cfg.layer_spec()`; its tensor names must be those of `cfg.spec`
    (the tests build a CPU stand-in of the `te` spec this way). `config_overrides` go to
    `TransformerConfig` (recompute, dropout...).
    """
    cpu.apply()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    model_parallel_cuda_manual_seed(seed)
    # The weights are loaded right after, so skip the random init; on CPU Megatron must build there.
    overrides = {"use_cpu_initialization": not torch.cuda.is_available(), "perform_initialization": False}
    overrides.update(config_overrides)
    model = GPTModel(
        config=cfg.transformer_config(tp, pp, dtype, ep, **overrides),
        transformer_layer_spec=cfg.layer_spec() if layer_spec is None else layer_spec,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **cfg.gpt_model_kwargs(tp),
    )
    model.to(torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)  # the same Parameter: Megatron's attributes stay on it
    if not overrides["perform_initialization"]:
        _mark_tensor_parallel(model, cfg, parallel_state.get_pipeline_model_parallel_rank(), pp, ep)
    return model


def _mark_tensor_parallel(model: torch.nn.Module, cfg: BridgeConfig, pp_rank: int, pp_size: int, ep_size: int) -> None:
    """Tag the TP-sharded weights as Megatron's init would have (`tensor_model_parallel`,
    `partition_dim`): without `perform_initialization` Megatron skips that, and its grad norm
    (so clipping) then counts only TP rank 0's shards of them. Biases are tagged already."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    params = dict(model.named_parameters())
    for p in stage_params(cfg, pp_rank, pp_size, 0, ep_size):  # local names: the same on every EP rank
        param = params.get(p.megatron)
        if p.kind != "replicated" and param is not None and not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=1 if p.kind == "row" else 0, stride=1)


def load_hf_weights(model: torch.nn.Module, cfg: BridgeConfig, hf_dir: str | Path) -> None:
    """Copy this rank's shard of the HF checkpoint in `hf_dir` into `model`: every key, except the
    weightless `_extra_state` of Transformer Engine modules, must be filled and known."""
    from megatron.core import parallel_state

    with hf_tensors(hf_dir) as get:
        state = hf_to_megatron(
            get,
            cfg,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
            ep_rank=parallel_state.get_expert_model_parallel_rank(),
            ep_size=parallel_state.get_expert_model_parallel_world_size(),
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"the spec={cfg.spec!r} name table does not fit this model: "
            f"not filled {missing[:5]}, not in the model {unexpected[:5]}"
        )


def load_model(
    hf_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    spec: str = "local",
    **config_overrides: Any,
) -> tuple[torch.nn.Module, BridgeConfig]:
    """The GPTModel of this rank with the weights of `hf_dir`, and its BridgeConfig."""
    cfg = load_hf_config(hf_dir, make_vocab_size_divisible_by, spec)
    model = build_model(cfg, dtype, **config_overrides)
    load_hf_weights(model, cfg, hf_dir)
    return model, cfg
