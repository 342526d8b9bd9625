"""The Megatron-Core trainer: a GPTModel from megatron_bridge under tensor, pipeline and data parallelism.

The steps are `Trainer`'s (base.py), the same as the torch backend's; this backend runs each
share's micro-batches through Megatron's schedule (`get_forward_backward_func`: 1F1B under
pipeline parallelism), with Megatron's DDP and optimiser (Adam, fp32 main weights). The world is
`trainer.tp` x `trainer.pp` x data-parallel ranks; the ranks of one tensor/pipeline group see the
same samples, so a batch is sharded over data-parallel ranks only.

Mixture-of-experts models. `trainer.ep` splits each layer's experts over that many data-parallel
ranks (an expert group; Megatron's allgather dispatcher, the one that runs on gloo), which must
then run their forwards in lockstep (`_lockstep`). MoE trains at TP=1. Routing replay
(`algorithm.routing_replay`) drives Megatron's own `RouterReplay` (megatron_routes.py).

Loss scaling. The loss a micro-batch returns is its share of the global batch's loss. The
schedule divides it by the number of micro-batches and DDP averages gradients over data-parallel
ranks, so it is multiplied by both first: the gradient is then the full batch's, exactly as in the
torch backend. Logprobs and entropies come from the vocab-parallel logits without gathering the
vocabulary (megatron_bridge.logprobs); the padded vocab columns are left out, as the HF model
and the engines do.

What is collective: every rank calls every public method (train.py does). `hf_tensors` streams
full HF-named tensors to rank 0, gathered over TP and sent from each pipeline stage; a checkpoint
(`state_dict`) carries one shard per (tp, pp[, ep]) rank and resumes only with the same tp, pp and ep.

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
from transformers import AutoConfig, AutoTokenizer

from megatron_bridge import cpu
from megatron_bridge.config import load_hf_config
from megatron_bridge.hf_io import save_hf
from megatron_bridge.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_bridge.model import build_model, load_hf_weights
from megatron_bridge.weights import export_hf
from slimish.trainer.backend import LossFn, lr_factor
from slimish.trainer.base import Trainer
from slimish.trainer.batch import micro_batches, response_index
from slimish.trainer.routing import route_state
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

from slimish.trainer.megatron_routes import MegatronRoutes  # noqa: E402

# (payload, samples of the micro-batch, input ids, this stage's logits shard) -> the loss to backpropagate
OnLogits = Callable[[Any, list[Sample], Tensor, Tensor], Tensor]


def _init_world() -> None:
    """Megatron needs a process group: a plain `python -m slimish.train` is a world of one."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # no port to race for


