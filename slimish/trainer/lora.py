"""LoRA on the torch backend (`trainer.lora`, `peft`): the adapter, its reference and its export.

The policy is the HF model under a PEFT adapter; only the adapter's parameters train. The KL
reference is the same model with the adapter switched off (`disable_adapter`), so a LoRA run holds
one copy of the base weights. What leaves the trainer (weight push, checkpoint, export) is the
adapter alone, under the names `get_peft_model_state_dict` gives: those of a PEFT adapter
directory (`adapter_config.json` + `adapter_model.safetensors`), which is what the engines load.
A MoE model's experts are adapted through PEFT's ParamWrapper (one A shared by gate and up) but
leave per expert, in SGLang's form (`...experts.{e}.{gate,up,down}_proj.lora_A.weight`); the way
back refuses a per-expert adapter whose gate and up have different A (PEFT would need rank 2r).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from slimish.moe import EXPERT_PROJECTIONS, fused_experts, router_paths
from slimish.trainer.config import LoraConfig

if TYPE_CHECKING:  # peft is imported where an adapter is made or read: 1.5 s a process that never uses it
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # fused expert -> its projections
LAYER_PREFIX = re.compile(r"^.*\blayers\.\d+\.")  # `model.layers.0.mlp.experts` -> `mlp.experts`


def add_adapter(model: torch.nn.Module, lora: LoraConfig, names: tuple[str, ...] = ("default",)) -> PeftModel:
    """`model` under fresh adapters, one per name (B = 0: each policy starts as the base), the
    first active; its base frozen. On a MoE model, gate_proj/up_proj/down_proj in target_modules
    also adapt the fused experts, through PEFT's ParamWrapper on `gate_up_proj` and `down_proj`
    (which has no dropout)."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, peft_config(model, lora), adapter_name=names[0])
    for name in names[1:]:  # `policies`: the further adapters on the same base layers
        peft_model.add_adapter(name, peft_config(peft_model, lora))
    peft_model.set_adapter(names[0])  # only the active adapter's parameters require grad
    return peft_model.eval()  # new dropout layers start in train mode


def peft_config(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """PEFT's LoraConfig of `lora` on `model` (also what `PeftModel.add_adapter` takes for a further adapter)."""
    from peft import LoraConfig as PeftLoraConfig

    targets, experts = list(lora.target_modules), expert_targets(model, lora)
    if experts:  # an expert projection stays a module target only where a linear bears its name (a shared expert)
        targets = [t for t in targets if t not in EXPERT_PROJECTIONS] + shared_expert_linears(model, targets)
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        target_parameters=experts or None,
        task_type="CAUSAL_LM",
    )


def shared_expert_linears(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The linears bearing an expert projection's name in `targets`, named with their parent
    (`shared_expert.gate_proj`). Named bare, gate_proj and up_proj on a MoE whose experts
    transformers 5 fused (qwen2_moe, mixtral) are taken by PEFT (0.22 on) for a transformers 4
    adapter's and rewritten into the fused experts at rank 2r: a different adapter from the one
    this trainer exports and the engines serve."""
    wanted = set(targets) & set(EXPERT_PROJECTIONS)
    return sorted(
        {
            ".".join(name.split(".")[-2:])
            for name, m in model.named_modules()
            # a linear that an earlier adapter already wraps (a PEFT layer over its `base_layer`) still counts
            if isinstance(getattr(m, "base_layer", m), torch.nn.Linear) and name.rsplit(".", 1)[-1] in wanted
        }
    )


def expert_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """PEFT's `target_parameters` for the fused experts that `lora.target_modules` names (none on a
    dense model); the router and half of the fused gate/up pair are refused by name."""
    targets = set(lora.target_modules)
    if routers := sorted(targets & {path.rsplit(".", 1)[-1] for path in router_paths(model)}):
        raise ValueError(
            f"trainer.lora.target_modules: {routers} is the MoE router; LoRA on the router is not served by the "
            "engines: target the experts (gate_proj, up_proj, down_proj) instead"
        )
    experts = {LAYER_PREFIX.sub("", path) for path in fused_experts(model)}
    if not experts or not targets & set(EXPERT_PROJECTIONS):
        return []
    if len(targets & {"gate_proj", "up_proj"}) == 1:
        raise ValueError(
            "trainer.lora.target_modules: gate_proj and up_proj are one fused parameter (gate_up_proj) in this "
            "model's experts: target both or neither"
        )
    if lora.dropout:
        raise ValueError(
            f"trainer.lora.dropout={lora.dropout}: the experts' adapters (PEFT's ParamWrapper on gate_up_proj and "
            "down_proj) have no dropout; set it to 0 or drop gate_proj/up_proj/down_proj from target_modules"
        )
    fused = [f for f, projs in FUSED.items() if targets & set(projs)]
    return sorted(f"{prefix}.{f}" for prefix in experts for f in fused)


class AdaptersOff(torch.nn.Module):
    """The base model under a PEFT model, called with its adapter off: a LoRA run's KL reference.
    The PEFT model is held outside the module tree, so this adds no parameters and no state."""

    def __init__(self, peft_model: PeftModel) -> None:
        super().__init__()
        self.__dict__["peft_model"] = peft_model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.peft_model.get_output_embeddings()

    @property
    def config(self) -> Any:
        return self.peft_model.config


@contextmanager
def dropout_on(model: torch.nn.Module) -> Iterator[None]:
    """The adapter's dropout active for a gradient pass; everything else stays in eval mode."""
    layers = [m for name, m in model.named_modules() if name.endswith("lora_dropout")]
    for m in layers:
        m.train()
    try:
        yield
    finally:
        for m in layers:
            m.eval()


