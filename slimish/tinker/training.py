"""Training state of the Tinker server: one base model, one LoRA adapter and one AdamW per Tinker model.

Why one base: a Tinker `create_model` is a LoRA adapter over the server's base model, so N clients
cost one copy of the base weights and N small adapters (PEFT's multi-adapter model: each adapter
under its own PEFT name, `set_adapter` picks the one a call trains). Isolation is by construction:
only the active adapter is in the graph and requires grad, so one client's backward never touches
another's gradients, and each adapter has its own optimizer (its own Adam moments and step count).
Gradients accumulate over `forward_backward` calls until `optim_step`, as Tinker's do.

Everything here is plain Python and torch (no HTTP, no protobuf): the server turns requests into
these calls. The calls are serialised by one lock, because the active adapter is the shared
model's state; the server orders each model's calls by `seq_id` before they get here.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from slimish.tinker.config import TinkerConfig
from slimish.tinker.losses import check_inputs, check_loss, datum_loss
from slimish.trainer.batch import micro_batches
from slimish.trainer.config import LoraConfig
from slimish.trainer.lora import (
    ADAPTER_WEIGHTS,
    adapter_config,
    adapter_tensors,
    load_adapter_tensors,
    peft_config,
    write_adapter_dir,
)

LORA_ALPHA = 32.0  # Tinker's (tinker_cookbook 0.6.1: hyperparam_utils.py:66, lora_alpha=32), whatever the rank
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")  # on a MoE model: every expert's too
UNEMBED_MODULES = ("lm_head",)
MODEL_FILE, OPTIMIZER_FILE = "tinker_model.json", "optimizer.pt"


@dataclass
class Datum:
    """One Tinker datum: the model input's tokens and its `loss_fn_inputs` arrays (target_tokens,
    weights, logprobs, advantages, ...), position i of `tokens` predicting `target_tokens[i]`."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class AdamParams:
    """One `optim_step`'s hyperparameters, Tinker's names and defaults (tinker 0.38.0:
    types/optimizer.py): AdamW with decoupled weight decay; `grad_clip_norm` 0 means no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "weight_decay", "grad_clip_norm"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"adam_params.{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"adam_params.{name}: must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"adam_params.eps: must be > 0, got {self.eps}")


@dataclass
class LoraSpec:
    """What `create_model`'s lora_config asked for (tinker 0.38.0: types/lora_config.py)."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def target_modules(self) -> list[str]:
        targets = [
            *(ATTN_MODULES if self.train_attn else ()),
            *(MLP_MODULES if self.train_mlp else ()),
            *(UNEMBED_MODULES if self.train_unembed else ()),
        ]
        if not targets:
            raise ValueError("lora_config: train_attn, train_mlp and train_unembed are all false; nothing would train")
        return targets


@dataclass
class _Model:
    adapter: str  # its PEFT adapter name
    spec: LoraSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW


class TinkerModels:
    """The base model at `model_dir` (fp32, frozen) and the Tinker models trained on it, by model id."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        micro_batch_tokens: int = TinkerConfig.micro_batch_tokens,
        chunk_tokens: int = TinkerConfig.logprob_chunk_tokens,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = str(model_dir)
        self.device = torch.device(device)
        self.base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device).eval()
        self.base.requires_grad_(False)
        self.vocab_size = self.base.get_output_embeddings().weight.shape[0]
        self.micro_batch_tokens, self.chunk_tokens = micro_batch_tokens, chunk_tokens
        self.peft: Any = None  # the PeftModel, from the first create on
        self.models: dict[str, _Model] = {}
        self._names = (f"m{i}" for i in itertools.count())
        self._lock = threading.RLock()

    # -- models ----------------------------------------------------------------------------------

    def create(
        self,
        model_id: str,
        rank: int,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> None:
        """A fresh adapter (A random from `seed`, B = 0: the model starts as the base) and its optimizer."""
        self._add(model_id, LoraSpec(rank, seed, train_mlp, train_attn, train_unembed))

    def _add(self, model_id: str, spec: LoraSpec) -> _Model:
        with self._lock:
            if model_id in self.models:
                raise ValueError(f"model_id {model_id!r}: already exists")
            lora = LoraConfig(enabled=True, rank=spec.rank, alpha=LORA_ALPHA, target_modules=spec.target_modules())
            name = next(self._names)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                if spec.seed is not None:
                    torch.manual_seed(spec.seed)
                else:
                    torch.seed()  # a fresh random init, and the caller's RNG stream left as it was
                if self.peft is None:
                    from peft import get_peft_model

                    self.peft = get_peft_model(self.base, peft_config(self.base, lora), adapter_name=name).eval()
                else:
                    self.peft.add_adapter(name, peft_config(self.base, lora))
            params = [p for n, p in self.peft.named_parameters() if f".{name}." in n]
            optimizer = torch.optim.AdamW(params, lr=AdamParams.learning_rate)
            self.models[model_id] = model = _Model(name, spec, params, optimizer)
            return model

    def spec(self, model_id: str) -> LoraSpec:
        return self._get(model_id).spec

    def release(self, model_id: str) -> None:
        """Drop a model: its adapter, gradients and optimizer."""
        with self._lock:
            model = self._get(model_id)
            del self.models[model_id]
            if self.models:
                self.peft.delete_adapter(model.adapter)
            else:  # PEFT keeps at least one adapter: start over from the bare base
                self.base = self.peft.unload()
                self.peft = None

    def _get(self, model_id: str) -> _Model:
        model = self.models.get(model_id)
        if model is None:
            raise KeyError(f"model_id {model_id!r}: no such model")
        return model

    # -- training --------------------------------------------------------------------------------

    def forward_backward(
        self,
        model_id: str,
        datums: list[Datum],
        loss_fn: str,
        config: Mapping[str, float | str] | None = None,
        forward_only: bool = False,
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Each datum's `logprobs` of its targets (float32, the targets' shape) and the metrics
        (`loss:sum`: the summed loss); unless `forward_only`, the loss's gradient is ADDED to the
        model's gradients, which `optim_step` applies and clears."""
        check_loss(loss_fn, config)
        config = {k: float(v) for k, v in (config or {}).items()}
        rows = [self._tensors(i, d, loss_fn) for i, d in enumerate(datums)]
        with self._lock:
            model = self._get(model_id)
            self.peft.set_adapter(model.adapter)
            outputs: list[dict[str, np.ndarray]] = [{} for _ in rows]
            total = 0.0
            for group in micro_batches([len(r[0]) for r in rows], self.micro_batch_tokens):
                with torch.set_grad_enabled(not forward_only):
                    lps = self._logprobs([rows[i][0] for i in group], [rows[i][1]["target_tokens"] for i in group])
                    loss = sum(
                        (datum_loss(loss_fn, lp, rows[i][1], config) for i, lp in zip(group, lps)),
                        torch.zeros((), device=self.device),
                    )
                if not forward_only:
                    loss.backward()
                total += float(loss.detach())
                for i, lp in zip(group, lps):
                    outputs[i]["logprobs"] = lp.detach().to("cpu", torch.float32).numpy()
        return outputs, {"loss:sum": total}

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        """One AdamW step on the accumulated gradients (clipped to `grad_clip_norm` when > 0), then
        the gradients cleared. Metrics: the gradient norm before clipping."""
        with self._lock:
            model = self._get(model_id)
            for group in model.optimizer.param_groups:
                group.update(
                    lr=params.learning_rate,
                    betas=(params.beta1, params.beta2),
                    eps=params.eps,
                    weight_decay=params.weight_decay,
                )
            clip = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(model.params, clip)
            model.optimizer.step()
            model.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm:mean": float(norm)}

    # -- checkpoints -----------------------------------------------------------------------------

    def export_adapter(self, model_id: str, path: str | Path) -> Path:
        """The model's adapter as a PEFT adapter directory (what the engines' `load_lora_adapter` reads)."""
        with self._lock:
            model = self._get(model_id)
            return write_adapter_dir(
                path, adapter_config(self.peft, model.adapter), adapter_tensors(self.peft, model.adapter)
            )

    def save_state(self, model_id: str, path: str | Path, optimizer: bool = True) -> Path:
        """The adapter directory, the LoRA spec and (with `optimizer`) the optimizer's state:
        what `load_state` needs to continue exactly where this model is."""
        with self._lock:
            model = self._get(model_id)
            path = self.export_adapter(model_id, path)
            (path / MODEL_FILE).write_text(json.dumps(asdict(model.spec)))
            if optimizer:
                torch.save(model.optimizer.state_dict(), path / OPTIMIZER_FILE)
            else:  # an earlier save's moments would not belong to these weights
                (path / OPTIMIZER_FILE).unlink(missing_ok=True)
            return path

    def load_state(self, model_id: str, path: str | Path, optimizer: bool = True) -> None:
        """`save_state`'s directory into `model_id` (created with the saved spec if it does not
        exist), gradients cleared; the optimizer's state too with `optimizer`, else a fresh one."""
        path = Path(path)
        try:
            spec = LoraSpec(**json.loads((path / MODEL_FILE).read_text()))
        except FileNotFoundError:
            raise ValueError(f"{path}: not a saved training state (no {MODEL_FILE})") from None
        if optimizer and not (path / OPTIMIZER_FILE).exists():
            raise ValueError(f"{path}: saved without the optimizer state; load it with optimizer=False")
        with self._lock:
            model = self.models.get(model_id) or self._add(model_id, spec)
            if (model.spec.rank, model.spec.target_modules()) != (spec.rank, spec.target_modules()):
                raise ValueError(
                    f"{path}: saved with rank {spec.rank} on {spec.target_modules()}, but model {model_id!r} has rank "
                    f"{model.spec.rank} on {model.spec.target_modules()}"
                )
            load_adapter_tensors(
                self.peft, load_file(str(path / ADAPTER_WEIGHTS), device=str(self.device)), model.adapter
            )
            model.optimizer.zero_grad(set_to_none=True)
            model.optimizer = torch.optim.AdamW(model.params, lr=AdamParams.learning_rate)
            if optimizer:
                model.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location=self.device))

    # -- internals -------------------------------------------------------------------------------

    def _tensors(self, i: int, datum: Datum, loss_fn: str) -> tuple[Tensor, dict[str, Tensor]]:
        """A datum as tensors on the device, checked against the loss and the vocabulary."""
        where = f"datum {i}"
        tokens = torch.as_tensor(datum.tokens, dtype=torch.long)
        if tokens.dim() != 1 or len(tokens) == 0:
            raise ValueError(f"{where}: model_input must be a non-empty list of tokens")
        inputs = {
            k: torch.as_tensor(np.asarray(v), dtype=torch.long if k == "target_tokens" else torch.float32)
            for k, v in datum.inputs.items()
        }
        check_inputs(loss_fn, len(tokens), inputs, where)
        for name, ids in (("model_input", tokens), ("loss_fn_inputs['target_tokens']", inputs["target_tokens"])):
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                raise ValueError(f"{where}: {name} has token ids outside the vocabulary [0, {self.vocab_size})")
        return tokens.to(self.device), {k: v.to(self.device) for k, v in inputs.items()}

    def _logprobs(self, tokens: list[Tensor], targets: list[Tensor]) -> list[Tensor]:
        """log p(target) of each row under the active adapter, the targets' shape (`[N]` or `[N, K]`).

        Rows are right-padded into one forward (causal: padding never reaches a real position); the
        LM head runs on the final hidden states chunk by chunk (`HeadLogprobs`), never holding a
        `[rows x tokens, vocab]` logits tensor, with the adapter's head delta merged into its weight."""
        ids = torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True)
        hidden = _final_hidden(self.peft, ids)
        head = self.peft.get_output_embeddings()
        base = getattr(head, "base_layer", head)
        weight = base.weight
        if self.peft.active_adapter in getattr(head, "lora_A", {}):
            weight = weight + head.get_delta_weight(self.peft.active_adapter)
        picked, labels = [], []
        for row, (n, target) in enumerate(zip((len(t) for t in tokens), targets)):
            k = target.shape[1] if target.dim() == 2 else 1
            picked.append(hidden[row, :n].repeat_interleave(k, dim=0))
            labels.append(target.reshape(-1))
        lps = HeadLogprobs.apply(torch.cat(picked), weight, base.bias, torch.cat(labels), self.chunk_tokens)
        return [lp.view(t.shape) for lp, t in zip(lps.split([t.numel() for t in targets]), targets)]


