"""HF model config -> the Megatron-Core model description (`BridgeConfig`).

Why a plain dataclass between the two: the weight mapping (weights.py, convert.py) needs only the
shapes. Keeping them free of Megatron lets `slimish convert` run without the ~12 s Megatron
import. `transformer_config()` and `gpt_model_kwargs()` build the Megatron objects when a model
is really built.

The mapping covers Llama, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm, free head_dim), Qwen3-MoE
(top-k softmax router, no shared expert) and Qwen2-MoE (qkv bias, top-k weights not renormalised,
a shared expert scaled by `sigmoid(x . gate)`, Megatron's `moe_shared_expert_gate`). A feature it does not map raises ValueError naming the
HF config field, because silently dropping it would give a different model.

`spec` picks the layer spec, which decides the Megatron tensor names (weights.py): `local`
(Megatron-Core modules, torch norms; what runs on CPU) or `te` (Transformer Engine, GPU only; it
fuses each pre-norm into the linear layer after it). MoE uses SequentialMLP experts under both;
expert parallelism (`ep_size`) places experts `ep_rank*E/ep ..` on each rank (weights.py). Megatron refuses MoE *training* at TP>1 without sequence parallelism,
which neither spec turns on here. So MoE trains at TP=1 only; the forward pass works at any TP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
SPECS = ("local", "te")

# Megatron's llama3 RoPE scaling hard-codes these (rotary_pos_embedding.py `_apply_scaling`);
# only `factor` is a GPTModel argument.
_MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class BridgeConfig:
    """The shapes and options that define one HF model in Megatron terms (independent of TP/PP)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling_factor: float | None = None  # llama3-style scaling, None = plain RoPE
    num_experts: int | None = None
    moe_topk: int = 0
    moe_ffn_hidden_size: int | None = None
    norm_topk_prob: bool = False
    shared_expert_ffn: int | None = None  # a gated shared expert's width (Qwen2-MoE), None = none
    make_vocab_size_divisible_by: int = 128
    spec: str = "local"  # the layer spec: local (Megatron-Core modules) | te (Transformer Engine)

    def __post_init__(self) -> None:
        if self.spec not in SPECS:
            raise ValueError(f"spec must be one of {SPECS} (the layer spec), got {self.spec!r}")

    def padded_vocab_size(self, tp_size: int) -> int:
        """Megatron's embedding rows: the vocab rounded up so that every TP rank gets an equal slice."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple

    def check_parallel(self, tp_size: int, pp_size: int, ep_size: int = 1) -> None:
        """Raise if the model cannot be split this way (before any Megatron object is built)."""
        if tp_size < 1 or pp_size < 1 or ep_size < 1:
            raise ValueError(f"tp, pp and ep sizes must be >= 1, got tp={tp_size}, pp={pp_size}, ep={ep_size}")
        if ep_size > 1 and (not self.num_experts or self.num_experts % ep_size):
            raise ValueError(
                f"expert parallelism ep={ep_size} needs a MoE model whose num_experts ({self.num_experts}) it divides"
            )
        if self.num_query_groups % tp_size:
            raise ValueError(
                f"num_key_value_heads={self.num_query_groups} must be divisible by tp_size={tp_size} "
                "(replicated KV heads are not mapped)"
            )
        if self.num_layers % pp_size:
            raise ValueError(f"num_hidden_layers={self.num_layers} must be divisible by pp_size={pp_size}")
        ffn = self.moe_ffn_hidden_size if self.num_experts else self.ffn_hidden_size
        if ffn % tp_size:
            raise ValueError(f"ffn hidden size {ffn} must be divisible by tp_size={tp_size}")

    def transformer_config(
        self, tp_size: int = 1, pp_size: int = 1, dtype: torch.dtype = torch.float32, ep_size: int = 1, **overrides: Any
    ):
        """The Megatron `TransformerConfig` for this model. Training options go in `overrides`
        (e.g. `recompute_granularity`, `attention_dropout`)."""
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        self.check_parallel(tp_size, pp_size, ep_size)
        kwargs: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim,
            ffn_hidden_size=self.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=self.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            use_cpu_initialization=True,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            tensor_model_parallel_size=tp_size,
            pipeline_model_parallel_size=pp_size,
            sequence_parallel=False,  # the local spec's torch norms cannot do SP; off under te too
        )
        if self.num_experts:
            kwargs.update(
                num_moe_experts=self.num_experts,
                moe_router_topk=self.moe_topk,
                moe_ffn_hidden_size=self.moe_ffn_hidden_size,
                # HF: softmax over all experts, then top-k (renormalised if norm_topk_prob).
                # Megatron: pre_softmax=False takes top-k logits then softmaxes them, which equals
                # the renormalised form.
                moe_router_pre_softmax=not self.norm_topk_prob,
                moe_router_score_function="softmax",
                moe_router_load_balancing_type="none",  # HF adds no aux loss unless output_router_logits
                moe_aux_loss_coeff=0.0,
                moe_grouped_gemm=False,
                moe_token_dispatcher_type="allgather",  # alltoall needs CUDA streams
                moe_router_fusion=False,  # the fused router skips RouterReplay
                expert_model_parallel_size=ep_size,
            )
        if self.shared_expert_ffn:
            kwargs.update(moe_shared_expert_intermediate_size=self.shared_expert_ffn, moe_shared_expert_gate=True)
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def layer_spec(self):
        """Megatron's layer spec named by `spec`; SequentialMLP experts for MoE (no grouped GEMM)."""
        from megatron.core.models.gpt import gpt_layer_specs

        if self.spec == "local":
            return gpt_layer_specs.get_gpt_layer_local_spec(
                num_experts=self.num_experts, moe_grouped_gemm=False, qk_layernorm=self.qk_norm, normalization="RMSNorm"
            )
        if not gpt_layer_specs.HAVE_TE:  # megatron-core sets it when `import transformer_engine` works
            raise ValueError(
                "spec='te' (trainer.megatron_spec in a run) needs Transformer Engine, which does not "
                "import here: pip install transformer-engine[pytorch] on a CUDA machine, or use 'local'"
            )
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=self.num_experts, moe_grouped_gemm=False, qk_layernorm=self.qk_norm
        )

    def gpt_model_kwargs(self, tp_size: int = 1) -> dict[str, Any]:
        """GPTModel arguments besides config / spec / pre_process / post_process."""
        kwargs: dict[str, Any] = dict(
            vocab_size=self.padded_vocab_size(tp_size),
            max_sequence_length=self.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=self.rope_theta,
            share_embeddings_and_output_weights=self.tie_word_embeddings,
        )
        if self.rope_scaling_factor is not None:
            kwargs.update(rope_scaling=True, rope_scaling_factor=self.rope_scaling_factor)
        return kwargs


