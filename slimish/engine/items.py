"""What the HTTP layers hand the engine: one `Item` per sequence to generate, and the checks of
an item against this engine's limits and vocabulary that need no model state. Each refusal is a
`RequestError` naming the field, so a client gets a 400 it can act on, never a 500 from a
scheduler step (tests/test_fuzz.py found each of these as one)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slimish.engine.scheduler import LogprobWish
from slimish.protocol import SamplingParams

if TYPE_CHECKING:
    from slimish.engine.config import EngineConfig


class RequestError(ValueError):
    """Bad input found after schema validation; the message names the field."""


@dataclass
class Item:
    """One sequence to generate, as the HTTP layers describe it."""

    input_ids: list[int]
    params: SamplingParams
    rid: str
    wish: LogprobWish
    grammar: Any = None  # the compiled grammar, set by `Engine.check`; each sequence gets its own matcher
    lora: str | None = None  # a loaded LoRA adapter's name; None: the base model


def nth_copy(params: SamplingParams, j: int) -> SamplingParams:
    """Copy j of an `n > 1` request draws with seed + j: n samples, reproducible, not n clones."""
    if params.sampling_seed is None or j == 0:
        return params
    return params.model_copy(update={"sampling_seed": params.sampling_seed + j})


def check_routes(item: Item, cfg: "EngineConfig", moe_model: bool) -> None:
    """`return_routed_experts` needs the server flag (SGLang silently omits the routes without it;
    a 400 here, so a run never trains on routes it did not get) and a MoE model; the start is
    checked as SGLang checks it (sglang 0.5.23: python/sglang/srt/managers/scheduler.py:3300-3318)."""
    w, n_in = item.wish, len(item.input_ids)
    if not w.return_routed_experts:
        return
    if not cfg.enable_return_routed_experts:
        raise RequestError(
            "return_routed_experts: this engine was started without --enable-return-routed-experts "
            "(engine.enable_return_routed_experts)"
        )
    if not moe_model:
        raise RequestError("return_routed_experts: this model has no MoE router, so no experts are routed")
    if w.routed_experts_start_len < 0:
        raise RequestError(
            f"routed_experts_start_len: {w.routed_experts_start_len} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if w.routed_experts_start_len > n_in:
        raise RequestError(
            f"routed_experts_start_len: {w.routed_experts_start_len} is higher than the number of input tokens "
            f"{n_in}. Please use a smaller routed_experts_start_len."
        )


def check_limits(item: Item, cfg: "EngineConfig", vocab_size: int, context_length: int) -> None:
    """The item within the engine's caps (`cfg`), the model's context and vocabulary, with
    values torch and `re` accept."""
    p, w, n_in = item.params, item.wish, len(item.input_ids)
    if cfg.max_prompt_tokens is not None and n_in > cfg.max_prompt_tokens:
        raise RequestError(
            f"input_ids: the prompt has {n_in} tokens; this engine accepts at most {cfg.max_prompt_tokens} (--max-prompt-tokens)"
        )
    if cfg.max_new_tokens_cap is not None and p.max_new_tokens > cfg.max_new_tokens_cap:
        raise RequestError(
            f"sampling_params.max_new_tokens: {p.max_new_tokens} is over this engine's cap of {cfg.max_new_tokens_cap} (--max-new-tokens-cap)"
        )
    if n_in + p.max_new_tokens > context_length:
        raise RequestError(
            f"input_ids: the prompt ({n_in} tokens) plus sampling_params.max_new_tokens ({p.max_new_tokens}) "
            f"exceeds the model's context length ({context_length} tokens)"
        )
    if p.sampling_seed is not None and not -(2**63) <= p.sampling_seed <= 2**64 - p.n:
        raise RequestError(
            f"sampling_params.sampling_seed: {p.sampling_seed} is outside [-2**63, 2**64 - n] (torch seeds are 64-bit)"
        )
    for rx in p.stop_regexes():
        try:
            re.compile(rx)
        except re.error as exc:
            raise RequestError(
                f"sampling_params.stop_regex: {rx!r} is not a valid regular expression ({exc})"
            ) from None
    if w.logprob_start_len > n_in:  # equal is allowed, as SGLang: no input logprobs
        raise RequestError(
            f"logprob_start_len: {w.logprob_start_len} is higher than the number of input tokens {n_in}; use a smaller logprob_start_len"
        )
    if w.top_logprobs_num < 0:
        raise RequestError("top_logprobs_num: must be >= 0")
    if any(not (k.isascii() and k.lstrip("-").isdigit()) for k in (p.logit_bias or {})):
        raise RequestError("sampling_params.logit_bias: keys must be token ids written as strings")
    for field, ids in (
        ("token_ids_logprob", w.token_ids_logprob),
        ("sampling_params.stop_token_ids", p.stop_token_ids),
        ("sampling_params.logit_bias", [int(k) for k in p.logit_bias or {}]),
    ):
        for t in ids or []:
            if not 0 <= t < vocab_size:
                raise RequestError(f"{field}: token id {t} is outside the vocabulary [0, {vocab_size})")