class HeadLogprobs(torch.autograd.Function):
    """log p(label) `[N]` from hidden states `[N, H]` through the LM head (`weight` `[V, H]`, `bias`),
    `chunk` rows at a time, with a hand-written backward.

    Why not `chunked_logprobs` (the trainer's checkpointed chunks): with a Tinker-sized vocabulary
    (Qwen3's 151936) the head is most of a small model's forward_backward, and autograd through
    logsumexp and gather makes several `[chunk, V]` temporaries per chunk. Here forward keeps only
    each row's logsumexp, and backward recomputes a chunk's logits once and turns them in place
    into the gradient `g * (onehot - softmax)`: the same numbers as `logprobs_from_logits`, in
    about half the time on CPU. The bias (a frozen base's) gets no gradient."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk: int) -> Tensor:
        out, lse = [], []
        for start in range(0, hidden.shape[0], chunk):
            logits = torch.nn.functional.linear(hidden[start : start + chunk], weight, bias).float()
            lse.append(logits.logsumexp(-1))  # `logprobs_from_logits`' formula, its logsumexp kept
            out.append(logits.gather(-1, labels[start : start + chunk, None])[:, 0] - lse[-1])
        ctx.save_for_backward(hidden, weight, bias, labels, torch.cat(lse))
        ctx.chunk = chunk
        return torch.cat(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        d_hidden = torch.empty_like(hidden) if want_hidden else None
        d_weight = torch.zeros_like(weight) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            g = grad[rows, None]
            d_logits = torch.nn.functional.linear(hidden[rows], weight, bias)
            d_logits.sub_(lse[rows, None]).exp_().mul_(-g)  # -g * softmax
            d_logits.scatter_add_(1, labels[rows, None], g)  # + g at the label
            if d_hidden is not None:
                d_hidden[rows] = d_logits @ weight
            if d_weight is not None:
                d_weight.addmm_(d_logits.T, hidden[rows])
        return d_hidden, d_weight, None, None, None


def _final_hidden(model: torch.nn.Module, ids: Tensor) -> Tensor:
    """The final hidden states `[B, T, H]` that the LM head would read: a pre-hook on the head keeps
    them and hands the head none, so no logits are computed here."""
    captured: list[Tensor] = []

    def take(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        captured.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(take)
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(model).__name__} did not call its LM head with the hidden states")
    return captured[-1]
