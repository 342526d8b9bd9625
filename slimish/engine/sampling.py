"""Next-token choice and logprobs for a batch of rows, each with its own sampling params.

Logprobs follow SGLang's default (docs/protocol.md 1.3): `log_softmax(logits / T)` after penalties and
logit bias, before top-k/top-p/min-p truncation, with T = 1 for greedy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slimish.batch_invariant import logsumexp_and_exp
from slimish.engine.grammar import mask_logits
from slimish.protocol import TOP_K_OFF, SamplingParams

# As SGLang: a temperature below this samples greedily (dividing the logits by it would overflow).
SAMPLING_EPS = 1e-6
CDF_BLOCK = 256  # tokens per block of `inverse_cdf`'s first level
BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def temperature_of(p: SamplingParams) -> float:
    """The temperature logprobs use: 1 for greedy requests (T = 0 or below SAMPLING_EPS)."""
    return p.temperature if p.temperature >= SAMPLING_EPS else 1.0


@dataclass
class RowState:
    """What sampling needs to know about one running request."""

    params: SamplingParams
    prompt_ids: list[int]  # with output_ids, what the repetition penalty counts as seen
    output_ids: list[int]  # output so far (frequency / presence penalty, min_new_tokens)
    stop_ids: set[int]
    generator: torch.Generator | None
    grammar: Any = None  # an xgrammar matcher for constrained decoding


def _adjusts(r: RowState) -> bool:
    """Whether `_adjust_logits` changes this row's logits: its conditions, or-ed (keep them in step)."""
    p = r.params
    return bool(
        (p.repetition_penalty != 1.0 and (r.prompt_ids or r.output_ids))
        or ((p.frequency_penalty or p.presence_penalty) and r.output_ids)
        or p.logit_bias
        or (len(r.output_ids) < p.min_new_tokens and r.stop_ids)
        or r.grammar is not None
    )


def _truncates(p: SamplingParams) -> bool:
    return p.top_k < TOP_K_OFF or p.top_p < 1.0 or p.min_p > 0.0


