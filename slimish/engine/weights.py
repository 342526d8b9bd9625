"""The engine's receive side of weight updates (docs/protocol.md 2.1-2.3, 4).

A `WeightUpdater` maps HF checkpoint names onto one model's parameters (a MoE model's fused
experts by their per-expert checkpoint names, as SGLang loads them) and loads new values from a
trainer's broadcast or from a checkpoint directory. Requests are validated before the
first receive (a receive the trainer never sends would desync the collective).

A broadcast whose wire dtype is the parameter's own is received straight into the parameter:
copying out of a receive buffer afterwards costs as much as the transfer (1 GB: 0.6-0.8x of raw
bandwidth with the copy, 0.9x without). The price is that a broadcast which dies halfway leaves
those parameters torn, half old and half new. `torn` names them until a later update writes
them whole again; the engine refuses to generate meanwhile. Other updates (dtype conversion,
flattened buckets, checkpoints) still land all-or-nothing.
The engine serialises calls, pauses generation and keeps the weight version; this class
does not.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from slimish import moe
from slimish.distributed import (
    ProcessGroup,
    destroy_custom_process_group,
    flattened_layout,
    init_custom_process_group,
    parse_dtype,
)
from slimish.engine.runner import use_device
from slimish.protocol import InitWeightsUpdateGroupReq, UpdateWeightsFromDistributedReq


@dataclass
class Tensors:
    """What a push writes into: the model's parameters, or one LoRA adapter's tensors. `canonical`
    maps each name to the first name of its tensor; `torn` names tensors a failed push left
    half-written (by canonical name, with why). `fused` maps a fused expert parameter's name to
    the checkpoint names it stands for: they are what the table holds, the fused one is refused."""

    params: dict[str, torch.Tensor]
    what: str  # what one of them is, for errors: "a parameter of this model"
    torn: dict[str, str] = field(default_factory=dict)
    fused: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        first: dict[int, str] = {}
        self.canonical = {name: first.setdefault(id(p), name) for name, p in self.params.items()}

    def unknown(self, name: str) -> str:
        """Why `name` is not in the table (a fused expert name: the checkpoint names to use)."""
        why = f"{name!r} is not {self.what}"
        per_expert = self.fused.get(name.removesuffix(".weight"))
        if per_expert:
            why += (
                f"; its experts are named as in the checkpoint (and as SGLang loads them), one tensor per expert: "
                f"{per_expert[0]!r} ... {per_expert[-1]!r}"
            )
        return why


class WeightUpdater:
    def __init__(self, model: torch.nn.Module, timeout: timedelta | None = None) -> None:
        # Tied weights appear under every name (lm_head.weight and model.embed_tokens.weight),
        # so a push under either name lands in the one shared tensor. Fused MoE experts appear
        # under their checkpoint names only, as views of the fused tensor: each its own tensor
        # (for torn pushes), received in place into the model.
        named = dict(model.named_parameters(remove_duplicate=False))
        fused = {name: moe.per_expert_names(name, p) for name, p in named.items() if moe.is_fused_experts(name)}
        views = moe.checkpoint_tensors((name, p.detach() if name in fused else p) for name, p in named.items())
        self.model = Tensors(dict(views), "a parameter of this model", fused=fused)
        self.params, self.canonical, self.torn = (
            self.model.params,
            self.model.canonical,
            self.model.torn,
        )  # the model's, for short
        self.device = next(iter(self.params.values())).device  # receive buffers live there too (NCCL needs it)
        self.timeout = timeout
        self.groups: dict[str, ProcessGroup] = {}
        # Receive buffers are kept between pushes: allocating fresh memory per receive costs
        # as much as the transfer itself (docs/benchmarks.md, CPU facts).
        self.recv_buffers: dict[str, torch.Tensor] = {}
        self.bucket_buffer = torch.empty(0, dtype=torch.uint8, device=self.device)

    # -- groups --------------------------------------------------------------------------

    def init_group(self, req: InitWeightsUpdateGroupReq) -> None:
        """Join `req.group_name` as rank `rank_offset` (tp_size is 1); blocks until all joined."""
        if req.group_name in self.groups:
            raise ValueError(f"group_name {req.group_name!r} already exists; destroy it first")
        use_device(self.device)  # called on a worker thread
        self.groups[req.group_name] = init_custom_process_group(
            req.backend,
            f"tcp://{req.master_address}:{req.master_port}",
            world_size=req.world_size,
            rank=req.rank_offset,
            group_name=req.group_name,
            timeout=self.timeout,
        )

    def destroy_group(self, name: str) -> None:
        if name not in self.groups:
            raise ValueError("The group to be destroyed does not exist.")
        destroy_custom_process_group(self.groups.pop(name))

    # -- updates -------------------------------------------------------------------------

    def update_from_distributed(self, req: UpdateWeightsFromDistributedReq, target: Tensors | None = None) -> None:
        """Receive `req.names` from rank 0 of `req.group_name` and load them into `target` (the model's parameters by default)."""
        target = target or self.model
        group = self.groups.get(req.group_name)
        if group is None:
            raise ValueError(f"group_name {req.group_name!r} is not an initialised weight-update group")
        if not req.names:
            raise ValueError("names is empty")
        dtypes = self._validate(target, req.names, req.dtypes, req.shapes)
        if req.load_format == "flattened_bucket":
            self._load(target, zip(req.names, self._recv_flattened(group, req.names, dtypes, req.shapes)))
        else:
            self._recv_each(target, group, req.names, dtypes, req.shapes)

    def await_full_push(self) -> None:
        """Count every parameter as missing until an update writes it (`--await-weights`)."""
        self.torn.update(
            dict.fromkeys(self.canonical.values(), "have not been pushed since this engine started (--await-weights)")
        )

    def torn_error(self) -> str | None:
        """Why generating now would use weights that are not whole, or None."""
        if not self.torn:
            return None
        names = sorted(self.torn)
        return (
            f"weights are not whole: {len(names)} parameters (e.g. {names[0]!r}) {self.torn[names[0]]}; "
            "push them (or update_weights_from_disk) before generating"
        )

    def update_from_disk(self, model_path: str) -> None:
        """Load every parameter from the `*.safetensors` files of an HF checkpoint directory."""
        if not Path(model_path).is_dir():
            raise ValueError(f"model_path {model_path!r} is not a directory")
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"model_path {model_path!r}: no *.safetensors files found")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            for name, tensor in load_file(file).items():
                if name in state:
                    raise ValueError(f"model_path {model_path!r}: {name!r} appears in more than one file")
                state[name] = tensor
        self._check_checkpoint(model_path, state)
        self._load(self.model, state.items())
        self.torn.clear()  # the checkpoint covers every parameter

    def get_weights_by_name(self, name: str, truncate_size: int, target: Tensors | None = None) -> list:
        """The first `truncate_size` rows of a parameter as float32 nested lists (as SGLang)."""
        target = target or self.model
        if name not in target.params:
            raise ValueError(f"name {target.unknown(name)}")
        return target.params[name].detach()[:truncate_size].to(torch.float32).tolist()

    # -- internals -----------------------------------------------------------------------

    def _validate(
        self, target: Tensors, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> list[torch.dtype]:
        resolved, seen = [], set()
        for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
            if name not in target.params:
                raise ValueError(f"names[{i}]: {target.unknown(name)}")
            if name in seen:
                raise ValueError(f"names[{i}]: {name!r} is listed twice")
            seen.add(name)
            self._check_shape(target, f"shapes[{i}]", name, shape)
            try:
                resolved.append(parse_dtype(dtype))
            except ValueError as e:
                raise ValueError(f"dtypes[{i}] for {name!r}: {e}") from None
        return resolved

    def _check_shape(self, target: Tensors, field: str, name: str, shape: Sequence[int]) -> None:
        expected = list(target.params[name].shape)
        if list(shape) != expected:
            raise ValueError(f"{field}: {list(shape)} for {name!r} does not match the parameter's shape {expected}")

    def _check_checkpoint(self, model_path: str, state: dict[str, torch.Tensor]) -> None:
        extra = sorted(set(state) - set(self.params))
        if extra:
            raise ValueError(f"model_path {model_path!r}: names not in this model: {extra[:5]}")
        by_tensor: dict[int, list[str]] = {}
        for name, param in self.params.items():
            by_tensor.setdefault(id(param), []).append(name)
        missing = [names[0] for names in by_tensor.values() if not any(n in state for n in names)]
        if missing:
            raise ValueError(f"model_path {model_path!r}: parameters missing from the checkpoint: {missing[:5]}")
        for name, tensor in state.items():
            self._check_shape(self.model, f"model_path {model_path!r}", name, tensor.shape)

    def _recv_each(
        self,
        target: Tensors,
        group: ProcessGroup,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
    ) -> None:
        """Receive into the parameters themselves where the dtypes agree, else into kept buffers
        that are copied in once everything arrived."""
        targets, in_place, converted = [], [], []
        for name, dtype, shape in zip(names, dtypes, shapes):
            param = target.params[name].data
            # A tied tensor sent under both names is received once in place, once into a buffer.
            if param.dtype == dtype and param.is_contiguous() and target.canonical[name] not in in_place:
                targets.append(param)
                in_place.append(target.canonical[name])
                continue
            buf = self.recv_buffers.get(name)
            if buf is None or buf.dtype != dtype or list(buf.shape) != list(shape):
                buf = self.recv_buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
            targets.append(buf)
            converted.append((name, buf))
        try:
            # Issued in list order, as the trainer sends them; gloo matches them in that order.
            works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in targets]
            for work in works:
                work.wait()
        except Exception as exc:
            target.torn.update(dict.fromkeys(in_place, f"were half-received when a broadcast failed ({exc})"))
            raise
        for name in in_place:
            target.torn.pop(name, None)
        self._load(target, converted)

    def _recv_flattened(
        self, group: ProcessGroup, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        ranges = flattened_layout(names, dtypes, shapes)
        total = ranges[-1][1]
        if self.bucket_buffer.numel() < total:
            self.bucket_buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        flat = self.bucket_buffer[:total]
        dist.broadcast(flat, src=0, group=group)
        return [flat[start:end].view(dtype).view(shape) for (start, end), dtype, shape in zip(ranges, dtypes, shapes)]

    @torch.no_grad()
    def _load(self, target: Tensors, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            target.params[name].copy_(tensor)
            target.torn.pop(target.canonical[name], None)