def _rope(hf: Any) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None) from transformers 5 `rope_parameters` or the old fields."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise ValueError("config has neither rope_parameters['rope_theta'] nor rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        for key, expected in _MCORE_LLAMA3_ROPE.items():
            if float(params.get(key, -1)) != expected:
                raise ValueError(
                    f"rope_parameters[{key!r}]={params.get(key)!r}: Megatron's llama3 RoPE scaling only supports {expected}"
                )
        return float(theta), float(params["factor"])
    raise ValueError(f"rope_parameters['rope_type']={rope_type!r} is not supported (expected 'default' or 'llama3')")


def _require(hf: Any, field: str, expected: Any) -> None:
    value = getattr(hf, field, expected)
    if value != expected:
        raise ValueError(f"{hf.model_type} config {field}={value!r} is not supported (expected {expected!r})")


def from_hf(hf: Any, make_vocab_size_divisible_by: int = 128, spec: str = "local") -> BridgeConfig:
    """Map a transformers `PretrainedConfig` (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE) to a BridgeConfig."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported (expected one of {SUPPORTED_MODEL_TYPES})")
    _require(hf, "hidden_act", "silu")
    _require(hf, "mlp_bias", False)
    _require(hf, "use_sliding_window", False)
    if model_type not in ("qwen2", "qwen2_moe"):  # q/k/v bias (qkv_bias below), never o_proj bias
        _require(hf, "attention_bias", False)
    partial = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"rope_parameters['partial_rotary_factor']={partial!r} is not supported (expected 1.0)")
    theta, rope_factor = _rope(hf)
    moe: dict[str, Any] = {}
    if model_type in ("qwen3_moe", "qwen2_moe"):
        _require(hf, "decoder_sparse_step", 1)
        _require(hf, "mlp_only_layers", [])
        moe = dict(
            num_experts=hf.num_experts,
            moe_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            norm_topk_prob=bool(hf.norm_topk_prob),
            shared_expert_ffn=getattr(hf, "shared_expert_intermediate_size", None) or None,
        )
    return BridgeConfig(
        model_type=model_type,
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        rope_theta=theta,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        qkv_bias=model_type == "qwen2" or bool(getattr(hf, "qkv_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_scaling_factor=rope_factor,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        spec=spec,
        **moe,
    )


def load_hf_config(hf_dir: str | Path, make_vocab_size_divisible_by: int = 128, spec: str = "local") -> BridgeConfig:
    """`from_hf` of the config.json in `hf_dir`."""
    from transformers import AutoConfig

    return from_hf(AutoConfig.from_pretrained(hf_dir), make_vocab_size_divisible_by, spec)
