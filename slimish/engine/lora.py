"""LoRA serving for the built-in engine: loaded adapters, the batch's adapter slots, and the
target linears that add each row's adapter delta.

Why this shape (S-LoRA's, small): a loaded adapter keeps its tensors whole, under the names
PEFT writes (`adapter_model.safetensors`, `get_peft_model_state_dict`), so a trainer pushes
into them by those names and reads them back exactly. The running batch draws on a fixed pool
of `max_loras_per_batch` slots: each target linear holds every slot's A and scaled B, padded
to `max_lora_rank`, so one batched matmul serves rows of different adapters in one step. Slot
0 is all zeros: base rows get no delta. A row whose adapter finds no slot (every slot holds an
adapter a running row uses) waits.

An adapter directory may instead be a colocated trainer's shared weight store (slimish/colocate.py:
`layout.json` beside `adapter_config.json`): its tensors are then views of the trainer's memory,
copied into the slot by `/update_weight_version` with `lora_name` once the trainer wrote them, and
never written here.

The linears are hooked, not replaced, so parameter names stay the HF ones that full weight
pushes and `/get_weights_by_name` use. A MoE model's fused experts take adapters per expert,
under SGLang's names (`...mlp.experts.{e}.{gate,up,down}_proj.lora_A.weight`, sglang 0.5.23:
python/sglang/srt/lora/lora.py:35): their forward is wrapped (`LoraExperts`). The router is never
a target. Everything here runs on the scheduler thread.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from slimish.colocate import LAYOUT, WeightStore
from slimish.engine.config import EngineConfig
from slimish.moe import EXPERT_PROJECTIONS, fused_experts, router_paths
from slimish.protocol import DEFAULT_WEIGHT_VERSION

PEFT_PREFIX = "base_model.model."  # PEFT's name for the wrapped model, in front of every HF module path
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
ALL_TARGETS = "all"
LM_HEAD = "lm_head"
# The fused-experts layout `LoraExperts` serves (transformers 5's `use_experts_implementation` attributes).
EXPERTS_LAYOUT = {
    "is_transposed": False,
    "is_concatenated": True,
    "has_bias": False,
    "has_gate": True,
    "has_post_expert_norm": False,
}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot be loaded or used here; the message names it and the reason."""


@dataclass
class AdapterRef:
    """Which adapter to load under which name (`--lora-paths` entry, `/load_lora_adapter` body)."""

    name: str
    path: str
    pinned: bool = False

    @classmethod
    def parse(cls, entry: str) -> "AdapterRef":
        """SGLang's three forms: PATH (named by its path), NAME=PATH, or JSON."""
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
                return cls(str(spec["lora_name"]), str(spec["lora_path"]), bool(spec.get("pinned", False)))
            except (ValueError, KeyError, TypeError) as exc:
                raise AdapterError(
                    f'lora_paths: {entry!r} is not JSON {{"lora_name", "lora_path", "pinned"}} ({exc})'
                ) from None
        name, sep, path = entry.partition("=")
        return cls(name, path) if sep else cls(entry, entry)


@dataclass
class Adapter:
    """A loaded adapter: its tensors (model dtype and device), how much its delta is scaled, its
    weight version, and which tensors a failed push left half-written (`torn`)."""

    name: str
    path: str
    rank: int
    scaling: float
    tensors: dict[str, torch.Tensor]
    pinned: bool = False
    mapped: bool = False  # its tensors are a colocated trainer's (a shared store): never written here
    version: str = DEFAULT_WEIGHT_VERSION
    torn: dict[str, str] = field(default_factory=dict)
    uid: int = field(
        default_factory=itertools.count().__next__
    )  # this load of it: KV made under another never serves it

    def modules(self) -> dict[str, tuple[str, str]]:
        """HF module path -> (its lora_A name, its lora_B name)."""
        out: dict[str, tuple[str, str]] = {}
        for name in self.tensors:
            module = module_of(name)
            out[module] = (f"{PEFT_PREFIX}{module}{LORA_SUFFIXES[0]}", f"{PEFT_PREFIX}{module}{LORA_SUFFIXES[1]}")
        return out

    def torn_error(self) -> str | None:
        if not self.torn:
            return None
        names = sorted(self.torn)
        return (
            f"lora adapter {self.name!r} is not whole: {len(names)} tensors (e.g. {names[0]!r}) {self.torn[names[0]]}; "
            "push it again (or unload and load it) before generating with it"
        )