def _init_model_parallel(tp: int, pp: int, ep: int, world: int) -> None:
    if world % (tp * pp):
        raise ValueError(f"trainer.tp * trainer.pp = {tp} * {pp} must divide the world size {world}")
    if (world // pp) % ep:
        raise ValueError(f"trainer.ep={ep} must divide the world size / trainer.pp = {world} / {pp}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
        return
    have = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )
    if have != (tp, pp, ep):
        raise ValueError(
            f"Megatron's parallel state is already tp={have[0]}, pp={have[1]}, ep={have[2]}; "
            f"trainer.tp={tp}, trainer.pp={pp}, trainer.ep={ep}"
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
        _init_model_parallel(tc.tp, tc.pp, tc.ep, self.world)
        self.tp, self.pp, self.ep = tc.tp, tc.pp, tc.ep
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dtype = getattr(torch, tc.compute_dtype(self.device.type))
        self._setup(cfg, AutoTokenizer.from_pretrained(cfg.model), int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
        self.bridge = load_hf_config(cfg.model, spec=tc.megatron_spec)
        if self.bridge.num_experts and self.tp > 1:
            raise ValueError(
                f"trainer.tp={self.tp}: Megatron trains a MoE model ({cfg.model}) only at tensor parallelism 1 "
                "here (MoE at TP>1 needs sequence parallelism, which the torch norms cannot do); use trainer.ep"
            )
        try:
            self.bridge.check_parallel(self.tp, self.pp, self.ep)
        except ValueError as exc:
            raise ValueError(f"trainer.ep={self.ep} ({cfg.model}): {exc}") from None
        self.routes = route_state(cfg.algorithm.routing_replay, AutoConfig.from_pretrained(cfg.model), cfg.model)
        self.replay = None
        if self.routes is not None:  # every MoE model: the statistics are measured without replay too
            self.replay = MegatronRoutes(self.routes, self.pp_rank * (self.bridge.num_layers // self.pp))
        self.model = self._build()
        load_hf_weights(self.model, self.bridge, cfg.model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.ddp = DistributedDataParallel(self.model.config, ddp_config, self.model)
        config = self.model.config
        # The grad all-reduce (over data-parallel ranks; the tied embedding across stages) runs once per
        # optimiser step, in `_optimizer_step`, not at the end of each schedule: an update may run
        # several (the RL loss, then ptx's NLL), and reducing twice scales expert grads twice.
        config.finalize_model_grads_func = None
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
        replay = {} if self.replay is None else {"moe_enable_routing_replay": True}
        with torch.random.fork_rng(devices=[]):
            model = build_model(self.bridge, self.dtype, seed=self.cfg.trainer.seed, **replay)
        if self.replay is not None:
            self.replay.install(model)
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

    def _lockstep(self, items: list[tuple[Any, list[Sample]]]) -> tuple[int, int, int]:
        """(micro-batches, rows, length) every rank of this rank's expert group runs: with expert
        parallelism the allgather dispatcher gathers equal token counts from each of them at every
        MoE layer, forward and backward, so they must run the same forwards with the same
        `[B, S]` (the maxima here; `_schedule` pads). Without it, this rank's own."""
        shape = [len(items), max((len(b) for _, b in items), default=0)]
        shape.append(max((len(s.tokens) for _, b in items for s in b), default=0))
        if self.ep == 1:
            return shape[0], shape[1], shape[2]
        agreed = torch.tensor(shape, dtype=torch.long, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ps.get_expert_tensor_and_model_parallel_group())
        n, rows, length = agreed.tolist()
        return n, rows, length

    def _schedule(
        self, model: torch.nn.Module, items: list[tuple[Any, list[Sample]]], on_logits: OnLogits, forward_only: bool
    ) -> None:
        """Micro-batches `items` (payload, samples) through Megatron's schedule; `on_logits`
        runs on the last pipeline stage for each and returns its share of the global batch's
        loss. With `forward_only=False` the gradients of those losses end up in the grad buffers,
        all-reduced over data-parallel ranks at the optimiser step. Under expert parallelism every
        micro-batch is padded to the group's `[B, S]` with pad rows, and all-pad micro-batches
        (loss 0, still backpropagated: the dispatcher's backward is collective too) make up the
        group's count (`_lockstep`)."""
        n, rows, length = self._lockstep(items)
        if n == 0:
            return
        # The schedule divides each loss by the micro-batch count and DDP averages over data-parallel
        # ranks: multiplied by both first, the gradient is the whole batch's.
        scale = n * self.dp_size
        items = items + [(None, [])] * (n - len(items))

        def forward_step(data: Iterator[tuple[Any, list[Sample]]], model: torch.nn.Module):
            payload, batch = next(data)
            ids = self._input_ids(batch) if batch else torch.empty(0, 0, dtype=torch.long, device=self.device)
            inputs = ids
            if self.ep > 1:
                inputs = torch.full((rows, length), self.pad_id, dtype=torch.long, device=self.device)
                inputs[: ids.shape[0], : ids.shape[1]] = ids
            positions = torch.arange(inputs.shape[1], device=self.device).expand_as(inputs)  # RoPE ignores them
            routing = nullcontext() if self.replay is None else self.replay.forward(model, batch, *inputs.shape)
            with routing:
                output = model(inputs, positions, attention_mask=None)

            def loss(logits: Tensor) -> tuple[Tensor, dict]:
                if not batch:  # a lockstep filler: zero, but connected to the graph
                    return logits.sum() * 0.0, {}
                return on_logits(payload, batch, ids, logits[: ids.shape[0], : ids.shape[1]]) * scale, {}

            return output, loss

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(items),
            model=[model],
            num_microbatches=n,
            seq_length=length,
            micro_batch_size=rows,
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

        self._schedule(
            self.ddp if model is None else model, [(g, [samples[i] for i in g]) for g in groups], on_logits, True
        )
        return out

    def _accumulate(
        self, batch: list[Sample], idx: list[int], loss_fn: LossFn, entropy: bool | None
    ) -> dict[str, float]:
        groups = self._micro_groups(batch)
        stats: dict[str, float] = {}

        def on_logits(group: list[int], sub: list[Sample], ids: Tensor, logits: Tensor) -> Tensor:
            logprobs, ent = self._response(sub, ids, logits, entropy)
            loss, st = loss_fn([idx[k] for k in group], logprobs, ent)
            for key, value in st.items():
                stats[key] = stats.get(key, 0.0) + float(value)
            return loss

        self._schedule(self.ddp, [(g, [batch[k] for k in g]) for g in groups], on_logits, forward_only=False)
        return stats

    def _optimizer_step(self, optimizer: Any) -> float:
        finalize_model_grads([self.ddp])  # every rank: the gradient all-reduces
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
        data-parallel replica 0's TP ranks gather each tensor (and, under expert parallelism, its
        expert group gathers the experts), and each later pipeline stage's TP rank 0 sends its
        stage to rank 0 (names, shapes and dtypes first)."""
        if not self._holds_replica_0():
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

    def _holds_replica_0(self) -> bool:
        """Whether this rank holds part of data-parallel replica 0: its data-parallel rank is 0, or
        under expert parallelism its expert group is replica 0's (each rank has other experts)."""
        return (ps.get_expert_data_parallel_rank() if self.ep > 1 else self.dp_rank) == 0

    def _shard_name(self) -> str:
        name = f"tp{self.tp_rank}_pp{self.pp_rank}"
        return f"{name}_ep{ps.get_expert_model_parallel_rank()}" if self.ep > 1 else name

    def state_dict(self) -> dict[str, Any]:
        """On rank 0: {"tp", "pp", "ep", "shards": {"tp{t}_pp{p}[_ep{e}]": that rank's model,
        optimiser and schedule}} from data-parallel replica 0 (the replicas are identical); {}
        elsewhere."""
        mine = None
        if self._holds_replica_0():
            mine = {
                "name": self._shard_name(),
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
        shards = {s.pop("name"): s for s in gathered if s is not None}
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "shards": shards}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        have = (state.get("tp"), state.get("pp"), state.get("ep", 1))
        if have != (self.tp, self.pp, self.ep):
            raise ValueError(
                f"checkpoint: trainer state of tp={have[0]}, pp={have[1]}, ep={have[2]} (Megatron backend), "
                f"but this run has trainer.tp={self.tp}, trainer.pp={self.pp}, trainer.ep={self.ep}"
            )
        mine = state["shards"][self._shard_name()]
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
