"""The plain-PyTorch trainer: an HF causal LM under DDP (gloo on CPU, NCCL on GPU).

The steps themselves (batch sharding, advantages, losses, metrics) are `Trainer`'s (base.py);
this backend runs the micro-batches through the HF model. DDP averages gradients over ranks, so
each micro-batch's loss share is scaled by the world size.

No dropout anywhere (the model stays in eval mode): the logprobs the loss uses must be those of
the policy the engines sample from. With `trainer.lora` the model is under a PEFT adapter
(lora.py): only the adapter trains, and only the adapter is saved, pushed and exported.

Mixed precision: weights, gradients, AdamW and checkpoints are fp32 whatever `trainer.dtype` says;
a bf16/fp16 `trainer.dtype` runs the forward under autocast to it, and the engines are pushed
weights in it. An Adam step at lr 1e-5 is below bf16's resolution for most weights: bf16 weights
would keep them unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from slimish.batch_invariant import make_batch_invariant
from slimish.colocate import WeightStore, share_parameters
from slimish.moe import checkpoint_tensors, routers
from slimish.trainer.backend import LossFn, lr_factor
from slimish.trainer.base import Trainer
from slimish.trainer.batch import micro_batches, response_index
from slimish.trainer.logprobs import chunked_logprobs, entropy_from_logits, logprobs_from_logits
from slimish.trainer.lora import (
    AdaptersOff,
    adapter_config,
    adapter_tensors,
    add_adapter,
    dropout_on,
    load_adapter_tensors,
    write_adapter_dir,
)
from slimish.trainer.routing import replaying, route_state
from slimish.types import Sample

if TYPE_CHECKING:
    from slimish.config import RunConfig


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a DDP wrapper."""
    return model.module if isinstance(model, DDP) else model