def expert_wrappers(model: PeftModel) -> dict[str, tuple[str, ParamWrapper]]:
    """PEFT state-dict prefix of each fused-experts adapter -> (the experts' module path, its wrapper)."""
    from peft.tuners.lora.layer import ParamWrapper

    return {
        name: (name.replace(".base_layer", ""), m) for name, m in model.named_modules() if isinstance(m, ParamWrapper)
    }


def adapter_tensors(model: PeftModel, adapter: str = "default") -> dict[str, Tensor]:
    """The adapter's tensors under their PEFT state-dict names (as in `adapter_model.safetensors`),
    the experts' per expert as SGLang and PEFT's v4 converter name them.

    A ParamWrapper over `[E, out, in]` holds A `[E*r, in]` (rows expert-major) and B `[out, r*E]`
    (columns expert-minor): expert e's A is `A.view(E, r, in)[e]`, its B `B.view(out, r, E)[..., e]`.
    gate_up_proj's A is shared by gate and up (each gets a copy: exact) and its B's rows split [:I], [I:]."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: with lm_head a target, PEFT would also save the whole base head
    state = get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False)
    for prefix, (experts, wrapper) in expert_wrappers(model).items():
        a, b = state.pop(f"{prefix}.lora_A.weight"), state.pop(f"{prefix}.lora_B.weight")
        n = wrapper.num_experts
        a, b = a.view(n, -1, a.shape[-1]), b.view(b.shape[0], -1, n)
        projs = FUSED[wrapper.parameter_name]
        for e in range(n):
            for proj, rows in zip(projs, b[..., e].chunk(len(projs))):
                state[f"{experts}.{e}.{proj}{LORA_A}"] = a[e].clone()  # own storage: safetensors, broadcast
                state[f"{experts}.{e}.{proj}{LORA_B}"] = rows.clone()
    return state


def to_wrapper_form(model: PeftModel, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`adapter_tensors`' per-expert tensors back in the ParamWrappers' form; a per-expert adapter
    whose gate and up have different A (SGLang's general form) is refused: PEFT could hold it only
    at rank 2r, block-diagonal, a different run."""
    tensors = dict(tensors)
    for prefix, (experts, wrapper) in expert_wrappers(model).items():
        a_rows, b_cols = [], []
        for e in range(wrapper.num_experts):
            names = [f"{experts}.{e}.{proj}" for proj in FUSED[wrapper.parameter_name]]
            if not all(f"{name}{suffix}" in tensors for name in names for suffix in (LORA_A, LORA_B)):
                return tensors  # the set check in `load_adapter_tensors` names what is missing
            a = [tensors.pop(f"{name}{LORA_A}") for name in names]
            if any(not torch.equal(a[0], other) for other in a[1:]):
                raise ValueError(
                    f"trainer.lora: {names[0]} and {names[1]} have different lora_A; the trainer's expert adapter "
                    "shares one A between gate and up (PEFT's ParamWrapper), so this adapter cannot be resumed"
                )
            a_rows.append(a[0])
            b_cols.append(torch.cat([tensors.pop(f"{name}{LORA_B}") for name in names]))
        tensors[f"{prefix}.lora_A.weight"] = torch.cat(a_rows)
        tensors[f"{prefix}.lora_B.weight"] = torch.stack(b_cols, dim=-1).flatten(1)
    return tensors


def load_adapter_tensors(model: PeftModel, tensors: dict[str, Tensor], adapter: str = "default") -> None:
    """Set the adapter (`adapter`: its PEFT name) from `adapter_tensors`' output; every tensor must land."""
    tensors = to_wrapper_form(model, tensors)
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = set(get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False))
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
        raise ValueError(
            f"trainer.lora: the checkpoint's adapter does not fit this run's (missing {missing}, unexpected {extra}); "
            "rank and target_modules must be those of the run that saved it"
        )
    set_peft_model_state_dict(model, tensors, adapter_name=adapter)


def adapter_config(model: PeftModel, adapter: str = "default") -> dict[str, Any]:
    """`adapter_config.json`'s content (sets become sorted lists)."""
    config = model.peft_config[adapter].to_dict()
    if fused := config.pop("target_parameters", None):  # per expert: the experts' projections are module targets
        projs = {p for name in fused for p in FUSED[name.rsplit(".", 1)[-1]]}
        config["target_modules"] = sorted(set(config["target_modules"] or ()) | projs)
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def write_adapter_dir(path: str | Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> Path:
    """A PEFT adapter directory (what `PeftModel.from_pretrained` and `/load_lora_adapter` read)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()},
        str(path / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return path
