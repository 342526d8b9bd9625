"""megatron_bridge: HF <-> Megatron-Core on real torchrun/gloo processes, CPU only.

One torchrun launch (tests/megatron_worker.py, 2 ranks) runs every Megatron check: TP=1, TP=2
and PP=2 for llama, llama with llama3 RoPE scaling, qwen2, qwen3, Qwen3-MoE and (TP=1) Qwen2-MoE, and the
Transformer Engine spec's name table on a CPU stand-in of that spec. The tests below assert on
its JSON results. Conversion and config mapping need no Megatron import and run here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# find_spec, not importorskip: importing Megatron here would cost this process ~12 s for nothing.
if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install -e '.[dev]')", allow_module_level=True)

from helpers import torchrun_ranks  # noqa: E402

from megatron_bridge.config import from_hf, load_hf_config  # noqa: E402
from megatron_bridge.convert import hf_to_shards, shards_to_hf  # noqa: E402
from megatron_bridge.weights import stage_params  # noqa: E402
from slimish.tiny_model import SIZES, make_tiny_model  # noqa: E402

WORKER = Path(__file__).with_name("megatron_worker.py")
ARCHS = ("llama", "llama3_rope", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
TP2_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
TE_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
TE_TP2_ARCHS = ("llama", "qwen3_moe")
TOL = 1e-5
BF16_TOL = 0.03  # bf16 logits of a tiny model against HF's fp32 ones (measured 0.005-0.008)


def _tiny_moe(path: Path, vocab_size: int) -> Path:
    """A tiny Qwen3-MoE (tiny_model has no MoE): 4 experts, top-2, renormalised like the real model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        **{
            k: SIZES["tiny"][k]
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        },
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def _llama3_rope(path: Path) -> Path:
    """Tiny llama whose config asks for llama3 RoPE scaling (long wavelengths are divided by `factor`).
    Over 1024 positions its HF logits differ from plain RoPE's by ~8e-4, 80x the test tolerance."""
    make_tiny_model(path, arch="llama", size="tiny")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    config["rope_parameters"] = dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def _random_norms(src: Path, dst: Path) -> Path:
    """`src` with every RMSNorm weight drawn at random: a fresh model's are all ones, which would
    hide a norm weight loaded into the wrong place."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mbridge")
    archs = ("llama", "qwen2", "qwen3", "qwen2_moe")  # qwen2_moe: a gated shared expert, qkv bias, raw top-k weights
    dirs = {arch: make_tiny_model(root / arch, arch=arch, size="tiny") for arch in archs}
    dirs["llama3_rope"] = _llama3_rope(root / "llama3_rope")
    dirs["qwen3_moe"] = _tiny_moe(root / "qwen3_moe", vocab_size=1000)
    return dirs


@pytest.fixture(scope="module")
def convert_shards(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`slimish convert hf-to-megatron` output of llama at TP=2 (the worker loads it per rank)."""
    out = tmp_path_factory.mktemp("shards") / "llama_tp2"
    _slimish(
        "convert", "hf-to-megatron", str(models["llama"]), str(out), "--tp", "2", "--make-vocab-size-divisible-by=100"
    )
    return out


def _slimish(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "slimish.cli", *argv], check=True, timeout=120, capture_output=True)


