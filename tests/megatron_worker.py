"""torchrun worker for tests/test_megatron_bridge.py: every Megatron check in one launch.

Why one launch: importing Megatron costs 12-25 s per process, so all configurations run here one
after another (TP=1 with ranks splitting the models, then TP=2, then PP=2), re-initialising
Megatron's parallel state between them. Each rank writes `OUT/rank{r}.json`: {check: number},
differences as max |a - b|. The test module asserts on them.

Transformer Engine needs CUDA, so the `te` spec's names are checked on `te_standin_spec`: the
local spec rebuilt the way TE's is laid out (each pre-norm fused into the next linear).

    python -m torch.distributed.run --nproc-per-node 2 tests/megatron_worker.py SPEC.json OUT_DIR
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_rank import rank_main

from megatron_bridge import cpu

cpu.apply()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from megatron_bridge.config import BridgeConfig, load_hf_config  # noqa: E402
from megatron_bridge.hf_io import hf_tensors  # noqa: E402
from megatron_bridge.logprobs import vocab_parallel_logprobs  # noqa: E402
from megatron_bridge.model import build_model, load_hf_weights  # noqa: E402
from megatron_bridge.weights import export_hf, stage_params  # noqa: E402

SEQ, BATCH = 12, 2
BF16_ARCHS = ("qwen3", "qwen3_moe")  # q/k norms; a MoE router
results: dict[str, float | int | str] = {}


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def tokens(vocab: int, seed: int, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class NormColumnParallelLinear(ColumnParallelLinear):
    """Stand-in of TE's LayerNormColumnParallelLinear: RMSNorm with its own `layer_norm_weight`,
    then the column-parallel linear (the weight is replicated over TP, like TE's)."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.eps = config.layernorm_epsilon

    def forward(self, x: torch.Tensor, *args, **kwargs):
        x = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
        return super().forward(x, *args, **kwargs)


def te_standin_spec(cfg: BridgeConfig):
    """The local spec with TE's layout: no input norm; in dense layers no pre-MLP norm either."""
    spec = dataclasses.replace(cfg, spec="local").layer_spec()
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.self_attention.submodules.linear_qkv = NormColumnParallelLinear
    if not cfg.num_experts:  # TE's MoE layers keep a separate pre_mlp_layernorm
        layer.pre_mlp_layernorm = IdentityOp
        layer.mlp.submodules.linear_fc1 = NormColumnParallelLinear
    return spec


def init(tp: int, pp: int) -> None:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)


