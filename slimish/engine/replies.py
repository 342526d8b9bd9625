"""A sequence's progress as the native reply object (docs/protocol.md 1.3): its text, its ids and
SGLang's `meta_info`, for its first `n` output tokens. The OpenAI routes (openai_api.py) build
their choices from the same text and `meta_info`, so the two protocols never disagree on a token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from slimish.engine.scheduler import Sequence
from slimish.protocol import encode_routed_experts

Decode = Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text


def text_of(seq: Sequence, n: int, finished: bool, decode: Decode) -> str:
    """The text of the first `n` output tokens. As SGLang, a matched stop (token or string) is
    cut from the text unless `no_stop_trim`; the ids always keep the stop token."""
    ids = seq.output_ids[:n]
    reason = seq.finish_reason if finished else None
    if reason and reason["type"] == "stop" and isinstance(reason.get("matched"), int) and not seq.params.no_stop_trim:
        ids = ids[:-1]
    text = decode(ids, seq.params.skip_special_tokens)
    if finished and seq.stop_text_at is not None:
        text = text[: seq.stop_text_at]
    return text


def native_reply(
    seq: Sequence, n: int, finished: bool, decode: Decode, version: str, text_in_logprobs: bool = False
) -> dict[str, Any]:
    """The reply for the first `n` tokens; `version` is the one the reply reports (the base
    model's or the adapter's), `text_in_logprobs` fills the token texts of the logprob triples."""
    ids = seq.output_ids[:n]
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason if finished else None,
        "prompt_tokens": len(seq.input_ids),
        "completion_tokens": n,
        "cached_tokens": seq.cached_tokens,
        "reasoning_tokens": 0,
        "weight_version": version,
        "weight_versions": version_spans(seq.versions[:n]),
        "num_retractions": seq.num_retractions,
    }
    if finished and seq.finished_at is not None:
        meta["e2e_latency"] = seq.finished_at - seq.created
    w = seq.wish
    if w.return_logprob:
        tok = decode if text_in_logprobs else None
        triple = lambda lp, t: [lp, t, tok([t], False) if tok else None]  # noqa: E731
        # Always present, as SGLang sends them: empty unless `logprob_start_len` is inside the prompt.
        inputs = seq.input_ids[w.logprob_start_len :] if seq.input_logprobs is not None else []
        meta["input_token_logprobs"] = [triple(lp, t) for lp, t in zip(seq.input_logprobs or [], inputs)]
        if w.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if e is None else [triple(lp, t) for lp, t in e] for e in seq.input_top_logprobs or []
            ]
        if w.token_ids_logprob:
            meta["input_token_ids_logprobs"] = [
                None if e is None else [triple(lp, t) for lp, t in e] for e in seq.input_ids_logprobs or []
            ]
        meta["output_token_logprobs"] = [triple(lp, t) for lp, t in zip(seq.output_logprobs[:n], ids)]
        meta["output_token_logprobs_length"] = n
        if w.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [[triple(lp, t) for lp, t in e] for e in seq.output_top_logprobs[:n]]
        if w.token_ids_logprob:
            meta["output_token_ids_logprobs"] = [[triple(lp, t) for lp, t in e] for e in seq.output_ids_logprobs[:n]]
    if finished and w.return_routed_experts and seq.routes:  # never prefilled (aborted waiting): none, as SGLang
        meta["routed_experts"] = encode_routed_experts(routed_experts(seq))
    return {"text": text_of(seq, n, finished, decode), "output_ids": ids, "meta_info": meta}


def routed_experts(seq: Sequence) -> np.ndarray:
    """Rows `[start, seqlen - 1)` of the sequence's routes, the start clamped to `seqlen - 1` as
    SGLang's `get_topk` clamps it (sglang 0.5.23: python/sglang/srt/state_capturer/base.py:173-188):
    every token but the last, which is never fed forward."""
    seqlen = len(seq.input_ids) + len(seq.output_ids)
    start = min(seq.wish.routed_experts_start_len, seqlen - 1)
    return torch.cat(seq.routes)[start : seqlen - 1].numpy()


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Weight versions over output positions, as `[{"version", "start", "end"}]` (end exclusive)."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans
