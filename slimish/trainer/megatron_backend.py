"""The Megatron-Core trainer: a GPTModel from megatron_bridge under tensor, pipeline and data parallelism.

The steps are `Trainer`'s (base.py), the same as the torch backend's; this backend runs each
share's micro-batches through Megatron's schedule (`get_forward_backward_func`: 1F1B under
pipeline parallelism), with Megatron's DDP and optimiser (Adam, fp32 main weights). The world is
`trainer.tp` x `trainer.pp` x data-parallel ranks; the ranks of one tensor/pipeline group see the
same samples, so a batch is sharded over data-parallel ranks only.

Loss scaling. The loss a micro-batch returns is its share of the global batch's loss. The
schedule divides it by the number of micro-batches and DDP averages gradients over data-parallel
ranks, so it is multiplied by both first: the gradient is then the full batch's, exactly as in the
torch backend. Logprobs and entropies come from the vocab-parallel logits without gathering the
vocabulary (megatron_bridge.logprobs); the padded vocab columns are left out, as the HF model
and the engines do.

What is collective: every rank calls every public method (train.py does). `hf_tensors` streams
full HF-named tensors to rank 0, gathered over TP and sent from each pipeline stage; a checkpoint
(`state_dict`) carries one shard per (tp, pp) rank and resumes only with the same tp and pp.

On a machine without CUDA `megatron_bridge.cpu.apply()` patches Megatron's CUDA-only call sites.
Keep `use_distributed_optimizer` off there: its reported grad norm is off on gloo, so clipping
would differ.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import AutoTokenizer

from megatron_bridge import cpu
from megatron_bridge.config import load_hf_config
from megatron_bridge.hf_io import save_hf
from megatron_bridge.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_bridge.model import build_model, load_hf_weights
from megatron_bridge.weights import export_hf
from slimish.net import free_port
from slimish.trainer.backend import LossFn, lr_factor
from slimish.trainer.base import Trainer
from slimish.trainer.batch import micro_batches, response_index
from slimish.types import Sample

if TYPE_CHECKING:
    from slimish.config import RunConfig

cpu.apply()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

# (payload, samples of the micro-batch, input ids, this stage's logits shard) -> the loss to backpropagate
OnLogits = Callable[[Any, list[Sample], Tensor, Tensor], Tensor]


def _init_world() -> None:
    """Megatron needs a process group: a plain `python -m slimish.train` is a world of one."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _init_model_parallel(tp: int, pp: int, world: int) -> None:
    if world % (tp * pp):
        raise ValueError(f"trainer.tp * trainer.pp = {tp} * {pp} must divide the world size {world}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tp, pp)
        return
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
    if have != (tp, pp):
        raise ValueError(
            f"Megatron's parallel state is already tp={have[0]}, pp={have[1]}; trainer.tp={tp}, trainer.pp={pp}"
        )


def _to_cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class MegatronTrainer(Trainer):
    def __init__(self, cfg: RunConfig) -> None:
        tc = cfg.trainer
        _init_world()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if torch.cuda.is_available():  # one GPU per torchrun rank on its node
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        _init_model_parallel(tc.tp, tc.pp, self.world)
        self.tp, self.pp = tc.tp, tc.pp
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dtype = getattr(torch, tc.compute_dtype(self.device.type))
        self._setup(cfg, AutoTokenizer.from_pretrained(cfg.model), int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
        self.bridge = load_hf_config(cfg.model, spec=tc.megatron_spec)
        self.model = self._build()
        load_hf_weights(self.model, self.bridge, cfg.model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.ddp = DistributedDataParallel(self.model.config, ddp_config, self.model)
        config = self.model.config
        config.finalize_model_grads_func = finalize_model_grads  # DP all-reduce; tied embedding across stages
        config.no_sync_func = self.ddp.no_sync
        self.optimizer = self._new_optimizer(tc.lr)
        self.updates = 0
        self._set_lr()
        self.ref = None
        if tc.ref_model:
            self.ref = self._build(frozen=True)
            load_hf_weights(self.ref, self.bridge, tc.ref_model)

    def _build(self, frozen: bool = False) -> torch.nn.Module:
        """This rank's (unloaded) GPTModel shard. Building seeds Megatron's RNG, which reseeds
        torch's CPU generator: forked, so a trainer built mid-run leaves the run's RNG alone."""
        with torch.random.fork_rng(devices=[]):
            model = build_model(self.bridge, self.dtype, seed=self.cfg.trainer.seed)
        model.config.variable_seq_lengths = self.pp > 1  # stages exchange each micro-batch's shape: no padding to one
        model.eval()  # no dropout: the loss's logprobs must be those of the policy the engines sample
        if frozen:
            model.requires_grad_(False)
        return model

    def _frozen_copy(self, state: dict[str, Tensor] | None = None) -> torch.nn.Module:
        ref = self._build(frozen=True)
        ref.load_state_dict(self.model.state_dict() if state is None else state)
        return ref

    def _new_optimizer(self, lr: float) -> Any:
        tc = self.cfg.trainer
        config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=tc.weight_decay,
            adam_beta1=tc.betas[0],
            adam_beta2=tc.betas[1],
            adam_eps=1e-8,
            clip_grad=tc.grad_clip,
            bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16,
            params_dtype=self.dtype,
            use_distributed_optimizer=False,
        )
        # config_overrides={}: decay every parameter, as the torch backend's AdamW does
        # (Megatron's default exempts norms and biases).
        return get_megatron_optimizer(config, [self.ddp], config_overrides={})

    def _set_lr(self) -> None:
        tc = self.cfg.trainer
        factor = lr_factor(tc.lr_schedule, tc.warmup_steps, self.cfg.steps * tc.updates_per_step, self.updates)
        for group in self.optimizer.param_groups:
            group["lr"] = tc.lr * factor

    def _updates_done(self) -> int:
        return self.updates

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _scheduler_step(self) -> None:
        self.updates += 1
        self._set_lr()

    # -- forward, accumulation, optimiser ------------------------------------------------------

    def _schedule(
        self, model: torch.nn.Module, items: list[tuple[Any, list[Sample]]], on_logits: OnLogits, forward_only: bool
    ) -> None:
        """Micro-batches `items` (payload, samples) through Megatron's schedule; `on_logits`
        runs on the last pipeline stage for each. With `forward_only=False` the gradients of
        its losses end up in the grad buffers, all-reduced over data-parallel ranks."""

        def forward_step(data: Iterator[tuple[Any, list[Sample]]], model: torch.nn.Module):
            payload, batch = next(data)
            ids = self._input_ids(batch)
            positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)  # RoPE ignores them: right-padded
            output = model(ids, positions, attention_mask=None)
            return output, lambda logits: (on_logits(payload, batch, ids, logits), {})

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(items),
            model=[model],
            num_microbatches=len(items),
            seq_length=max(len(s.tokens) for _, b in items for s in b),
            micro_batch_size=max(len(b) for _, b in items),
            forward_only=forward_only,
        )

    def _response(
        self, batch: list[Sample], ids: Tensor, logits: Tensor, entropy: bool | None
    ) -> tuple[Tensor, Tensor | None]:
        """Response-token logprobs `[B, R]` from a logits shard `[B, S, V_pad/TP]`, and, unless
        `entropy` is False, their entropies (with gradient only when `entropy` is True)."""
        first = min(s.prompt_length for s in batch) - 1  # position p predicts token p + 1
        logits = logits[:, first:-1]
        if self.temperature != 1.0:
            logits = logits / self.temperature
        index = response_index(batch, first).to(self.device)
        vocab = self.bridge.vocab_size
        logprobs = vocab_parallel_logprobs(logits, ids[:, first + 1 :], self.tp_group, vocab).gather(1, index)
        ent = None
        if entropy is not False:
            with nullcontext() if entropy else torch.no_grad():
                ent = vocab_parallel_entropy(logits, self.tp_group, vocab).gather(1, index)
        return logprobs, ent

    @torch.no_grad()
    def logprobs(self, samples: list[Sample], model: torch.nn.Module | None = None) -> list[Tensor]:
        """Only the last pipeline stage computes them; the other stages get zeros (whatever
        they derive from them is replaced by the last stage's in `_all_reduce`)."""
        out = [torch.zeros(s.response_length, device=self.device) for s in samples]
        groups = micro_batches([len(s.tokens) for s in samples], self.cfg.trainer.micro_batch_tokens)

        def on_logits(idx: list[int], batch: list[Sample], ids: Tensor, logits: Tensor) -> Tensor:
            logprobs, _ = self._response(batch, ids, logits, entropy=False)
            for i, s, row in zip(idx, batch, logprobs):
                out[i] = row[: s.response_length].clone()
            return logits.new_zeros(())

        if samples:
            self._schedule(
                self.ddp if model is None else model, [(g, [samples[i] for i in g]) for g in groups], on_logits, True
            )
        return out

    def _accumulate(
        self, batch: list[Sample], idx: list[int], loss_fn: LossFn, entropy: bool | None
    ) -> dict[str, float]:
        groups = self._micro_groups(batch)
        stats: dict[str, float] = {}
        if not groups:  # nothing to train on: still take part in the gradient all-reduce
            finalize_model_grads([self.ddp])
            return stats
        scale = len(groups) * self.dp_size  # undoes the schedule's 1/micro-batches and DDP's 1/DP average

        def on_logits(group: list[int], sub: list[Sample], ids: Tensor, logits: Tensor) -> Tensor:
            logprobs, ent = self._response(sub, ids, logits, entropy)
            loss, st = loss_fn([idx[k] for k in group], logprobs, ent)
            for key, value in st.items():
                stats[key] = stats.get(key, 0.0) + float(value)
            return loss * scale

        self._schedule(self.ddp, [(g, [batch[k] for k in g]) for g in groups], on_logits, forward_only=False)
        return stats

    def _optimizer_step(self, optimizer: Any) -> float:
        ok, norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError("the Megatron optimiser skipped its step: non-finite gradients")
        self.ddp.zero_grad_buffer()
        optimizer.zero_grad()
        return float(norm)

    # -- data parallelism ------------------------------------------------------------------------

    def _all_reduce(self, t: Tensor) -> Tensor:
        """Sums over data-parallel ranks; under PP the last stage's (the one with logits) to all stages."""
        if self.dp_size > 1:
            dist.all_reduce(t, group=ps.get_data_parallel_group())
        if self.pp > 1:
            dist.broadcast(
                t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
        return t

    # -- weights out and in ----------------------------------------------------------------------

    def hf_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Rank 0 yields every HF tensor; the other ranks yield nothing but must iterate too:
        data-parallel replica 0's TP ranks gather each tensor, and each later pipeline stage's
        TP rank 0 sends its stage to rank 0 (names, shapes and dtypes first)."""
        if self.dp_rank != 0:
            return
        stage = export_hf(self.ddp, self.bridge, tp_group=ps.get_tensor_model_parallel_group())
        pipeline = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        if self.rank == 0:
            yield from stage
            for src in pipeline[1:]:
                meta: list[Any] = [None]
                dist.recv_object_list(meta, src=src)
                for name, shape, dtype in meta[0]:
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                    dist.recv(t, src=src)
                    yield name, t
        elif self.pp_rank > 0 and pipeline[0] == 0:  # TP rank 0 of a later stage
            tensors = [(name, t.contiguous()) for name, t in stage]
            dist.send_object_list([[(name, t.shape, t.dtype) for name, t in tensors]], dst=0)
            for _, t in tensors:
                dist.send(t, dst=0)
        else:
            for _ in stage:  # this rank's part of each TP gather
                pass

    def state_dict(self) -> dict[str, Any]:
        """On rank 0: {"tp", "pp", "shards": {"tp{t}_pp{p}": that rank's model, optimiser and
        schedule}} from data-parallel replica 0 (the replicas are identical); {} elsewhere."""
        mine = None
        if self.dp_rank == 0:
            mine = {
                "name": f"tp{self.tp_rank}_pp{self.pp_rank}",
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "updates": self.updates,
            }
            if self.ref is not None and not self.cfg.trainer.ref_model:  # a copy of the policy: not on disk
                mine["ref"] = self.ref.state_dict()
            mine = _to_cpu(mine)
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:
            return {}
        return {"tp": self.tp, "pp": self.pp, "shards": {s.pop("name"): s for s in gathered if s is not None}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("tp"), state.get("pp")) != (self.tp, self.pp):
            raise ValueError(
                f"checkpoint: trainer state of tp={state.get('tp')}, pp={state.get('pp')} (Megatron backend), "
                f"but this run has trainer.tp={self.tp}, trainer.pp={self.pp}"
            )
        mine = state["shards"][f"tp{self.tp_rank}_pp{self.pp_rank}"]
        self.model.load_state_dict(mine["model"])
        self.optimizer.load_state_dict(mine["optimizer"])
        self.updates = mine["updates"]
        self._set_lr()
        if "ref" in mine:
            self.ref = self._frozen_copy(mine["ref"])

    def save_hf(self, path: str) -> None:
        tensors = self.hf_tensors()
        if self.rank == 0:
            save_hf(((name, t.cpu()) for name, t in tensors), path, self.cfg.model)
        else:
            for _ in tensors:
                pass