def _adjust_logits(logits: torch.Tensor, rows: list[RowState]) -> None:
    """In place: penalties, logit bias, no stop token before `min_new_tokens`, and the grammar's
    mask, all before logprobs are taken, as SGLang does. The stop-token mask, which every row of
    a fixed-length rollout takes at every step, is one indexed write for the whole batch."""
    device = logits.device
    masked_rows: list[int] = []
    masked_ids: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0 and (r.prompt_ids or r.output_ids):
            ids = torch.tensor(sorted({*r.prompt_ids, *r.output_ids}), device=device)
            vals = logits[i, ids]
            logits[i, ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            counts = torch.bincount(torch.tensor(r.output_ids, device=device), minlength=logits.shape[1])[
                : logits.shape[1]
            ].float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            for tok, bias in p.logit_bias.items():
                logits[i, int(tok)] += bias
        if len(r.output_ids) < p.min_new_tokens and r.stop_ids:
            masked_rows += [i] * len(r.stop_ids)
            masked_ids += r.stop_ids
    if masked_rows:
        logits[torch.tensor(masked_rows, device=device), torch.tensor(masked_ids, device=device)] = float("-inf")
    mask_logits(logits, [r.grammar for r in rows])


def _truncate(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """top-k, then top-p, then min-p on one row of probabilities (not renormalised)."""
    if p.top_k < TOP_K_OFF and p.top_k < probs.numel():
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) > p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    if p.min_p > 0.0:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    return probs


@dataclass(frozen=True)
class Logprobs:
    """The rows' log-probabilities, `logits - lse` (`log_softmax`'s bits: the trainer's), taken
    where they are read. All of them at once is one more pass over [rows, vocabulary] (2 ms a
    step at 32 rows of a 151936-token vocabulary), which a step needs only for the rows that ask
    for top or named logprobs; every row needs its chosen token's, read here in one gather."""

    logits: torch.Tensor  # [rows, V]: after penalties, bias and temperature
    lse: torch.Tensor  # [rows, 1]: their logsumexp

    def row(self, i: int) -> torch.Tensor:
        return self.logits[i] - self.lse[i]

    def of(self, tokens: list[int]) -> list[float]:
        """Row k's logprob of `tokens[k]`."""
        index = torch.tensor(tokens, device=self.logits.device).unsqueeze(1)
        return (self.logits.gather(1, index) - self.lse).squeeze(1).tolist()

    def full(self) -> torch.Tensor:
        return self.logits - self.lse


def sample(logits: torch.Tensor, rows: list[RowState]) -> tuple[list[int], Logprobs]:
    """Pick one token per row; returns the tokens and the rows' logprob distributions.

    Sampled rows draw by inverse CDF, all rows at once, over the unnormalised `exp(x - max)`
    that the log-probs' logsumexp computes anyway (the CDF's last value is the row's total): one
    uniform number per row, from the row's own generator when it has a `sampling_seed` (so a
    seed gives the same tokens whatever else is in the batch), else from torch's default
    generator. Work a row does not need is skipped for the whole batch (a copy when no row
    adjusts its logits, the division when every temperature is 1, the argmax when no row is
    greedy), and each per-row step runs only over the rows that take it: a decode step calls
    this once for every row.
    """
    adjusted = any(_adjusts(r) for r in rows)
    if adjusted:
        logits = logits.clone()  # the caller's logits may serve again (a shared prefill's)
        _adjust_logits(logits, rows)
    # A temperature past float32's range would be inf (a grammar's -inf mask / inf = NaN), and
    # extreme penalties or biases can push a logit to +inf (softmax: NaN): the largest finite
    # value keeps the distribution in both cases (a -inf mask stays -inf). A model's own logits
    # are finite: unadjusted at temperature 1, they are taken as they are (no pass over them).
    top = torch.finfo(logits.dtype).max
    temps = [min(temperature_of(r.params), top) for r in rows]
    if any(t != 1.0 for t in temps):
        scaled = (logits / torch.tensor(temps, device=logits.device)[:, None]).clamp_(max=top)
    else:
        scaled = logits.clamp(max=top) if adjusted else logits
    lse, weights = logsumexp_and_exp(scaled)  # the trainer's arithmetic (batch_invariant.py)
    logprobs = Logprobs(scaled, lse)
    sampled = [i for i, r in enumerate(rows) if r.params.temperature >= SAMPLING_EPS]
    if len(sampled) == len(rows):
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    else:
        tokens = scaled.argmax(dim=-1)
    if sampled:
        probs = weights if len(sampled) == len(rows) else weights[sampled]
        for k, i in enumerate(sampled):
            if _truncates(rows[i].params):  # thresholds on probabilities that sum to 1
                probs[k] = _truncate(logprobs.row(i).exp(), rows[i].params)
        tokens[sampled] = inverse_cdf(probs, _uniforms([rows[i].generator for i in sampled]).to(probs.device))
    return tokens.tolist(), logprobs


def _first_past(running: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index where `running` (non-decreasing) exceeds `target`, a number
    below the row's last value: that index's own term is then positive."""
    return torch.searchsorted(running, target.unsqueeze(1), right=True).squeeze(1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` [rows, V] (>= 0, a positive total), the token where the running sum
    first passes `u` [rows] (in [0, 1)) of the total: each token drawn with its weight's share,
    a zero weight never. In two levels, blocks of CDF_BLOCK tokens then a token of the block:
    torch's `cumsum` is a sequential scan (~0.3 ms over 32 x 8192), block sums are vectorised.
    The block is where the running block sums pass u of the total, then the token where the
    block's own running sum passes the rest of that target, as a share of the block's sum. Each
    target stays below its running sum's last value, as `_first_past` needs: u is below 1, the
    share (of rounded sums) is held below 1, and a float times a float below 1 rounds below the
    other factor."""
    rows, vocab = weights.shape
    whole = vocab - vocab % CDF_BLOCK
    sums = weights[:, :whole].reshape(rows, -1, CDF_BLOCK).sum(-1)
    if whole < vocab:
        sums = torch.cat((sums, weights[:, whole:].sum(-1, keepdim=True)), dim=1)
    running = sums.cumsum(-1)
    target = u * running[:, -1]
    block = _first_past(running, target)
    before = torch.where(block > 0, running.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    share = ((target - before) / sums.gather(1, block.unsqueeze(1)).squeeze(1)).clamp_(max=BELOW_ONE)
    columns = block.unsqueeze(1) * CDF_BLOCK + torch.arange(CDF_BLOCK, device=weights.device)
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0.0).cumsum(-1)
    return block * CDF_BLOCK + _first_past(inside, share * inside[:, -1])


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform number per row, in row order: from the row's own generator, else from torch's
    default one. The default generator's rows draw together in one call, which yields the very
    numbers a draw per row would (tests/test_engine.py checks), without a call per row; the
    numbers are gathered as Python floats (exact for float32) and made a tensor once, not written
    in row by row (an indexed write per seeded row was ~10 us each). Generators stay on the CPU: a
    seed draws the same numbers whatever the engine's device."""
    if all(g is None for g in generators):
        return torch.rand(len(generators))
    shared = iter(torch.rand(sum(g is None for g in generators)).tolist())
    return torch.tensor([next(shared) if g is None else torch.rand((), generator=g).item() for g in generators])