def module_of(name: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> `model.layers.0.self_attn.q_proj`."""
    if name.startswith(PEFT_PREFIX) and name.endswith(LORA_SUFFIXES):
        return name[len(PEFT_PREFIX) : -len(LORA_SUFFIXES[0])]
    raise AdapterError(
        f"{name!r} is not a PEFT LoRA tensor name (base_model.model.<module>.lora_A.weight or .lora_B.weight)"
    )


def read_adapter(ref: AdapterRef, dtype: torch.dtype, device: torch.device) -> Adapter:
    """An adapter from its PEFT directory; what PEFT features this engine does not serve are refused."""
    where = f"lora adapter {ref.name!r} ({ref.path})"
    root = Path(ref.path)
    shared = (root / LAYOUT).is_file()  # a colocated trainer's adapter store: mapped, not copied
    if not (root / CONFIG_FILE).is_file() or not (shared or (root / WEIGHTS_FILE).is_file()):
        raise AdapterError(
            f"{where}: expected a PEFT adapter directory with {CONFIG_FILE} and {WEIGHTS_FILE} "
            f"(or a shared weight store's {LAYOUT})"
        )
    try:
        cfg = json.loads((root / CONFIG_FILE).read_text())
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
        if shared:
            tensors = mapped_tensors(WeightStore(root), dtype, device)
        else:
            tensors = {
                name: t.to(dtype=dtype, device=device).contiguous()
                for name, t in load_file(root / WEIGHTS_FILE).items()
            }
    except Exception as exc:  # unreadable JSON, no `r`, a broken safetensors file: name the adapter and the cause
        raise AdapterError(f"{where}: cannot read it ({type(exc).__name__}: {exc})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type is {cfg['peft_type']!r}; only LORA is served")
    unsupported = {
        "use_dora": False,
        "fan_in_fan_out": False,
        "lora_bias": False,
        "bias": "none",
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    for key, plain in unsupported.items():
        if cfg.get(key) not in (None, plain):
            raise AdapterError(f"{where}: {key}={cfg[key]!r} is not served by this engine (expected {plain!r})")
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    adapter = Adapter(ref.name, ref.path, rank, scaling, tensors, ref.pinned, mapped=shared)
    try:
        pairs = adapter.modules()
    except AdapterError as exc:
        raise AdapterError(f"{where}: {exc}") from None
    for module, (a, b) in pairs.items():
        if a not in tensors or b not in tensors:
            raise AdapterError(f"{where}: {module} has only one of lora_A / lora_B")
        if tensors[a].shape[0] != rank or tensors[b].shape[1] != rank:
            raise AdapterError(
                f"{where}: {module} has rank {tensors[a].shape[0]}, but adapter_config.json says r={rank}"
            )
    if not pairs:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")
    return adapter


def mapped_tensors(store: WeightStore, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """A shared store's tensors as an adapter's, views (the trainer's memory: its writes are what a
    slot refresh copies in); only where they need no conversion, or they would be a copy."""
    tensors = {name: store.view(name) for name in store.names()}
    if odd := sorted(name for name, t in tensors.items() if (t.dtype, t.device) != (dtype, device)):
        raise ValueError(f"{odd[0]} is {tensors[odd[0]].dtype}, the engine's dtype is {dtype} on {device}")
    return tensors


def check_targets(model: nn.Module, targets: set[str], kinds: list[str]) -> None:
    """`lora_target_modules` must name this model's linears or expert projections, never its MoE router."""
    paths = router_paths(model)
    if gates := sorted(targets & {path.split(".")[-1] for path in paths}):
        raise AdapterError(
            f"lora_target_modules: {gates} is this model's MoE router (e.g. {paths[0]}); LoRA on the "
            "router is not served: target the experts (gate_proj, up_proj, down_proj) instead"
        )
    if unknown := targets - set(kinds) - {ALL_TARGETS}:
        raise AdapterError(
            f"lora_target_modules: {sorted(unknown)} are not linear layers of this model; it has {kinds} (or all)"
        )


class _Rows:
    """Per forward: the slot of each batch row (None when every row is a base row)."""

    index: torch.Tensor | None = None


class LoraLinear:
    """One target linear's slot stack: A [slots, rank, in] and scaled B [slots, out, rank]. Its
    forward hook adds `x A_s^T (scale B_s)^T` to each row with slot s."""

    def __init__(self, module: nn.Linear, slots: int, rank: int, rows: _Rows) -> None:
        w = module.weight
        self.a = torch.zeros(slots, rank, module.in_features, dtype=w.dtype, device=w.device)
        self.b = torch.zeros(slots, module.out_features, rank, dtype=w.dtype, device=w.device)
        self.rows = rows
        module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
        index = self.rows.index
        if index is None:
            return None
        x = inputs[0].reshape(len(index), -1, inputs[0].shape[-1])
        h = torch.bmm(x, self.a[index].transpose(1, 2))
        return out + torch.bmm(h, self.b[index].transpose(1, 2)).view(out.shape)

    def shapes(self, rank: int) -> tuple[list[int], list[int]]:
        """The shapes of an adapter's A and B for this module, at `rank`."""
        return [rank, self.a.shape[2]], [self.b.shape[1], rank]

    def fill(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        fill_slot(self.a[slot], self.b[slot], a, b, scaling)


class LoraExperts:
    """One MoE layer's fused experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) with every
    slot's per-expert A and scaled B for gate, up and down (SGLang's per-expert adapter form: gate
    and up keep their own A). The experts' forward is wrapped, not replaced: with no adapter row in
    the batch the model's own (grouped) path runs untouched; otherwise an eager per-expert loop,
    the one transformers' eager path runs, adds each token's slot delta to each projection."""

    def __init__(self, module: nn.Module, slots: int, rank: int, rows: _Rows, where: str) -> None:
        layout = {k: getattr(module, k, None) for k in EXPERTS_LAYOUT}
        if layout != EXPERTS_LAYOUT or not hasattr(module, "act_fn"):
            raise AdapterError(
                f"lora on the experts of {where}: their layout {layout} is not the gated, concatenated, "
                f"untransposed one served here ({EXPERTS_LAYOUT}, with act_fn)"
            )
        w, (experts, hidden, inter) = module.down_proj, module.down_proj.shape
        dims = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        self.a = {p: torch.zeros(slots, experts, rank, i, dtype=w.dtype, device=w.device) for p, (_, i) in dims.items()}
        self.b = {p: torch.zeros(slots, experts, o, rank, dtype=w.dtype, device=w.device) for p, (o, _) in dims.items()}
        self.module, self.rows, self.inter = module, rows, inter
        self.grouped = module.forward
        module.forward = self.forward

    def _delta(self, proj: str, x: torch.Tensor, slots: torch.Tensor, expert: int) -> torch.Tensor:
        h = torch.bmm(x.unsqueeze(1), self.a[proj][slots, expert].transpose(1, 2))
        return torch.bmm(h, self.b[proj][slots, expert].transpose(1, 2)).squeeze(1)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        index = self.rows.index
        if index is None:
            return self.grouped(hidden, top_k_index, top_k_weights)
        m, slots = self.module, index.repeat_interleave(len(hidden) // len(index))
        out = torch.zeros_like(hidden)
        for expert in top_k_index.unique().tolist():
            token, k = torch.where(top_k_index == expert)
            x, s = hidden[token], slots[token]
            gate, up = nn.functional.linear(x, m.gate_up_proj[expert]).split(self.inter, dim=-1)
            gate = gate + self._delta("gate_proj", x, s, expert)
            h = m.act_fn(gate) * (up + self._delta("up_proj", x, s, expert))
            y = nn.functional.linear(h, m.down_proj[expert]) + self._delta("down_proj", h, s, expert)
            out.index_add_(0, token, (y * top_k_weights[token, k, None]).to(out.dtype))
        return out


@dataclass
class ExpertSlice:
    """One expert's projection of a `LoraExperts`: what an adapter's `...experts.{e}.{proj}` fills."""

    experts: LoraExperts
    expert: int
    proj: str

    def shapes(self, rank: int) -> tuple[list[int], list[int]]:
        a, b = self.experts.a[self.proj], self.experts.b[self.proj]
        return [rank, a.shape[3]], [b.shape[2], rank]

    def fill(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        e, p = self.expert, self.proj
        fill_slot(self.experts.a[p][slot, e], self.experts.b[p][slot, e], a, b, scaling)


def fill_slot(
    slot_a: torch.Tensor, slot_b: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float
) -> None:
    """One slot's A [rank, in] and scaled B [out, rank] (zero-padded to the engine's rank; zero when unset)."""
    slot_a.zero_()
    slot_b.zero_()
    if a is not None and b is not None:
        slot_a[: a.shape[0]] = a
        slot_b[:, : b.shape[1]] = b * scaling


class LoraManager:
    def __init__(self, model: nn.Module, cfg: EngineConfig) -> None:
        self.dtype, self.device = model.dtype, model.device
        self.max_slots = cfg.max_loras_per_batch
        self.max_loaded = cfg.max_loaded_loras
        initial = [read_adapter(AdapterRef.parse(e), self.dtype, self.device) for e in cfg.lora_paths]
        # The LM head only where named (by the flag or a start-up adapter): a [vocab, rank] B per slot
        # (SGLang serves it too: sglang 0.5.23: python/sglang/srt/lora/layers.py:266, ParallelLMHeadWithLoRA).
        head = LM_HEAD in set(cfg.lora_target_modules) | {m.split(".")[-1] for a in initial for m in a.modules()}
        linears = {
            name: m
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and (name.split(".")[-1] != LM_HEAD or head)
        }
        experts = fused_experts(model)
        kinds = sorted({name.split(".")[-1] for name in linears} | (set(EXPERT_PROJECTIONS) if experts else set()))
        targets = (
            set(cfg.lora_target_modules)
            or {module.split(".")[-1] for a in initial for module in a.modules()}
            or {ALL_TARGETS}
        )
        check_targets(model, targets, kinds)
        self.targets = kinds if ALL_TARGETS in targets else sorted(targets)
        self.rank = cfg.max_lora_rank or max(a.rank for a in initial)  # the config requires one of them
        self._rows = _Rows()
        # HF module path (an adapter's, per expert for the experts) -> where its slots live.
        self.wrapped: dict[str, LoraLinear | ExpertSlice] = {
            name: LoraLinear(m, self.max_slots + 1, self.rank, self._rows)
            for name, m in linears.items()
            if name.split(".")[-1] in self.targets
        }
        if projections := [p for p in EXPERT_PROJECTIONS if p in self.targets]:
            for name, m in experts.items():
                slots = LoraExperts(m, self.max_slots + 1, self.rank, self._rows, name)
                for e, proj in itertools.product(range(m.down_proj.shape[0]), projections):
                    self.wrapped[f"{name}.{e}.{proj}"] = ExpertSlice(slots, e, proj)
        self.adapters: dict[str, Adapter] = {}
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapters in slots, least recently used first
        for adapter in initial:
            self.add(adapter)

    # ---- loading ------------------------------------------------------------------------------

    def add(self, adapter: Adapter) -> None:
        """Make `adapter` servable; refused (AdapterError) when it does not fit this engine."""
        where = f"lora adapter {adapter.name!r} ({adapter.path})"
        if adapter.name in self.adapters:
            raise AdapterError(f"{where}: an adapter named {adapter.name!r} is already loaded; unload it first")
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise AdapterError(
                f"{where}: {len(self.adapters)} adapters are loaded, the limit is {self.max_loaded} (--max-loaded-loras)"
            )
        if adapter.rank > self.rank:
            raise AdapterError(f"{where}: rank {adapter.rank} is over this engine's {self.rank} (--max-lora-rank)")
        if adapter.pinned and sum(a.pinned for a in self.adapters.values()) + 1 >= self.max_slots:
            raise AdapterError(
                f"{where}: pinned adapters must leave one of the {self.max_slots} slots free (--max-loras-per-batch)"
            )
        for module, (a, b) in adapter.modules().items():
            if module not in self.wrapped:
                raise AdapterError(
                    f"{where}: targets {module}, which is not a LoRA target of this engine "
                    f"(--lora-target-modules: {self.targets})"
                )
            expected = self.wrapped[module].shapes(adapter.rank)
            if [list(adapter.tensors[a].shape), list(adapter.tensors[b].shape)] != list(expected):
                raise AdapterError(
                    f"{where}: {module} has A {list(adapter.tensors[a].shape)} and B {list(adapter.tensors[b].shape)}; "
                    f"this model needs {expected[0]} and {expected[1]}"
                )
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        self.get(name)
        if (slot := self.slot_of.pop(name, None)) is not None:
            for target in self.wrapped.values():
                target.fill(slot, None, None, 0.0)
        del self.adapters[name]

    def get(self, name: str) -> Adapter:
        if name not in self.adapters:
            raise AdapterError(f"lora adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        return self.adapters[name]

    def loaded(self) -> dict[str, str]:
        return {name: a.path for name, a in self.adapters.items()}

    # ---- slots --------------------------------------------------------------------------------

    def acquire(self, name: str | None, busy: set[str]) -> bool:
        """Give `name` a slot for a row joining a batch whose rows use the `busy` adapters;
        False when every slot holds one of those (or a pinned one): the row waits."""
        if name is None:
            return True
        if name in self.slot_of:
            self.slot_of.move_to_end(name)
            return True
        used = set(self.slot_of.values())
        free = [s for s in range(1, self.max_slots + 1) if s not in used]
        if not free:
            victim = next((n for n in self.slot_of if n not in busy and not self.adapters[n].pinned), None)
            if victim is None:
                return False
            free = [self.slot_of.pop(victim)]
        self.slot_of[name] = free[0]
        self.refresh(name)
        return True

    def refresh(self, name: str) -> None:
        """Copy the adapter's tensors into its slot (after a load or a push), if it has one."""
        if (slot := self.slot_of.get(name)) is None:
            return
        adapter = self.adapters[name]
        pairs = adapter.modules()
        for module, target in self.wrapped.items():
            a, b = pairs.get(module, (None, None))
            target.fill(slot, adapter.tensors.get(a), adapter.tensors.get(b), adapter.scaling)

    @contextmanager
    def rows(self, adapters: list[str | None]) -> Iterator[None]:
        """During one forward, row i gets the delta of `adapters[i]` (None: the base model)."""
        slots = [0 if name is None else self.slot_of[name] for name in adapters]
        self._rows.index = torch.tensor(slots, device=self.device) if any(slots) else None
        try:
            yield
        finally:
            self._rows.index = None
