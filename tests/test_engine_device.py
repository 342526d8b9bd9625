"""`engine.device`: a bad name is refused by the config, CUDA without CUDA at engine start.

On a CUDA machine the last test also runs the engine's forward and sampling on the GPU and
compares them with the CPU's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slimish.engine.config import EngineConfig
from slimish.engine.engine import Engine
from slimish.engine.runner import KVBatch, Runner, load_model
from slimish.engine.sampling import RowState, sample
from slimish.protocol import SamplingParams


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", "mps"])
def test_config_refuses_unknown_devices(device: str) -> None:
    with pytest.raises(ValueError, match=r"engine\.device \(--device\) must be cpu, cuda or cuda:K"):
        EngineConfig(model="unused", device=device)


def test_a_batch_samples_as_its_rows_alone() -> None:
    """`sample` over a batch (the min_new_tokens mask in one write, the unseeded rows' uniforms in
    one draw) gives each row the token and logprobs it gets sampled alone, seeded rows mixed in."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    logits[:, 2] = 50.0  # the stop token would win every draw unless masked
    params = [
        SamplingParams(temperature=1.0, min_new_tokens=4),
        SamplingParams(temperature=0.7, sampling_seed=11),
        SamplingParams(temperature=1.0, min_new_tokens=4, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_new_tokens=4, sampling_seed=5),
        SamplingParams(temperature=1.0),
    ]

    def rows() -> list[RowState]:
        seeded = [None if p.sampling_seed is None else torch.Generator().manual_seed(p.sampling_seed) for p in params]
        return [RowState(p, [1, 3], [3], {2, 0}, g) for p, g in zip(params, seeded)]

    torch.manual_seed(7)
    tokens, logprobs = sample(logits, rows())
    torch.manual_seed(7)
    alone = [sample(logits[i : i + 1], [row]) for i, row in enumerate(rows())]
    assert tokens == [t[0] for t, _ in alone] and 2 not in tokens[0:5:2]  # masked below min_new_tokens
    assert torch.equal(logprobs.full(), torch.cat([lp.full() for _, lp in alone]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_refused_at_start(tiny_model_dir: Path, device: str) -> None:
    with pytest.raises(ValueError, match=rf"engine\.device \(--device\) is '{device}', but CUDA is not available"):
        Engine(EngineConfig(model=str(tiny_model_dir), device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_and_sampling_match_cpu(tiny_model_dir: Path) -> None:
    """Prefill, a batched decode step and seeded sampling give the CPU's logits and tokens."""
    outs = {}
    for device in ("cpu", "cuda"):
        model = load_model(str(tiny_model_dir), "float32", torch.device(device))
        runner, batch = Runner(model, page_size=4, prefix_cache=None), KVBatch(model)
        prompts = [[5, 6, 7, 8], [9, 10]]
        pre = [runner.prefill(p, logits_from=None, namespace=()) for p in prompts]
        batch.add([o.slab for o in pre], [len(p) for p in prompts])
        logits = runner.decode(batch, [11, 12])
        params = SamplingParams(temperature=1.0, repetition_penalty=1.2, sampling_seed=3)
        rows = [RowState(params, p, [], {2}, torch.Generator().manual_seed(3)) for p in prompts]
        tokens, logprobs = sample(logits, rows)
        outs[device] = (logits.cpu(), tokens, logprobs.full().cpu())
    assert torch.allclose(outs["cpu"][0], outs["cuda"][0], atol=1e-4)
    assert outs["cpu"][1] == outs["cuda"][1]
    assert torch.allclose(outs["cpu"][2], outs["cuda"][2], atol=1e-4)
