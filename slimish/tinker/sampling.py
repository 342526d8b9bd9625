"""Tinker sampling on the built-in engine: sampling sessions are LoRA adapters loaded into one engine
child (or its base model), and `asample` is the engine's native `/generate`.

What the cookbook relies on (tinker 0.38.0: types/_pydantic_types/sampling_params.py; tinker_cookbook
0.6.1: renderers/base.py `parse_response_for_stop_token`): per-token logprobs always; `stop` as
token ids or strings, `[]` turning off even EOS; sampled tokens include the stop token, once (the
engine's `output_ids` end with it); prompt logprobs NaN at position 0, where nothing predicts.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from pathlib import Path
from typing import Any

from tinker import types

from slimish.client import Client, ServerError
from slimish.tinker.futures import UserError
from slimish.tinker.wire import Sampled, sample_response


def prompt_tokens(prompt: types.ModelInput) -> list[int]:
    """The prompt's token ids; only token chunks can reach a text engine."""
    tokens: list[int] = []
    for j, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise UserError(f"prompt.chunks[{j}]: {chunk.type} chunks are not supported, only encoded_text")
        tokens += chunk.tokens
    return tokens


def engine_params(p: types.SamplingParams, n: int) -> dict[str, Any]:
    """Tinker's SamplingParams as the engine's (SGLang's) sampling_params."""
    params: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "n": n}
    if p.max_tokens is not None:
        params["max_new_tokens"] = p.max_tokens
    if p.seed is not None:
        params["sampling_seed"] = p.seed
    stop = [p.stop] if isinstance(p.stop, str) else p.stop
    if stop is not None and len(stop) == 0:
        params["ignore_eos"] = True
    elif stop and all(isinstance(s, int) for s in stop):
        params["stop_token_ids"] = list(stop)
    elif stop:
        if not all(isinstance(s, str) for s in stop):
            raise UserError("sampling_params.stop: all token ids or all strings, not a mix")
        params["stop"] = list(stop)
    return params


def _lp(entry: Any) -> float:
    """An engine logprob triple's value; None (nothing predicts position 0) is NaN."""
    return math.nan if entry is None or entry[0] is None else float(entry[0])


def _top(rows: list[Any], length: int, k: int) -> list[list[tuple[int, float]]]:
    """The engine's top logprob triples of `length` positions, `k` each (None where nothing predicts)."""
    return [[(int(t), float(lp)) for lp, t, _ in (row or [])[:k]] for row in rows[:length]]


class Sampler:
    """The engine's adapters and the sampling sessions that name them."""

    def __init__(self, engine_url: str, keep_snapshots: int) -> None:
        self.engine = Client(engine_url)
        self.keep_snapshots = keep_snapshots
        self.sessions: dict[str, str | None] = {}  # sampling_session_id -> engine adapter name (None: base model)
        self.source: dict[str, str | None] = {}  # sampling_session_id -> the tinker:// path it samples, if any
        self._by_dir: dict[str, str] = {}  # adapter directory -> its engine name
        self._snapshots: dict[str, deque[str]] = {}  # model_id -> its unnamed snapshots, oldest first
        self._ids = itertools.count(1)

    async def close(self) -> None:
        await self.engine.close()

    async def load(self, directory: Path, fresh: bool = False) -> str:
        """The engine name of the adapter in `directory`, loaded now unless it is (`fresh`: a new save
        of that directory, loaded under a new name: sessions already open keep the weights they had)."""
        key = str(directory)
        if fresh or key not in self._by_dir:
            name = f"tinker-{next(self._ids)}"
            await self._engine_call(self.engine.load_lora_adapter(name, key))
            self._by_dir[key] = name
        return self._by_dir[key]

    async def snapshot(self, model_id: str, directory: Path) -> str:
        """Load an unnamed snapshot of `model_id` (save_weights_and_get_sampling_client); its name. Beyond
        `keep_snapshots` of the model, the oldest is unloaded, and sessions on it are closed."""
        name = await self.load(directory, fresh=True)
        del self._by_dir[str(directory)]  # the directory is reused by the next snapshot
        kept = self._snapshots.setdefault(model_id, deque())
        kept.append(name)
        while len(kept) > self.keep_snapshots:
            await self._unload(kept.popleft())
        return name

    async def release(self, model_id: str) -> None:
        """Unload `model_id`'s snapshots and close the sessions on them (its session finished)."""
        for name in self._snapshots.pop(model_id, ()):
            await self._unload(name)

    async def _unload(self, name: str) -> None:
        await self._engine_call(self.engine.unload_lora_adapter(name))
        for sid in [s for s, a in self.sessions.items() if a == name]:
            del self.sessions[sid], self.source[sid]

    def forget(self, directory: Path) -> None:
        """`directory` was saved again: the next session on it loads the new weights."""
        self._by_dir.pop(str(directory), None)

    def open(self, adapter: str | None, source: str | None) -> str:
        """A new sampling session on `adapter` (None: the base model), made from `source`; its id."""
        session_id = f"sampler-{next(self._ids)}"
        self.sessions[session_id], self.source[session_id] = adapter, source
        return session_id

    def adapter_of(self, session_id: str) -> str | None:
        if session_id not in self.sessions:
            raise UserError(
                f"sampling_session_id: {session_id!r} is unknown, or its snapshot was unloaded after "
                "keep_snapshots newer ones (make a new sampling client)"
            )
        return self.sessions[session_id]

    async def _engine_call(self, call: Any) -> Any:
        try:
            return await call
        except ServerError as exc:
            if 400 <= exc.status < 500:
                raise UserError(f"engine refused: {exc.message}") from None
            raise

    async def sample(self, req: types.SampleRequest, adapter: str | None) -> bytes:
        """One `asample`: `num_samples` sequences (seeds `seed`, `seed + 1`, ...), each with its logprobs,
        and the prompt's logprobs when asked; the `SampleResponse` bytes."""
        prompt = prompt_tokens(req.prompt)
        if not prompt:
            raise UserError("prompt: empty; sampling needs at least one token")
        for name in ("target_prompt_logprobs", "prompt_alt_tokens_k"):
            if getattr(req, name):
                raise UserError(f"{name}: not supported by this server")
        start = len(prompt)  # where the prompt's logprobs start: none unless asked
        if req.prompt_logprobs:
            last_n = req.prompt_logprobs_last_n
            if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
                raise UserError(f"prompt_logprobs_last_n: {last_n} is outside [1, len(prompt) - 1 = {len(prompt) - 1}]")
            start = 0 if last_n is None else len(prompt) - last_n
        top_k = max(req.topk_sample_logprobs, req.topk_prompt_logprobs if req.prompt_logprobs else 0)
        body: dict[str, Any] = {
            "input_ids": prompt,
            "sampling_params": engine_params(req.sampling_params, req.num_samples),
            "return_logprob": True,
            "logprob_start_len": start,
            "top_logprobs_num": top_k,
            "lora_path": adapter,
        }
        out = await self._engine_call(self.engine.request("POST", "/generate", body))
        replies = out if isinstance(out, list) else [out]
        sequences = []
        for reply in replies:
            meta = reply["meta_info"]
            if meta["finish_reason"]["type"] not in ("stop", "length"):
                raise RuntimeError(f"engine finished a sample with {meta['finish_reason']}")
            ids = reply["output_ids"]
            sequences.append(
                Sampled(
                    tokens=ids,
                    logprobs=[_lp(e) for e in meta["output_token_logprobs"]],
                    stopped=meta["finish_reason"]["type"] == "stop",
                    topk=_top(meta["output_top_logprobs"], len(ids), req.topk_sample_logprobs)
                    if req.topk_sample_logprobs
                    else None,
                )
            )
        first = replies[0]["meta_info"]
        prompt_lps = (
            [math.nan] * start + [_lp(e) for e in first["input_token_logprobs"]] if req.prompt_logprobs else None
        )
        topk_prompt = None
        if req.prompt_logprobs and req.topk_prompt_logprobs:
            topk_prompt = [[]] * start + _top(first["input_top_logprobs"], len(prompt), req.topk_prompt_logprobs)
        return sample_response(sequences, prompt_lps, topk_prompt)
