"""`engine.decode_attention_backend`: the matmul decode attention gives HF's logits.

A left-padded batch (rows of different lengths, so the mask matters) decodes a few steps under
each backend; every step's logits must match a full forward of each row's whole sequence
without a cache, and the two backends must agree with each other. The running batch's slab,
whose views span its whole capacity (runner.KVSlab), keeps that as rows join and leave, and
gives a request the same bits whatever capacity earlier batches left.
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


def test_rows_that_join_and_leave_decode_as_alone(tiny_model_dir: Path) -> None:
    """The running batch's views span every column of its capacity (`KVSlab.decoding`): columns
    that a row which left, or a cut of common padding, leaves behind must stay masked for the rows
    that stay or take its place. Each step's logits are checked against the row's full forward."""
    model = load_model(str(tiny_model_dir), "float32", torch.device("cpu"))
    reference = load_model(str(tiny_model_dir), "float32", torch.device("cpu"))
    runner, batch, seqs = Runner(model, 4, None), KVBatch(model), []

    def join(prompts: list[list[int]]) -> None:
        pre = [runner.prefill(p, None, ()) for p in prompts]
        batch.add([o.slab for o in pre], [len(p) for p in prompts])
        seqs.extend([*p, int(o.logits[-1].argmax())] for p, o in zip(prompts, pre))

    def decode(steps: int) -> None:
        for _ in range(steps):
            logits = runner.decode(batch, [s[-1] for s in seqs])
            with torch.inference_mode():
                for seq, row in zip(seqs, logits):
                    assert torch.allclose(row, reference(input_ids=torch.tensor([seq])).logits[0, -1], atol=1e-4)
                    seq.append(int(row.argmax()))

    join([list(range(5, 25)), [30, 31, 32], [60, 61, 62, 63]])
    decode(3)
    batch.keep([1])  # the long row leaves, and 17 columns of padding with it; rows 1 and 2 stay behind
    seqs[:] = [seqs[1]]
    decode(2)
    join([[40, 41], [50, 51, 52, 53, 54, 55, 56, 57]])  # into rows 1 and 2, as many as the slab has
    decode(20)  # past the column capacity the batch started with: it grows
    batch.keep([2, 0])
    seqs[:] = [seqs[2], seqs[0]]
    decode(2)


@pytest.mark.parametrize(
    "earlier, kept",
    [
        ((20, 5), 32),  # left 32 columns, within DECODE_SPAN x the 16 the rows need: kept, 16 of them masked
        ((100, 50), 16),  # left 176: past it, the slab starts over at the 16 a fresh batch has
    ],
)
def test_logits_do_not_depend_on_the_capacity_earlier_batches_left(
    tiny_model_dir: Path, earlier: tuple[int, int], kept: int
) -> None:
    """The same rows decode to the same bits in a fresh batch and in one whose columns an earlier,
    longer batch grew (its views span them all, masked, unless there are more than DECODE_SPAN
    times as many as the rows need: then the slab starts over): a request's logprobs are
    reproducible, and a short batch does not stream a long one's columns."""
    model = load_model(str(tiny_model_dir), "float32", torch.device("cpu"))
    runner = Runner(model, 4, None)

    def decode(batch: KVBatch, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], int]:
        pre = [runner.prefill(p, None, ()) for p in prompts]
        batch.add([o.slab for o in pre], [len(p) for p in prompts])
        tokens, out = [int(o.logits[-1].argmax()) for o in pre], []
        for _ in range(steps):
            out.append(runner.decode(batch, tokens))
            tokens = [int(t) for t in out[-1].argmax(-1)]
        capacity = batch.slab.capacity[1]
        batch.keep([])
        return out, capacity

    fresh, fresh_capacity = decode(KVBatch(model), PROMPTS, 6)
    used = KVBatch(model)
    length, steps = earlier
    _, earlier_capacity = decode(used, [list(range(5, 5 + length))], steps)
    again, capacity = decode(used, PROMPTS, 6)
    assert (fresh_capacity, earlier_capacity > fresh_capacity, capacity) == (16, True, kept)
    assert all(torch.equal(a, b) for a, b in zip(fresh, again))
