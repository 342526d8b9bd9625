"""CPU linear layers on weights packed once for oneDNN (`engine.cpu_packed_linear`).

Why: a decode step's projections are GEMMs of a few dozen rows against weights that do not stay
in cache, and `F.linear` (MKL sgemm) re-reads each weight in its plain [out, in] layout on every
call. oneDNN's blocked layout, packed once, streams the weight in the order its kernel consumes
it: the projections of a B=32 decode step run ~1.5x faster, B=8 ~1.8x (benchmarks/README.md).
The packed copies double the linear weights' memory, and they are derived from the weights, so
they are dropped with the prefix cache (`Runner.flush_cache`, which every weight load calls:
old KV must not serve new weights either) and packed again by the next forward. The arithmetic
is oneDNN's instead of MKL's: rounding differs in the last bits, as between any two GEMM kernels;
the batch-invariant kernels of `--enable-deterministic-inference` replace these.
"""

from __future__ import annotations

import functools

import torch

PACK_ROWS = 32  # the row count oneDNN picks its blocked layout for; measured best from 8 to 64 rows


def available(model: torch.nn.Module) -> bool:
    """Packing applies to an fp32 model on the CPU, with a torch built with oneDNN."""
    return model.device.type == "cpu" and model.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a linear weight [out, in] in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on the `pack`ed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None if bias is None else bias.detach(), "none", [], "")


class PackedLinears:
    """Every plain `nn.Linear` of `model` (LM head included) computed from a packed copy of its
    weight, made on first use. Forward hooks (LoRA's) still run: only `forward` is replaced. A
    forward with gradients on keeps `F.linear` (oneDNN's op has no backward here).

    `fused` runs linears that read one input (a layer's q, k and v; gate and up) as one GEMM
    over their weights packed together: the same bits as one GEMM each (measured at every shape
    of the tests' and benchmarks' models, 1 to 100 rows, with and without bias:
    tests/test_engine_decode.py holds it), ~6% less time for a decode step's projections at 32
    rows, for one more packed copy of those weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.packed: dict[torch.nn.Linear, torch.Tensor] = {}
        self.groups: dict[tuple[torch.nn.Linear, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}  # `fused`'s
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.forward = functools.partial(self.forward, module)

    def forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return torch.nn.functional.linear(x, module.weight, module.bias)
        w = self.packed.get(module)
        if w is None:
            w = self.packed[module] = pack(module.weight)
        return linear(x, w, module.bias)

    def fused(self, modules: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
        """`modules`' outputs on `x` side by side, in their order: one GEMM's."""
        group = self.groups.get(modules)
        if group is None:
            biases = [m.bias for m in modules if m.bias is not None]
            if biases and len(biases) != len(modules):
                raise ValueError("fused linears take a bias on all of them or none")
            weight = pack(torch.cat([m.weight for m in modules]))
            group = self.groups[modules] = (weight, torch.cat(biases).detach() if biases else None)
        return linear(x, *group)

    def drop(self) -> None:
        """Forget the packed copies (the weights changed, or their memory is wanted back)."""
        self.packed.clear()
        self.groups.clear()