def tp_group() -> dist.ProcessGroup | None:
    group = parallel_state.get_tensor_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def full_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Forward one batch (no pipeline) and gather the vocab-parallel logits."""
    with torch.no_grad():
        shard = model(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    group = tp_group()
    if group is None:
        return shard
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, -1)


def check_export(key: str, model: torch.nn.Module, cfg, path: str, pp_rank: int = 0, pp_size: int = 1) -> None:
    """Export equals the checkpoint bit for bit: same names (this stage's), dtypes and values."""
    exported = dict(export_hf(model, cfg))
    expected = [n for p in stage_params(cfg, pp_rank, pp_size) if p.export for n in p.hf]
    with hf_tensors(path) as get:
        results[f"{key}/export_names_ok"] = int(sorted(exported) == sorted(expected))
        results[f"{key}/export_diff"] = max(diff(t, get(n)) for n, t in exported.items())
        results[f"{key}/export_dtype_ok"] = int(all(t.dtype == get(n).dtype for n, t in exported.items()))


def check_model(key: str, path: str, tp: int, divisible_by: int, seq: int = SEQ, spec: str = "local") -> None:
    """Load, compare logits with HF (first V columns; padded columns must be 0), export round trip.
    `spec="te"`: the te name table on `te_standin_spec`."""
    cfg = load_hf_config(path, divisible_by, spec)
    layer_spec = te_standin_spec(cfg) if spec == "te" else None
    model = build_model(cfg, layer_spec=layer_spec).eval()  # eval: Megatron refuses MoE training at TP>1 without SP
    load_hf_weights(model, cfg, path)
    ids = tokens(cfg.vocab_size, seed=1, batch=1 if seq > SEQ else BATCH, seq=seq)
    logits = full_logits(model, ids)
    with torch.no_grad():
        ref = hf_model(path)(ids).logits
    keys = {k for k in model.state_dict() if not k.endswith("._extra_state")}
    results[f"{key}/state_keys_ok"] = int(keys == {p.megatron for p in stage_params(cfg)})
    results[f"{key}/padded_vocab"] = logits.shape[-1]
    results[f"{key}/logits_diff"] = diff(logits[..., : cfg.vocab_size], ref)
    padded = logits[..., cfg.vocab_size :]
    results[f"{key}/padded_logits_max"] = padded.abs().max().item() if padded.numel() else 0.0
    check_export(key, model, cfg, path)
    if tp > 1:
        check_logprobs_on_model(key, model, cfg, ids, ref)


def check_bf16_model(key: str, path: str, spec: str = "local") -> None:
    """`build_model` in bf16: every parameter's dtype and device (the local spec's torch norms
    used to stay fp32), and the loaded model's logits against HF's fp32 ones."""
    cfg = load_hf_config(path, 128, spec)
    model = build_model(cfg, torch.bfloat16, layer_spec=te_standin_spec(cfg) if spec == "te" else None).eval()
    results[f"{key}/param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    results[f"{key}/param_devices"] = sorted({str(p.device) for p in model.parameters()})
    load_hf_weights(model, cfg, path)
    ids = tokens(cfg.vocab_size, seed=1)
    logits = full_logits(model, ids)
    with torch.no_grad():
        ref = hf_model(path)(ids).logits
    results[f"{key}/logits_dtype"] = str(logits.dtype)
    results[f"{key}/logits_diff"] = diff(logits[..., : cfg.vocab_size], ref)


def check_logprobs_on_model(key: str, model, cfg, ids: torch.Tensor, ref: torch.Tensor) -> None:
    with torch.no_grad():
        shard = model(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    lp = vocab_parallel_logprobs(shard[:, :-1], ids[:, 1:], tp_group(), cfg.vocab_size)
    ref_lp = torch.log_softmax(ref[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    results[f"{key}/logprobs_diff"] = diff(lp, ref_lp)


def check_logprobs_random() -> None:
    """vocab_parallel_logprobs vs full log_softmax at TP=2: values and gradients, padded tail masked."""
    group, rank = tp_group(), parallel_state.get_tensor_model_parallel_rank()
    vocab, padded = 37, 40
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(3, 5, padded, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g)
    ref = torch.log_softmax(full[..., :vocab], -1).gather(-1, targets[..., None]).squeeze(-1)
    (ref * weights).sum().backward()
    width = padded // dist.get_world_size(group)
    shard = full.detach()[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    lp = vocab_parallel_logprobs(shard, targets, group, vocab)
    (lp * weights).sum().backward()
    results["logprobs_random/value_diff"] = diff(lp, ref)
    results["logprobs_random/grad_diff"] = diff(shard.grad, full.grad[..., rank * width : (rank + 1) * width])


def check_convert_shards(key: str, path: str, shards_dir: str) -> None:
    """The shards `slimish convert hf-to-megatron` wrote load strictly on this rank and give HF's logits."""
    manifest = json.loads((Path(shards_dir) / "manifest.json").read_text())
    cfg = load_hf_config(path, manifest["make_vocab_size_divisible_by"])
    model = build_model(cfg)
    name = f"tp{parallel_state.get_tensor_model_parallel_rank()}_pp{parallel_state.get_pipeline_model_parallel_rank()}"
    model.load_state_dict(torch.load(Path(shards_dir) / manifest["shards"][name], weights_only=True), strict=True)
    ids = tokens(cfg.vocab_size, seed=2)
    with torch.no_grad():
        ref = hf_model(path)(ids).logits
    results[f"{key}/logits_diff"] = diff(full_logits(model, ids)[..., : cfg.vocab_size], ref)


def pipeline_step(model, cfg, microbatches: list[torch.Tensor], forward_only: bool, on_logits=None):
    """Run Megatron's schedule; loss = mean over microbatches of the mean token NLL (our logprobs)."""

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        output = model(inputs, torch.arange(inputs.shape[1]).expand_as(inputs), attention_mask=None)

        def loss_func(logits: torch.Tensor):
            if on_logits is not None:
                on_logits(logits)
            loss = -vocab_parallel_logprobs(logits, targets, tp_group(), cfg.vocab_size).mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return output, loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=SEQ - 1,
        micro_batch_size=microbatches[0].shape[0],
        forward_only=forward_only,
    )


def check_pipeline_grads(key: str, path: str) -> None:
    """PP=2 1F1B with 2 microbatches, mcore DDP, then one Adam step with clipping (the CPU shim's
    schedule and optimizer sites): loss and per-HF-name grads vs an HF loss.backward() reference."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = load_hf_config(path)
    model = build_model(cfg)
    load_hf_weights(model, cfg, path)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    ids = tokens(cfg.vocab_size, seed=4, batch=4)
    microbatches = list(ids.chunk(2))
    losses = pipeline_step(ddp, cfg, microbatches, forward_only=False)

    hf = hf_model(path)
    ref_loss = sum(
        torch.nn.functional.cross_entropy(hf(mb[:, :-1]).logits.flatten(0, 1), mb[:, 1:].flatten())
        for mb in microbatches
    ) / len(microbatches)
    ref_loss.backward()
    if parallel_state.is_pipeline_last_stage():
        results[f"{key}/loss_diff"] = abs(sum(d["loss"].item() for d in losses) / len(losses) - ref_loss.item())
    ref_grads = dict(hf.named_parameters())
    grads = dict(export_hf(ddp, cfg, grads=True))
    results[f"{key}/grad_names"] = len(grads)
    results[f"{key}/grad_diff"] = max(diff(g, ref_grads[n].grad) for n, g in grads.items())
    results[f"{key}/grad_max"] = max(g.abs().max().item() for g in grads.values())

    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e-3, bf16=False, fp16=False), [ddp]
    )
    before = {n: t.clone() for n, t in export_hf(ddp, cfg)}
    ok, grad_norm, _ = opt.step()
    hf_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), float("inf")).item()
    results[f"{key}/optimizer_ok"] = int(bool(ok))
    results[f"{key}/grad_norm_diff"] = abs(grad_norm - hf_norm)
    results[f"{key}/step_moved"] = min(diff(t, before[n]) for n, t in export_hf(ddp, cfg))


def check_pipeline_forward(key: str, path: str) -> None:
    """PP=2 forward through the schedule for a tied model: the last stage's copy of the embedding."""
    cfg = load_hf_config(path)
    model = build_model(cfg)
    load_hf_weights(model, cfg, path)
    ids = tokens(cfg.vocab_size, seed=5)
    seen: list[torch.Tensor] = []
    with torch.no_grad():
        pipeline_step(model, cfg, [ids], forward_only=True, on_logits=seen.append)
        ref = hf_model(path)(ids[:, :-1]).logits
    if seen:
        results[f"{key}/logits_diff"] = diff(seen[0][..., : cfg.vocab_size], ref)
    check_export(key, model, cfg, path, parallel_state.get_pipeline_model_parallel_rank(), 2)


def main(spec: dict, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    models: dict[str, str] = spec["models"]
    init(1, 1)  # TP=1: the ranks split the models between them
    for i, (arch, path) in enumerate(sorted(models.items())):
        if i % world == rank:
            # llama3 RoPE scaling changes only long wavelengths: 1024 positions make it visible
            check_model(f"tp1/{arch}", path, 1, 128, seq=1024 if arch == "llama3_rope" else SEQ)
    te_models: dict[str, str] = spec["te_models"]  # random norm weights
    for i, (arch, path) in enumerate(sorted(te_models.items())):
        if i % world == rank:
            check_model(f"te_tp1/{arch}", path, 1, 128, spec="te")
    bf16_checks = [(f"bf16/{a}", models[a], "local") for a in BF16_ARCHS] + [
        (f"te_bf16/{a}", te_models[a], "te") for a in BF16_ARCHS
    ]
    for i, (key, path, spec_name) in enumerate(bf16_checks):
        if i % world == rank:
            check_bf16_model(key, path, spec_name)
    if rank == 0 and not gpt_layer_specs.HAVE_TE:
        try:
            load_hf_config(models["llama"], spec="te").layer_spec()
        except ValueError as exc:
            results["te_missing_error"] = str(exc)
    init(2, 1)
    check_logprobs_random()
    for arch in spec["tp2"]:
        check_model(f"tp2/{arch}", models[arch], 2, 100)  # 1024 -> 1200 rows: 88 padded rows per rank
    for arch in spec["te_tp2"]:
        check_model(f"te_tp2/{arch}", te_models[arch], 2, 100, spec="te")
    check_convert_shards("tp2/convert_shards", models["llama"], spec["convert_shards"])
    init(1, 2)
    check_pipeline_grads("pp2/llama", models["llama"])
    check_pipeline_forward("pp2/qwen3", models["qwen3"])


if __name__ == "__main__":
    rank_main(main, results)
