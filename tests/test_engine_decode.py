"""The engine's fast paths compute what the general ones do (benchmarks/README.md, "Decode
against its roofline, and batched prefill").

- `decode_forward` (the llama family's own decode loop) gives HF's forward's logits bit for bit,
  step after step on a left-padded batch, and writes the same KV;
- `Runner.prefill_many` (requests of one page schedule in one forward per page) gives every request the KV and logits it gets alone, bit for bit, with cache hits,
  a request that waits for an earlier one's page, and prompt logprobs among them;
- packed linear weights (packed.py), the decode loop's fused ones too, follow a weight load:
  `flush_cache`, which every load calls, drops them, and the next forward computes with the new
  weights;
- the sampler's two-level inverse CDF draws the token one running sum over the row would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slimish.engine.prefix_cache import PrefixCache
from slimish.engine.runner import KVBatch, PrefillRequest, Runner, load_model
from slimish.engine.sampling import BELOW_ONE, CDF_BLOCK, inverse_cdf
from slimish.tiny_model import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
PAGE = 4


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q_norm and k_norm: the one difference of qwen3's decoder layer."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", arch="qwen3", size="tiny", seed=0)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_own_decode_forward_is_hfs_bit_for_bit(fixture: str, request: pytest.FixtureRequest) -> None:
    model = load_model(str(request.getfixturevalue(fixture)), "float32", torch.device("cpu"))
    runner = Runner(model, PAGE, None)
    assert runner.own_decode
    own, hf = KVBatch(model), KVBatch(model)
    for batch in (own, hf):
        pre = [runner.prefill(p, None, ()) for p in PROMPTS]
        batch.add([o.slab for o in pre], [len(p) for p in PROMPTS])
    tokens = [int(o.logits[-1].argmax()) for o in pre]
    for _ in range(6):
        runner.own_decode = True
        mine = runner.decode(own, tokens)
        runner.own_decode = False
        theirs = runner.decode(hf, tokens)
        assert torch.equal(mine, theirs)
        tokens = [int(t) for t in mine.argmax(-1)]
    for a, b in zip(own.slab.keys + own.slab.values, hf.slab.keys + hf.slab.values):
        assert torch.equal(a[:3, :, : own.width], b[:3, :, : hf.width])


def test_prefill_many_gives_each_request_its_own_prefill(tiny_model_dir: Path) -> None:
    model = load_model(str(tiny_model_dir), "float32", torch.device("cpu"))
    cache = PrefixCache(PAGE, 1 << 10)
    runner, alone = Runner(model, PAGE, cache), Runner(model, PAGE, None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (7, 11), generator=g).tolist()
    runner.prefill(ids[5][:9], None, ())  # two whole pages of the last request cached before
    requests = [
        PrefillRequest(ids[0], None, ()),  # three of one schedule: one forward per page for all
        PrefillRequest(ids[1], None, ()),
        PrefillRequest(ids[2], None, ()),
        PrefillRequest(ids[6][:9], None, ()),  # another length: its own forwards
        PrefillRequest(ids[0][:8] + ids[3][8:], None, ()),  # shares two pages with the first: waits for them
        PrefillRequest(ids[4][:6], 2, ()),  # prompt logits from position 2
        PrefillRequest(ids[5], None, ()),  # a cache hit
    ]
    outs = runner.prefill_many(requests)
    assert [o.cached_tokens for o in outs] == [0, 0, 0, 0, 8, 0, 8]
    for r, out in zip(requests, outs):
        ref, n = alone.prefill(r.input_ids, r.logits_from, ()), len(r.input_ids)
        assert torch.equal(out.logits, ref.logits)
        for a, b in zip(out.slab.keys + out.slab.values, ref.slab.keys + ref.slab.values):
            assert torch.equal(a[0, :, :n], b[0, :, :n])


def test_packed_weights_follow_a_weight_load(tiny_model_dir: Path, tiny_model_dir_other_seed: Path) -> None:
    model = load_model(str(tiny_model_dir), "float32", torch.device("cpu"))
    runner = Runner(model, PAGE, None)
    assert runner.packed is not None and runner.own_decode
    before = runner.prefill(PROMPTS[0], None, ()).logits
    decoded_before = _decode_once(runner)  # packs the fused q/k/v and gate/up weights too
    other = load_model(str(tiny_model_dir_other_seed), "float32", torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(other.get_parameter(name))
    runner.flush_cache()
    after = runner.prefill(PROMPTS[0], None, ()).logits
    expected = Runner(other, PAGE, None, cpu_packed_linear=False).prefill(PROMPTS[0], None, ()).logits
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    decoded = _decode_once(runner)
    assert not torch.allclose(decoded, decoded_before)
    assert torch.equal(decoded, _decode_once(Runner(other, PAGE, None)))  # both packed: the same kernels


def _decode_once(runner: Runner) -> torch.Tensor:
    """The logits of one decode step after `PROMPTS[0]` (the llama family's own decode loop)."""
    batch, pre = KVBatch(runner.model), runner.prefill(PROMPTS[0], None, ())
    batch.add([pre.slab], [len(PROMPTS[0])])
    return runner.decode(batch, [int(pre.logits[-1].argmax())])


def test_two_level_inverse_cdf_draws_what_one_running_sum_draws() -> None:
    """`inverse_cdf` (block sums, then a block's own running sum) picks the token one running sum
    over the whole row picks, for weights whose sums are exact (small integers) and uniforms off
    every boundary; a zero weight is never drawn, even by the largest uniform below 1, in a
    zero block, or in the last, shorter block; vocabularies of one block, several, and a tail."""
    g = torch.Generator().manual_seed(0)
    for vocab in (CDF_BLOCK, 3 * CDF_BLOCK, 2 * CDF_BLOCK + 37):
        weights = torch.randint(0, 4, (16, vocab), generator=g).float()
        weights[1, CDF_BLOCK:] = 0.0  # all of it in the first block
        weights[2, : min(CDF_BLOCK, vocab - 1)] = 0.0  # none of it in the first block
        weights[2, -1] = 2.0
        weights[3] = 0.0
        weights[3, -1] = 1.0  # one token, the last
        weights[4] = 0.0
        weights[4, :2] = 1.0  # the first two tokens only: the rest of both levels zeros
        running = weights.cumsum(-1)
        for u in torch.linspace(0.0, 1.0, 41)[:-1] + 0.5 / 40:
            u = u.expand(16)
            one = torch.searchsorted(running, (u * running[:, -1]).unsqueeze(1), right=True).squeeze(1)
            assert torch.equal(inverse_cdf(weights, u), one), (vocab, float(u[0]))
        top = torch.full((16,), BELOW_ONE)
        for u in (top, torch.zeros(16)):
            picked = inverse_cdf(weights, u)
            assert bool((weights.gather(1, picked.unsqueeze(1)) > 0).all()), (vocab, picked)