@pytest.fixture(scope="module")
def results(models: dict[str, Path], convert_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run the worker once on 2 ranks; merged {check: value} of both ranks (keys per rank: `r0:`, `r1:`)."""
    out = tmp_path_factory.mktemp("worker")
    spec = out / "spec.json"
    paths = {k: str(v) for k, v in models.items()}
    te_models = {arch: str(_random_norms(models[arch], out / f"{arch}_norms")) for arch in TE_ARCHS}
    spec.write_text(
        json.dumps(
            {
                "models": paths,
                "tp2": TP2_ARCHS,
                "te_models": te_models,
                "te_tp2": TE_TP2_ARCHS,
                "convert_shards": str(convert_shards),
            }
        )
    )
    merged: dict = {}
    for rank, data in torchrun_ranks(WORKER, [str(spec), str(out)], out).items():
        merged.update({f"r{rank}:{k}": v for k, v in data.items()})
    return merged


def _values(results: dict, check: str) -> list:
    """The value of `check` on every rank that ran it (at least one)."""
    found = [v for k, v in results.items() if k.split(":", 1)[1] == check]
    assert found, f"no rank reported {check}; got {sorted(results)}"
    return found


# Worker keys: `tp1/ARCH` on the local spec; `te_tp1/ARCH` is the te name table on the CPU
# stand-in of TE's spec, with random norm weights, so each norm must land in its place.
TP1_KEYS = [f"tp1/{a}" for a in ARCHS] + [f"te_tp1/{a}" for a in TE_ARCHS]
TP2_KEYS = [f"tp2/{a}" for a in TP2_ARCHS] + [f"te_tp2/{a}" for a in TE_TP2_ARCHS]


@pytest.mark.parametrize("key", TP1_KEYS)
def test_tp1_logits_match_hf(results: dict, key: str) -> None:
    assert max(_values(results, f"{key}/logits_diff")) < TOL


@pytest.mark.parametrize("key", TP1_KEYS)
def test_tp1_export_round_trip_is_exact(results: dict, key: str) -> None:
    assert _values(results, f"{key}/state_keys_ok") == [1]  # the mapping covers every GPTModel tensor
    assert _values(results, f"{key}/export_names_ok") == [1]
    assert _values(results, f"{key}/export_dtype_ok") == [1]
    assert _values(results, f"{key}/export_diff") == [0.0]


@pytest.mark.parametrize("key", [f"{spec}/{arch}" for spec in ("bf16", "te_bf16") for arch in ("qwen3", "qwen3_moe")])
def test_bf16_model_has_every_parameter_in_bf16(results: dict, key: str) -> None:
    """As Megatron's get_model leaves a model: the local spec's torch norms (input, pre-MLP, q/k,
    final) are built fp32 on the CPU, which Megatron's bf16 optimizer refuses on a GPU."""
    assert _values(results, f"{key}/param_dtypes") == [["torch.bfloat16"]]
    assert _values(results, f"{key}/param_devices") == [["cpu"]]
    assert _values(results, f"{key}/logits_dtype") == ["torch.bfloat16"]
    assert max(_values(results, f"{key}/logits_diff")) < BF16_TOL


@pytest.mark.parametrize("key", TP2_KEYS)
def test_tp2_logits_match_hf_with_padded_vocab(results: dict, key: str) -> None:
    assert max(_values(results, f"{key}/logits_diff")) < TOL
    expected_rows = 1000 if key.endswith("qwen3_moe") else 1200  # vocab rounded up to a multiple of 100 * TP
    assert _values(results, f"{key}/padded_vocab") == [expected_rows] * 2
    assert _values(results, f"{key}/padded_logits_max") == [0.0] * 2  # zero rows, stripped on export


@pytest.mark.parametrize("key", TP2_KEYS)
def test_tp2_export_gathers_exact_hf_tensors(results: dict, key: str) -> None:
    assert _values(results, f"{key}/state_keys_ok") == [1, 1]
    assert _values(results, f"{key}/export_names_ok") == [1, 1]
    assert _values(results, f"{key}/export_diff") == [0.0, 0.0]


def test_te_spec_without_transformer_engine_names_the_field(results: dict) -> None:
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed")
    assert (
        "spec='te' (trainer.megatron_spec in a run) needs Transformer Engine" in _values(results, "te_missing_error")[0]
    )


def test_te_name_table_fuses_the_dense_pre_norms(models: dict[str, Path]) -> None:
    """TE names (megatron-core gpt_layer_specs: linear_qkv and, for dense MLPs, linear_fc1 are
    TELayerNormColumnParallelLinear); MoE layers keep pre_mlp_layernorm."""
    names = {
        arch: {p.megatron: p.hf for p in stage_params(load_hf_config(models[arch], spec="te"))}
        for arch in ("llama", "qwen3_moe")
    }
    layer = "decoder.layers.1."
    assert names["llama"][layer + "self_attention.linear_qkv.layer_norm_weight"] == (
        "model.layers.1.input_layernorm.weight",
    )
    assert names["llama"][layer + "mlp.linear_fc1.layer_norm_weight"] == (
        "model.layers.1.post_attention_layernorm.weight",
    )
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names["llama"])
    assert names["qwen3_moe"][layer + "pre_mlp_layernorm.weight"] == ("model.layers.1.post_attention_layernorm.weight",)
    assert layer + "self_attention.linear_qkv.layer_norm_weight" in names["qwen3_moe"]
    with pytest.raises(ValueError, match="spec must be one of"):
        load_hf_config(models["llama"], spec="transformer_engine")


@pytest.mark.parametrize("arch", TP2_ARCHS)
def test_tp2_vocab_parallel_logprobs_match_hf(results: dict, arch: str) -> None:
    assert max(_values(results, f"tp2/{arch}/logprobs_diff")) < TOL


def test_vocab_parallel_logprobs_values_and_grads(results: dict) -> None:
    """Random logits, 37-token vocab padded to 40, split over 2 ranks: equal to full log_softmax."""
    assert max(_values(results, "logprobs_random/value_diff")) < TOL
    assert max(_values(results, "logprobs_random/grad_diff")) < TOL


def test_convert_shards_load_in_megatron(results: dict) -> None:
    assert max(_values(results, "tp2/convert_shards/logits_diff")) < TOL


def test_pp2_loss_and_grads_match_hf(results: dict) -> None:
    assert _values(results, "pp2/llama/loss_diff")[0] < TOL
    assert sum(_values(results, "pp2/llama/grad_names")) == 21  # every HF tensor, each on exactly one stage
    assert max(_values(results, "pp2/llama/grad_diff")) < TOL
    assert min(_values(results, "pp2/llama/grad_max")) > 1e-3  # the grads compared are not trivially zero


