"""Per-token log-probabilities of target ids (and entropies) from vocab-parallel logits, without gathering the vocab.

Why: the RL losses need log p(target) for every response token. Under TP each rank holds a
[..., V/TP] slice of the logits, and gathering the full vocabulary would cost TP times the
memory of the biggest activation. Three all-reduces of [...]-sized tensors suffice:
the max (for stability, no gradient), the sum of exponentials, and the target's logit (only
its owner contributes).

Gradients: the sums use Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce
forward, identity backward), the TP convention where every rank backpropagates the same loss.
`torch.distributed.nn.all_reduce` would multiply the gradient by TP.

Padded vocab rows (see `BridgeConfig.padded_vocab_size`) have zero weights, so their logits are 0,
not -inf. Pass `vocab_size` to leave them out of the normaliser, as the HF model and the engines
do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    target_ids: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """log softmax(full logits)[target] for each position. `logits_shard`: [..., V_pad/TP] of this
    TP rank (rank r holds vocab ids [r*V_pad/TP, (r+1)*V_pad/TP)). `target_ids`: [...] global ids.
    `tp_group=None` means no tensor parallelism (the shard is the whole vocab).
    Returns an fp32 [...] tensor, differentiable w.r.t. `logits_shard`."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if logits_shard.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"target_ids shape {tuple(target_ids.shape)} must equal logits_shard shape without its last dim "
            f"{tuple(logits_shard.shape[:-1])}"
        )
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    width = logits_shard.shape[-1]
    start = tp_rank * width
    logits = logits_shard.float()
    if vocab_size is not None and start + width > vocab_size:
        ids = torch.arange(start, start + width, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return t if tp_size == 1 else reduce_from_tensor_model_parallel_region(t, group=tp_group)

    local_max = logits.detach().amax(dim=-1)
    if tp_size > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - local_max.unsqueeze(-1)
    sum_exp = reduce(shifted.exp().sum(dim=-1))

    local_ids = target_ids - start
    owned = (local_ids >= 0) & (local_ids < width)
    picked = shifted.gather(-1, local_ids.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce(torch.where(owned, picked, torch.zeros_like(picked)))
    return target_logit - sum_exp.log()


def vocab_parallel_entropy(
    logits_shard: torch.Tensor, tp_group: dist.ProcessGroup | None = None, vocab_size: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(full logits) for each position, as `logsumexp - E_p[logit]`, from
    this TP rank's `[..., V_pad/TP]` slice (same layout and arguments as `vocab_parallel_logprobs`).
    Returns an fp32 [...] tensor, differentiable w.r.t. `logits_shard`."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    width = logits_shard.shape[-1]
    start = (0 if tp_group is None else dist.get_rank(tp_group)) * width
    logits = logits_shard.float()
    real = None
    if vocab_size is not None and start + width > vocab_size:
        real = torch.arange(start, start + width, device=logits.device) < vocab_size

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return t if tp_size == 1 else reduce_from_tensor_model_parallel_region(t, group=tp_group)

    local_max = (logits if real is None else logits.masked_fill(~real, float("-inf"))).detach().amax(dim=-1)
    if tp_size > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp() if real is None else torch.where(real, shifted.exp(), 0.0)  # padded columns: p = 0
    sum_exp = reduce(exp.sum(dim=-1))
    expected_shifted = reduce((exp * shifted).sum(dim=-1)) / sum_exp
    return sum_exp.log() - expected_shifted
