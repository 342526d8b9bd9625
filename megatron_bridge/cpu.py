"""Run Megatron-Core 0.16.1 on a machine without CUDA: `apply()` once, before building models.

Why: CI and laptops have no GPU, yet the Megatron trainer must be tested end to end there.
Megatron-Core calls CUDA in a few places even when every tensor is on the CPU. Each patch below
targets those call sites only, so ordinary tensor ops run at full speed. A global
`TorchFunctionMode` would also cover them, but it costs 10-20x per op (the shared CPU notes
measured this). On a CUDA machine `apply()` does nothing.

What is patched and why (paths are under `megatron/core/`):

1. `torch.cuda.current_device() -> "cpu"`. It is the device argument of every buffer Megatron
   allocates (tensor_parallel/layers.py and mappings.py, the RoPE `inv_freq`, p2p shape tensors,
   the global memory buffer in utils.py, the DDP grad buffers).
2. `torch.cuda.synchronize` and `empty_cache` do nothing (p2p_communication.py, DDP, optimizer).
   `current_stream` and `default_stream` return a dummy stream whose wait calls do nothing
   (DDP grad-buffer syncs).
3. CUDA RNG goes to the CPU generator: `torch.cuda.get_rng_state`, `set_rng_state`,
   `manual_seed`, plus `tensor_parallel.random._get_cuda_rng_state` and
   `_set_cuda_rng_state`. They back `model_parallel_cuda_manual_seed` and the RNG tracker that
   forks seeds for init and dropout.
4. Literal `device="cuda"` factories. A few modules build tensors with the device written out:
   `pipeline_parallel/schedules.py` (the `total_num_tokens` counter),
   `optimizer/optimizer.py` (`found_inf`, `_scale_one`), `optimizer/clip_grads.py` (norm and
   overflow buffers), `optimizer/grad_scaler.py`, `rerun_state_machine.py` (all-reduced flags) and
   `transformer/utils.py` (default causal mask). Only in those modules, the global name `torch`
   is rebound to a stand-in. It forwards every attribute to torch, except that `tensor`,
   `zeros`, `ones`, `empty` and `full` build on the CPU when asked for "cuda".
   `utils.py:local_multi_tensor_l2_norm` (the grad-norm kernel without apex/TE) does the same,
   but `utils.py` is on hot paths. So only a copy of that function sees the stand-in, and
   `clip_grads.l2_norm_impl` points at the copy.
5. Tensor methods. `optimizer/clip_grads.py:clip_grad_by_total_norm_fp32` asserts
   `Tensor.type() == 'torch.cuda.FloatTensor'`. The optimizer builders
   `Float16OptimizerWithFloat16Params.__init__` and
   `DistributedOptimizer._build_model_and_main_param_groups` compare against the
   `torch.cuda.*Tensor` names. `models/common/language_module/language_module.py:
   LanguageModule.setup_embeddings_and_output_layer` calls `weight.data.cuda()` before it
   all-reduces the tied embedding across pipeline stages. Those four functions are wrapped. While
   one of them runs, `Tensor.type()` reports a CPU tensor under its CUDA name and `Tensor.cuda()`
   returns the tensor itself. This swap is not thread-safe, which is fine because Megatron calls
   them from the training thread.
6. Without Transformer Engine (so also on a GPU without TE), `transformer/moe/moe_utils.py`
   tests `te_general_gemm is not None`, but the failed TE import never defined that name. It is
   set to None so that the router's `torch.mm` path runs. This patch is applied even when CUDA
   is present.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_applied = False

# Modules that write device="cuda" literally (item 4 of the docstring).
_LITERAL_CUDA_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.rerun_state_machine",
    "megatron.core.transformer.utils",
)


class _DummyStream:
    """Stands in for a CUDA stream. On the CPU every op is already ordered."""

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_device(kwargs: dict[str, Any]) -> dict[str, Any]:
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        kwargs["device"] = "cpu"
    return kwargs


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> torch.Tensor:
        return factory(*args, **_cpu_device(kwargs))

    return build


class _TorchOnCpu(types.ModuleType):
    """`torch` as seen by one module that hard-codes device="cuda": the same, except tensor factories."""

    tensor = staticmethod(_on_cpu(torch.tensor))
    zeros = staticmethod(_on_cpu(torch.zeros))
    ones = staticmethod(_on_cpu(torch.ones))
    empty = staticmethod(_on_cpu(torch.empty))
    full = staticmethod(_on_cpu(torch.full))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_real_tensor_type = torch.Tensor.type


def _type_with_cuda_name(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    if dtype is None and not self.is_cuda:
        return _real_tensor_type(self).replace("torch.", "torch.cuda.", 1)
    return _real_tensor_type(self, dtype, non_blocking, **kwargs)


_real_tensor_cuda = torch.Tensor.cuda


def _stay_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


@contextmanager
def _cuda_tensor_methods() -> Iterator[None]:
    torch.Tensor.type, torch.Tensor.cuda = _type_with_cuda_name, _stay_on_cpu
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = _real_tensor_type, _real_tensor_cuda


def _with_cuda_tensor_methods(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_tensor_methods():
            return fn(*args, **kwargs)

    return wrapper


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _seed_cpu(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _seeing_torch_on_cpu(fn: types.FunctionType, torch_on_cpu: _TorchOnCpu) -> types.FunctionType:
    """A copy of `fn` whose global `torch` is the stand-in (its module keeps the real torch)."""
    scope = {**fn.__globals__, "torch": torch_on_cpu}
    return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)


def apply() -> None:
    """Patch Megatron-Core's CUDA-only call sites for CPU use (items 1-5 only without CUDA). Idempotent."""
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _applied = True
    if torch.cuda.is_available():
        return
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = cuda.default_stream = lambda *args, **kwargs: _DummyStream()
    cuda.get_rng_state = cuda.random.get_rng_state = _cpu_rng_state
    cuda.set_rng_state = cuda.random.set_rng_state = _set_cpu_rng_state
    cuda.manual_seed = _seed_cpu  # not manual_seed_all: torch.manual_seed calls it (a no-op without CUDA)

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state

    torch_on_cpu = _TorchOnCpu("torch")
    for name in _LITERAL_CUDA_MODULES:
        importlib.import_module(name).torch = torch_on_cpu

    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _seeing_torch_on_cpu(utils.local_multi_tensor_l2_norm, torch_on_cpu)

    clip = _with_cuda_tensor_methods(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = clip
    fp16 = optimizer.Float16OptimizerWithFloat16Params
    fp16.__init__ = _with_cuda_tensor_methods(fp16.__init__)
    dist_opt = distrib_optimizer.DistributedOptimizer
    dist_opt._build_model_and_main_param_groups = classmethod(
        _with_cuda_tensor_methods(dist_opt._build_model_and_main_param_groups.__func__)
    )
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _with_cuda_tensor_methods(
        LanguageModule.setup_embeddings_and_output_layer
    )
