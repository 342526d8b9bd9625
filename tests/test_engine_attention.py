"""`engine.decode_attention_backend`: the matmul decode attention gives HF's logits.

A left-padded batch (rows of different lengths, so the mask matters) decodes a few steps under
each backend; every step's logits must match a full forward of each row's whole sequence
without a cache, and the two backends must agree with each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slimish.engine.config import EngineConfig
from slimish.engine.runner import KVBatch, Runner, load_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


def _decode(model_dir: Path, backend: str, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy-decode PROMPTS together for `steps` steps; the sequences and each step's logits."""
    model = load_model(str(model_dir), "float32", torch.device("cpu"))
    runner, batch = Runner(model, 4, None, decode_attention_backend=backend), KVBatch(model)
    pre = [runner.prefill(p, None, ()) for p in PROMPTS]
    batch.add([o.slab for o in pre], [len(p) for p in PROMPTS])
    seqs = [[*p, int(o.logits[-1].argmax())] for p, o in zip(PROMPTS, pre)]
    steps_logits = []
    for _ in range(steps):
        logits = runner.decode(batch, [s[-1] for s in seqs])
        steps_logits.append(logits)
        for s, row in zip(seqs, logits):
            s.append(int(row.argmax()))
    return seqs, steps_logits


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_dir"])
def test_matmul_decode_matches_hf_and_sdpa(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(fixture)
    seqs, logits = _decode(model_dir, "matmul", steps=5)
    sdpa_seqs, sdpa_logits = _decode(model_dir, "sdpa", steps=5)
    assert seqs == sdpa_seqs
    for ours, theirs in zip(logits, sdpa_logits):
        assert torch.allclose(ours, theirs, atol=1e-5)
    reference = load_model(str(model_dir), "float32", torch.device("cpu"))
    with torch.inference_mode():
        for step, step_logits in enumerate(logits):
            for seq, row in zip(seqs, step_logits):
                upto = len(seq) - len(logits) + step  # the tokens fed before this step's output
                full = reference(input_ids=torch.tensor([seq[:upto]])).logits[0, -1]
                assert torch.allclose(row, full, atol=1e-4)


def test_config_refuses_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"engine\.decode_attention_backend must be one of sdpa, matmul"):
        EngineConfig(model="unused", decode_attention_backend="flashinfer")