def test_pp2_optimizer_step_runs_on_cpu(results: dict) -> None:
    assert _values(results, "pp2/llama/optimizer_ok") == [1, 1]
    assert max(_values(results, "pp2/llama/grad_norm_diff")) < TOL  # norm over both stages = HF's
    assert min(_values(results, "pp2/llama/step_moved")) > 0


def test_pp2_tied_model_forward_and_export(results: dict) -> None:
    assert _values(results, "pp2/qwen3/logits_diff")[0] < TOL
    assert _values(results, "pp2/qwen3/export_names_ok") == [1, 1]
    assert _values(results, "pp2/qwen3/export_diff") == [0.0, 0.0]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_convert_round_trip_is_bitwise(models: dict[str, Path], tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    shards, back = tmp_path / "shards", tmp_path / "hf"
    hf_to_shards(models[arch], shards, tp=2, pp=2, make_vocab_size_divisible_by=100)
    assert sorted(p.name for p in shards.glob("*.pt")) == ["tp0_pp0.pt", "tp0_pp1.pt", "tp1_pp0.pt", "tp1_pp1.pt"]
    shards_to_hf(shards, back)
    original, restored = load_file(models[arch] / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(original) == sorted(restored)
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    a = AutoModelForCausalLM.from_pretrained(models[arch]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(back).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_convert_cli_round_trip(models: dict[str, Path], convert_shards: Path, tmp_path: Path) -> None:
    _slimish("convert", "megatron-to-hf", str(convert_shards), str(tmp_path / "hf"))
    original, restored = (
        load_file(models["llama"] / "model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    assert sorted(original) == sorted(restored) and all(torch.equal(original[k], restored[k]) for k in original)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == json.loads((models["llama"] / "config.json").read_text())


def test_convert_needs_no_megatron_import(models: dict[str, Path], tmp_path: Path) -> None:
    code = (
        "import sys; from megatron_bridge.convert import hf_to_shards; "
        f"hf_to_shards({str(models['qwen2'])!r}, {str(tmp_path / 's')!r}, tp=2); "
        "assert 'megatron.core' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_megatron_to_hf_rejects_a_foreign_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        shards_to_hf(tmp_path, tmp_path / "out")


def test_config_maps_the_model_families(models: dict[str, Path]) -> None:
    llama, qwen2, qwen3 = (load_hf_config(models[a]) for a in ("llama", "qwen2", "qwen3"))
    moe = load_hf_config(models["qwen3_moe"])
    assert (llama.tie_word_embeddings, qwen2.tie_word_embeddings) == (False, True)
    assert (llama.qkv_bias, qwen2.qkv_bias, qwen3.qkv_bias) == (False, True, False)
    assert qwen3.qk_norm and qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_attention_heads
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size, moe.norm_topk_prob) == (4, 2, 48, True)
    assert moe.shared_expert_ffn is None
    shared = load_hf_config(models["qwen2_moe"])  # Qwen2-MoE: qkv bias, raw top-k weights, a gated shared expert
    assert (shared.qkv_bias, shared.norm_topk_prob, shared.shared_expert_ffn, shared.num_experts) == (
        True,
        False,
        48,
        8,
    )
    assert load_hf_config(models["llama3_rope"]).rope_scaling_factor == 8.0
    assert llama.padded_vocab_size(1) == 1024 and llama.padded_vocab_size(3) == 1152


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("model_type", "gemma", "model_type='gemma'"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("attention_bias", True, "attention_bias=True"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope_type.*'yarn'"),
        (
            "rope_parameters",
            {
                "rope_type": "llama3",
                "rope_theta": 1e4,
                "factor": 8.0,
                "low_freq_factor": 2.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "low_freq_factor",
        ),
    ],
)
def test_config_rejects_unsupported_features(models: dict[str, Path], field: str, value, match: str) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(models["llama"])
    setattr(hf, field, value)
    with pytest.raises(ValueError, match=match):
        from_hf(hf)


def test_parallel_sizes_are_checked(models: dict[str, Path]) -> None:
    cfg = load_hf_config(models["llama"])  # 2 KV heads, 2 layers
    with pytest.raises(ValueError, match="num_key_value_heads=2 must be divisible by tp_size=4"):
        cfg.check_parallel(4, 1)
    with pytest.raises(ValueError, match="num_hidden_layers=2 must be divisible by pp_size=3"):
        cfg.check_parallel(1, 3)
    with pytest.raises(ValueError, match=r"ep=2 needs a MoE model whose num_experts \(None\)"):
        cfg.check_parallel(1, 1, 2)
    with pytest.raises(ValueError, match=r"ep=3 needs a MoE model whose num_experts \(8\)"):
        load_hf_config(models["qwen2_moe"]).check_parallel(1, 1, 3)