class TorchTrainer(Trainer):
    def __init__(self, cfg: RunConfig, store: WeightStore | None = None) -> None:
        tc = cfg.trainer
        distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        if torch.cuda.is_available():  # one GPU per torchrun rank on its node
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.dtype = getattr(torch, tc.compute_dtype(self.device.type))  # the forward's and the engines'
        self.dp_rank, self.dp_size = self.rank, self.world
        self._setup(cfg, AutoTokenizer.from_pretrained(cfg.model), int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
        self.model = self._load(cfg.model)
        if store is not None:  # launch.colocate: the optimiser steps write the engines' weights
            store.attach(self.model, fill=True, field="trainer")
        self.routes = route_state(cfg.algorithm.routing_replay, self.model.config, cfg.model)
        self.lora = tc.lora.enabled
        self.policies = [p.name for p in cfg.policies]  # several: one adapter each (policies.py)
        if self.lora:
            self.model = add_adapter(self.model, tc.lora, tuple(self.policies) or ("default",))
            if store is not None:  # the adapter shared too, where its tensors are whole parameters (not MoE's)
                self.adapter_store = share_parameters(self.adapter_tensors(), self.model.parameters())
        # forward_sync_buffers=False: DDP's forward then runs no collective, so ranks may run
        # different numbers of forwards (micro-batches, no-grad passes).
        self.ddp = DDP(self.model, forward_sync_buffers=False) if self.world > 1 else None
        self.per_policy = self._policy_states(cfg)
        if self.policies:
            self.optimizer, self.scheduler, _ = self.per_policy[self.policies[0]]
        else:
            self.optimizer, self.scheduler = self._optimiser(tc.lr)
        self.ref: torch.nn.Module | None = self._load(tc.ref_model, frozen=True) if tc.ref_model else None
        if self.ref is None and self.lora:  # the base: the adapter switched off, no second copy
            self.ref = AdaptersOff(self.model)
        if cfg.algorithm.advantage == "gae":
            self.critic = self._load_critic(cfg.critic.model or cfg.model)
            self.critic_ddp = DDP(self.critic, forward_sync_buffers=False) if self.world > 1 else None
            self.critic_optimizer = torch.optim.AdamW(
                self.critic.parameters(), lr=cfg.critic.lr or tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay
            )

    def _optimiser(self, lr: float) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over the parameters that require grad (with LoRA: the active adapter's) at `lr`,
        and its schedule over the run's optimiser steps."""
        tc = self.cfg.trainer
        total = self.cfg.steps * tc.updates_per_step
        optimizer = self._new_optimizer(lr)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(tc.lr_schedule, tc.warmup_steps, total, step)
        )

    def _policy_states(self, cfg: RunConfig) -> dict[str, tuple[torch.optim.Optimizer, Any, RunConfig]]:
        """`policies`: per policy its optimiser and schedule (over its adapter alone), and the run's
        config with its algorithm settings; the first policy's adapter left active."""
        states = {}
        for p in cfg.policies:
            self.model.set_adapter(p.name)
            algorithm = dataclasses.replace(cfg.algorithm, advantage=p.advantage or cfg.algorithm.advantage)
            optimizer, scheduler = self._optimiser(cfg.trainer.lr if p.lr is None else p.lr)
            states[p.name] = (optimizer, scheduler, dataclasses.replace(cfg, algorithm=algorithm))
        if cfg.policies:
            self.model.set_adapter(cfg.policies[0].name)
        return states

    def _load_critic(self, path: str) -> torch.nn.Module:
        """The value model: the HF checkpoint's backbone under a fresh scalar head on every token
        (`AutoModelForTokenClassification`, num_labels=1; the head starts near 0). The library's own
        class rather than a hand-made head: its weights save, load and shard as any HF model's."""
        model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).to(self.device)
        model.eval()  # no dropout, as the policy
        return model

    def _load(self, path: str, frozen: bool = False) -> torch.nn.Module:
        """fp32, frozen ones too: the reference then computes what the policy computes."""
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        model.eval()
        if self.cfg.algorithm.true_on_policy:  # the engines' kernels (--enable-deterministic-inference)
            make_batch_invariant(model)
        if frozen:
            model.requires_grad_(False)
        return model

    def _frozen_copy(self, state: dict[str, Tensor] | None = None) -> torch.nn.Module:
        """A frozen model holding `state` (default: the policy's current weights)."""
        ref = self._load(self.cfg.model, frozen=True)
        ref.load_state_dict(self.model.state_dict() if state is None else state)
        return ref

    def _new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        tc = self.cfg.trainer
        params = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapter's
        return torch.optim.AdamW(params, lr=lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)

    @contextmanager
    def use_policy(self, name: str) -> Iterator[None]:
        """`policies`: inside, the trainer is policy `name`'s: its adapter active (the only
        parameters with gradients), its optimiser, schedule and algorithm settings."""
        run = self.cfg
        self.model.set_adapter(name)
        self.optimizer, self.scheduler, self.cfg = self.per_policy[name]
        try:
            yield
        finally:
            self.cfg = run

    def _updates_done(self) -> int:
        return self.scheduler.last_epoch

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _scheduler_step(self) -> None:
        with warnings.catch_warnings():
            # An update without an optimiser step (critic warm-up, no trained token, a policy
            # absent from the batch) advances the schedule as if it had stepped (base._update):
            # torch warns that the schedule's first value then goes unused, which is the intent.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()

    # -- forward, accumulation, optimiser ------------------------------------------------------

    def _autocast(self) -> AbstractContextManager:
        """The forward's precision: autocast to `self.dtype` over the fp32 weights; fp32 as is."""
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @torch.no_grad()
    def logprobs(self, samples: list[Sample], model: torch.nn.Module | None = None) -> list[Tensor]:
        model = self.model if model is None else model
        out: list[Tensor | None] = [None] * len(samples)
        for idx in micro_batches([len(s.tokens) for s in samples], self.cfg.trainer.micro_batch_tokens):
            batch = [samples[i] for i in idx]
            logprobs, _ = self._forward(model, batch, entropy=False)
            for i, s, row in zip(idx, batch, logprobs):
                out[i] = row[: s.response_length].clone()
        return out  # type: ignore[return-value]

    def _forward(
        self, model: torch.nn.Module, batch: list[Sample], entropy: bool | None
    ) -> tuple[Tensor, Tensor | None]:
        """Response-token logprobs `[B, R]` (right-padded) and, unless `entropy` is False, their
        entropies (with gradient only when `entropy` is True). `trainer.logprob_chunk_tokens` > 0:
        from the final hidden states of the response positions only, chunk by chunk
        (`chunked_logprobs`), padding 0; 0: from the whole micro-batch's logits."""
        ids = self._input_ids(batch)
        length = ids.shape[1]
        # Logits only from the first response position on: position p predicts token p + 1.
        keep = length - min(s.prompt_length for s in batch) + 1
        first = length - keep
        index = response_index(batch, first).to(self.device)
        chunk = self.cfg.trainer.logprob_chunk_tokens
        if chunk and not getattr(_unwrap(model).config, "final_logit_softcapping", None):
            with self._autocast(), self._routing(model, batch, length):
                return self._chunked_forward(model, batch, ids, keep, index, entropy, chunk)
        with self._autocast(), self._routing(model, batch, length):
            logits = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
        labels = torch.nn.functional.pad(ids[:, first + 1 :], (0, 1), value=self.pad_id)
        logprobs = logprobs_from_logits(logits, labels, self.temperature).gather(1, index)
        ent = None
        if entropy is not False:
            with nullcontext() if entropy else torch.no_grad():
                ent = entropy_from_logits(logits, self.temperature).gather(1, index)
        return logprobs, ent

    def _routing(self, model: torch.nn.Module, batch: list[Sample], width: int) -> AbstractContextManager:
        """A MoE model's forward of `batch` under `self.routes` (routing.py `replaying`): the
        replayed routes, the statistics, R2's recording. The routers are found under DDP, a PEFT
        adapter or `AdaptersOff`."""
        if self.routes is None:
            return nullcontext()
        net = _unwrap(model)
        net = getattr(net, "peft_model", net)  # AdaptersOff
        net = net.get_base_model() if hasattr(net, "get_base_model") else net  # PeftModel
        found = routers(net)
        if not found:
            raise RuntimeError(f"routing: {type(net).__name__} is a mixture-of-experts model with no router found")
        return replaying(self.routes, found, batch, width)

    def _chunked_forward(
        self,
        model: torch.nn.Module,
        batch: list[Sample],
        ids: Tensor,
        keep: int,
        index: Tensor,
        entropy: bool | None,
        chunk: int,
    ) -> tuple[Tensor, Tensor | None]:
        """`_forward` without the micro-batch's logits: the model runs (through DDP, whose
        gradient hooks need its forward) with a pre-hook on the LM head that keeps the final
        hidden states and hands the head none of them; the head is then applied to the response
        positions alone, `chunk` at a time."""
        head = _unwrap(model).get_output_embeddings()
        captured: list[Tensor] = []

        def take_hidden(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            captured.append(args[0])
            return (args[0][..., :0, :], *args[1:])  # [B, 0, H]: the head computes no logits

        handle = head.register_forward_pre_hook(take_hidden)
        try:
            model(input_ids=ids, logits_to_keep=keep, use_cache=False)
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError(
                f"trainer.logprob_chunk_tokens: {type(_unwrap(model)).__name__} did not call its LM head with the "
                "hidden states as first argument; set trainer.logprob_chunk_tokens=0"
            )
        hidden = captured[-1]  # [B, keep, H]: positions `first` on, as the logits of the full path
        # (row, response token) of every scored token, row-major: chunks run sample by sample and
        # a chunk may split one; padding is never scored.
        lengths = torch.tensor([s.response_length for s in batch])
        rows, cols = (torch.arange(index.shape[1]) < lengths[:, None]).nonzero(as_tuple=True)
        rows, cols = rows.to(self.device), cols.to(self.device)
        positions = index[rows, cols]
        labels = ids[rows, ids.shape[1] - keep + 1 + positions]  # position p predicts token p + 1
        logprobs, ent = chunked_logprobs(
            hidden[rows, positions], head.weight, labels, self.temperature, chunk, entropy, getattr(head, "bias", None)
        )
        shape = tuple(index.shape)
        logprobs = logprobs.new_zeros(shape).index_put((rows, cols), logprobs)
        if ent is not None:
            ent = ent.new_zeros(shape).index_put((rows, cols), ent)
        return logprobs, ent

    def _accumulate(
        self, batch: list[Sample], idx: list[int], loss_fn: LossFn, entropy: bool | None
    ) -> dict[str, float]:
        with dropout_on(self.model) if self.lora and self.cfg.trainer.lora.dropout else nullcontext():
            return self._backward(
                self.model, self.ddp, batch, idx, lambda net, rows: self._forward(net, rows, entropy), loss_fn
            )

    def _backward(
        self,
        model: torch.nn.Module,
        ddp: DDP | None,
        batch: list[Sample],
        idx: list[int],
        forward: Callable[..., tuple[Tensor, ...]],
        loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    ) -> dict[str, float]:
        """Backward of `loss_fn(batch indices, *forward(model, rows))` over the micro-batches, for
        the policy or the critic (`ddp`: `model`'s wrapper, None on one rank); the summed stats. DDP
        all-reduces on the last micro-batch only. A rank with nothing to train still runs one
        zero-loss backward: DDP needs every rank."""
        groups = self._micro_groups(batch)
        stats: dict[str, float] = {}
        if not groups:
            if ddp is not None:
                dummy = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
                (ddp(input_ids=dummy, use_cache=False).logits.sum() * 0.0).backward()
            return stats
        for n, group in enumerate(groups):
            sync = ddp is None or n == len(groups) - 1
            with nullcontext() if sync else ddp.no_sync():
                rows = [batch[k] for k in group]
                loss, st = loss_fn([idx[k] for k in group], *forward(ddp or model, rows))
                (loss * self.world).backward()
            for key, value in st.items():
                stats[key] = stats.get(key, 0.0) + float(value)
        return stats

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> float:
        clip = self.cfg.trainer.grad_clip
        params = [p for group in optimizer.param_groups for p in group["params"]]  # the policy's or the critic's
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # -- the critic (algorithm.advantage=gae) ------------------------------------------------------

    def _critic_forward(self, net: torch.nn.Module, batch: list[Sample]) -> tuple[Tensor]:
        """Values `[B, R]` of the positions whose logits predict each response token: the state
        before the token, as verl takes them."""
        ids = self._input_ids(batch)
        with self._autocast():
            values = net(input_ids=ids, use_cache=False).logits[..., 0].float()
        return (values.gather(1, response_index(batch, 0).to(self.device)),)

    @torch.no_grad()
    def _values(self, samples: list[Sample]) -> list[Tensor]:
        out: list[Tensor] = [torch.zeros(0, device=self.device)] * len(samples)
        for idx in self._micro_groups(samples):
            (values,) = self._critic_forward(self.critic, [samples[i] for i in idx])
            for i, row in zip(idx, values):
                out[i] = row[: samples[i].response_length].clone()
        return out

    def _accumulate_values(
        self, batch: list[Sample], idx: list[int], loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    ) -> dict[str, float]:
        return self._backward(self.critic, self.critic_ddp, batch, idx, self._critic_forward, loss_fn)

    def _critic_step(self) -> float:
        return self._optimizer_step(self.critic_optimizer)

    # -- data parallelism ------------------------------------------------------------------------

    def _all_reduce(self, t: Tensor) -> Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    # -- weights out and in ----------------------------------------------------------------------

    def hf_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every rank holds the whole model: its parameters, a tied one under its first name, in
        the compute dtype (fp32: the parameters themselves, or contiguous views of them). Fused
        MoE experts go under their checkpoint names, one tensor per expert, as SGLang loads them."""
        for name, t in checkpoint_tensors(self.model.named_parameters()):
            yield name, t.detach().to(self.dtype).contiguous()

    def adapter_tensors(self, policy: str | None = None) -> dict[str, Tensor]:
        """trainer.lora: the adapter under its PEFT names (what the engines load and are pushed),
        in the compute dtype; `policy`: that policy's."""
        return {name: t.to(self.dtype) for name, t in adapter_tensors(self.model, policy or "default").items()}

    def adapter_config(self, policy: str | None = None) -> dict[str, Any]:
        """trainer.lora: the adapter's `adapter_config.json`."""
        return adapter_config(self.model, policy or "default")

    def state_dict(self) -> dict[str, Any]:
        if self.policies:  # each policy's adapter, optimiser and schedule
            return {
                "policies": {
                    name: {
                        "adapter": adapter_tensors(self.model, name),
                        "optimizer": o.state_dict(),
                        "scheduler": s.state_dict(),
                    }
                    for name, (o, s, _) in self.per_policy.items()
                }
            }
        weights = {"adapter": adapter_tensors(self.model)} if self.lora else {"model": self.model.state_dict()}  # fp32
        state = {**weights, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if (
            self.ref is not None and not self.cfg.trainer.ref_model and not self.lora
        ):  # a copy of the policy: not on disk
            state["ref"] = self.ref.state_dict()
        if self.critic is not None:
            state["critic"] = {"model": self.critic.state_dict(), "optimizer": self.critic_optimizer.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state.get("policies", {})) != sorted(self.policies):
            raise ValueError(
                f"policies: this run's are {self.policies}, the checkpoint's {sorted(state.get('policies', {}))}; "
                "resume with the policies it was saved with"
            )
        if self.policies:
            for name, (optimizer, scheduler, _) in self.per_policy.items():
                load_adapter_tensors(self.model, state["policies"][name]["adapter"], name)
                optimizer.load_state_dict(state["policies"][name]["optimizer"])
                scheduler.load_state_dict(state["policies"][name]["scheduler"])
            return
        if ("adapter" in state) != self.lora:
            raise ValueError(
                f"trainer.lora.enabled={self.lora}, but the checkpoint was saved by a run "
                f"{'with' if 'adapter' in state else 'without'} LoRA; resume with the setting it was saved with"
            )
        if self.lora:
            load_adapter_tensors(self.model, state["adapter"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "ref" in state:
            self.ref = self._frozen_copy(state["ref"])
        if self.critic is not None:
            if "critic" not in state:
                raise ValueError(
                    "algorithm.advantage=gae: the checkpoint has no critic (saved by a run without one); start afresh"
                )
            self.critic.load_state_dict(state["critic"]["model"])
            self.critic_optimizer.load_state_dict(state["critic"]["optimizer"])

    def save_hf(self, path: str) -> None:
        """With LoRA: a PEFT adapter directory, and with `trainer.lora.export_merged` the merged HF
        model in `path/merged` (merged in a copy: the policy keeps its adapter)."""
        if self.rank != 0:
            return
        if self.policies:  # each policy's adapter in its own directory, path/NAME
            for name in self.policies:
                write_adapter_dir(
                    Path(path) / name, adapter_config(self.model, name), adapter_tensors(self.model, name)
                )
                self.tokenizer.save_pretrained(Path(path) / name)
            return
        if self.lora:  # the adapter as the engines load it (the experts' per expert)
            write_adapter_dir(path, adapter_config(self.model), adapter_tensors(self.model))
        else:
            self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self.lora and self.cfg.trainer.lora.export_merged:
            merged = copy.deepcopy(self.model).merge_and_unload()
            merged.save_pretrained(Path(path) / "merged")
            self.tokenizer.save_pretrained(Path(path) / "merged")
