"""The asyncio face of the built-in engine: turns validated requests into scheduled sequences and
their progress back into reply objects (docs/protocol.md 1.3).

The HTTP layers (native `/generate` in server.py, OpenAI routes in openai_api.py) both go
through `Engine.submit`, so validation, tokenisation and reply building exist once.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import Counter
from datetime import timedelta
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from slimish.config import EngineConfig
from slimish.engine.grammar import GrammarError, Grammars, matcher
from slimish.engine.lora import Adapter, AdapterError, AdapterRef, LoraManager, read_adapter
from slimish.engine.metrics import Metrics
from slimish.engine.prefix_cache import PrefixCache
from slimish.engine.profiler import Profiler
from slimish.engine.runner import Runner, engine_device, load_model, use_device
from slimish.engine.scheduler import LogprobWish, Request, Scheduler
from slimish.engine.weights import WeightUpdater
from slimish.formats.model import ModelFormat
from slimish.protocol import GenerateReqInput, SamplingParams


class RequestError(ValueError):
    """Bad input found after schema validation; the message names the field."""


class Unavailable(RuntimeError):
    """The engine cannot serve now (503): its weights are torn by a failed broadcast."""


class Overloaded(RuntimeError):
    """The engine's queue is full (503 with `Retry-After`): retry later, or on another engine."""


@dataclass
class Item:
    """One sequence to generate, as the HTTP layers describe it."""

    input_ids: list[int]
    params: SamplingParams
    rid: str
    wish: LogprobWish
    grammar: Any = None  # the compiled grammar, set by `Engine.check`; each sequence gets its own matcher
    lora: str | None = None  # a loaded LoRA adapter's name; None: the base model


@dataclass
class Update:
    """Progress of item `index`: its first `n` output tokens exist; `finished` once done."""

    index: int
    n: int
    finished: bool


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.model_path = str(Path(cfg.model).resolve())
        self.device = engine_device(cfg.device)
        use_device(self.device)
        torch.manual_seed(cfg.seed)
        self.model = load_model(self.model_path, cfg.dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.vocab_size = self.model.config.vocab_size
        self.context_length = cfg.context_length or self.model.config.max_position_embeddings
        self.format = ModelFormat(self.tokenizer, self.model_path, cfg.tool_call_parser, cfg.reasoning_parser)
        self.served_model_name = cfg.served_model_name or self.model_path
        self.grammars = Grammars(self.tokenizer, self.vocab_size, set(self.format.end_ids))
        self.weights = WeightUpdater(self.model, timeout=timedelta(seconds=cfg.weight_sync_timeout_s))
        if cfg.await_weights:
            self.weights.await_full_push()
        self.profiler = Profiler()
        self.lora = LoraManager(self.model, cfg) if cfg.enable_lora or cfg.lora_paths else None
        # Sequences submitted and not finished, per adapter; an adapter is unloaded when it has none.
        self.adapter_users: Counter[str] = Counter()
        self.unloading: dict[str, asyncio.Event] = {}
        prefix_cache = None if cfg.disable_radix_cache else PrefixCache(cfg.page_size, cfg.radix_cache_max_tokens)
        self.scheduler = Scheduler(
            Runner(self.model, cfg.page_size, prefix_cache, self.lora, cfg.decode_attention_backend),
            max_running_requests=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens,
            share_prefills=not cfg.disable_radix_cache,
            on_step=self.profiler.step,
        )
        self.metrics = Metrics(self.served_model_name)
        self.started_at = time.time()
        # Sequences submitted and not finished; only touched on the event loop's thread.
        self.unfinished = 0
        self.capacity = cfg.max_running_requests + cfg.max_queued_requests

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    async def run(self, fn: Any, needs_idle: bool = False) -> Any:
        """Run `fn` on the scheduler thread (between steps) and await its result."""
        return await asyncio.wrap_future(self.scheduler.call(fn, needs_idle))

    # ---- requests -----------------------------------------------------------------------------

    def items_from_generate(self, body: GenerateReqInput) -> list[Item]:
        """Expand a `/generate` body into items: batch order, then `n` copies of each prompt."""
        prompts = body.prompts()
        if not prompts:
            raise RequestError(
                f"{'text' if body.text is not None else 'input_ids'}: an empty batch has no prompt to generate from"
            )
        for name in (
            "sampling_params",
            "rid",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "token_ids_logprob",
            "lora_path",
        ):
            value = getattr(body, name)
            per_item = isinstance(value, list) and (
                name != "token_ids_logprob" or (bool(value) and isinstance(value[0], list))
            )
            if per_item and len(value) != len(prompts):
                raise RequestError(
                    f"{name}: got {len(value)} values for {len(prompts)} prompts (one per prompt, or one for all)"
                )
        params = [body.per_item("sampling_params", i) for i in range(len(prompts))]
        if len({p.n for p in params}) > 1:
            raise RequestError("sampling_params.n: every item of a batch must use the same n")
        n = params[0].n
        self.check_size(len(prompts) * n, "sampling_params.n")
        params = [self.capped(p) for p in params]
        batch = body.is_batch or n > 1
        base = body.rid if isinstance(body.rid, str) else uuid.uuid4().hex
        items = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenize(prompt, field="text" if isinstance(prompt, str) else "input_ids")
            wish = LogprobWish(
                return_logprob=body.per_item("return_logprob", i),
                logprob_start_len=body.per_item("logprob_start_len", i),
                top_logprobs_num=body.per_item("top_logprobs_num", i),
                token_ids_logprob=body.per_item("token_ids_logprob", i),
            )
            for j in range(n):
                if isinstance(body.rid, list):
                    rid = body.rid[i] if n == 1 else f"{body.rid[i]}-{j}"
                else:
                    rid = f"{base}-{i * n + j}" if batch else base
                items.append(Item(ids, _nth_copy(params[i], j), rid, wish, lora=body.per_item("lora_path", i)))
        for item in items:
            self.check(item)
        return items

    def tokenize(self, prompt: str | list[int], field: str) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError(f"{field}: {field} cannot be empty.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{field}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def check_size(self, sequences: int, field: str) -> None:
        """Before expanding a request: one that could never fit is a 400, not a 503 forever."""
        if sequences > self.capacity:
            raise RequestError(
                f"{field}: the request makes {sequences} sequences (batch items x n); this engine holds at most "
                f"{self.capacity} (--max-running-requests + --max-queued-requests)"
            )

    def default_max_new_tokens(self, default: int) -> int:
        """A default the client did not choose is lowered to the cap (explicit values are checked)."""
        cap = self.cfg.max_new_tokens_cap
        return default if cap is None else min(default, cap)

    def capped(self, params: SamplingParams) -> SamplingParams:
        if "max_new_tokens" in params.model_fields_set:
            return params
        new = self.default_max_new_tokens(params.max_new_tokens)
        return params if new == params.max_new_tokens else params.model_copy(update={"max_new_tokens": new})

    def check(self, item: Item) -> None:
        if (torn := self.weights.torn_error()) is not None:
            raise Unavailable(torn)
        if item.lora is not None:
            self.check_adapter(item.lora, "lora_path")
        p, w, n_in, cfg = item.params, item.wish, len(item.input_ids), self.cfg
        try:
            item.grammar = self.grammars.compile(p)  # compiled once per text (xgrammar's cache)
        except GrammarError as exc:
            raise RequestError(str(exc)) from None
        if cfg.max_prompt_tokens is not None and n_in > cfg.max_prompt_tokens:
            raise RequestError(
                f"input_ids: the prompt has {n_in} tokens; this engine accepts at most {cfg.max_prompt_tokens} (--max-prompt-tokens)"
            )
        if cfg.max_new_tokens_cap is not None and p.max_new_tokens > cfg.max_new_tokens_cap:
            raise RequestError(
                f"sampling_params.max_new_tokens: {p.max_new_tokens} is over this engine's cap of {cfg.max_new_tokens_cap} (--max-new-tokens-cap)"
            )
        if n_in + p.max_new_tokens > self.context_length:
            raise RequestError(
                f"input_ids: the prompt ({n_in} tokens) plus sampling_params.max_new_tokens ({p.max_new_tokens}) "
                f"exceeds the model's context length ({self.context_length} tokens)"
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
                if not 0 <= t < self.vocab_size:
                    raise RequestError(f"{field}: token id {t} is outside the vocabulary [0, {self.vocab_size})")

    def submit(self, items: list[Item], stream: bool) -> AsyncIterator[tuple[list[Request], Update]]:
        """Schedule the items now (or raise Overloaded); iterate the result for their progress:
        every token when streaming, else only finishes.

        Scheduling happens here, not on first iteration, so the queue limit is exact and a full
        engine is refused before a stream's headers go out. If the consumer stops early (client
        gone), the unfinished items are aborted; if it never starts, they run to their end.
        """
        if self.unfinished + len(items) > self.capacity:
            raise Overloaded(
                f"the engine is full: {self.unfinished} sequences in flight, this request adds {len(items)}, "
                f"the limit is {self.capacity} (--max-running-requests + --max-queued-requests); "
                f"retry after {self.cfg.retry_after_s} s"
            )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Update] = asyncio.Queue()
        interval = max(1, self.cfg.stream_interval)

        def emitter(index: int):
            def emit(req: Request, finished: bool) -> None:
                if finished or (stream and len(req.output_ids) % interval == 0):
                    loop.call_soon_threadsafe(deliver, Update(index, len(req.output_ids), finished))

            return emit

        def deliver(update: Update) -> None:
            self.unfinished -= update.finished
            if update.finished and (lora := items[update.index].lora) is not None:
                self.adapter_users[lora] -= 1
                if not self.adapter_users[lora] and lora in self.unloading:
                    self.unloading[lora].set()
            queue.put_nowait(update)

        stop_base = set(self.format.end_ids)
        reqs = [
            Request(
                rid=it.rid,
                input_ids=it.input_ids,
                params=it.params,
                stop_ids=(set() if it.params.ignore_eos else stop_base) | set(it.params.stop_token_ids or []),
                wish=it.wish,
                emit=emitter(i),
                decode_text=self.decode,
                grammar=matcher(it.grammar),
                lora=it.lora,
            )
            for i, it in enumerate(items)
        ]
        self.unfinished += len(reqs)
        self.adapter_users.update(it.lora for it in items if it.lora is not None)
        for r in reqs:
            self.scheduler.submit(r)
        return self._progress(reqs, queue, stream)

    async def _progress(
        self, reqs: list[Request], queue: asyncio.Queue[Update], stream: bool
    ) -> AsyncIterator[tuple[list[Request], Update]]:
        done = 0
        try:
            while done < len(reqs):
                update = await queue.get()
                done += update.finished
                if done == len(reqs):
                    self.metrics.finished(reqs, stream)
                yield reqs, update
        finally:
            if done < len(reqs):  # the consumer left (client gone): abort the rest, and count them then
                rids = {r.rid for r in reqs if r.finish_reason is None}
                aborted = self.scheduler.call(lambda: self.scheduler.abort(rids=rids))
                aborted.add_done_callback(lambda _: self.metrics.finished(reqs, stream))

    async def generate(self, items: list[Item]) -> list[Request]:
        """Run to completion; the finished requests in item order."""
        reqs: list[Request] = []
        async with aclosing(self.submit(items, stream=False)) as updates:
            async for reqs, _ in updates:
                pass
        return reqs

    # ---- LoRA adapters ------------------------------------------------------------------------

    def adapter(self, name: str, field: str) -> Adapter:
        """The loaded adapter `name`, or a RequestError naming `field`."""
        if self.lora is None:
            raise RequestError(
                f"{field}: {name!r} names a LoRA adapter, but LoRA is not enabled on this engine (--enable-lora)"
            )
        if name in self.unloading:
            raise RequestError(f"{field}: lora adapter {name!r} is being unloaded")
        try:
            return self.lora.get(name)
        except AdapterError as exc:
            raise RequestError(f"{field}: {exc}") from None

    def check_adapter(self, name: str, field: str) -> None:
        if (torn := self.adapter(name, field).torn_error()) is not None:
            raise Unavailable(torn)

    def adapter_of_model(self, model: str | None) -> str | None:
        """The adapter an OpenAI `model` names (`adapter` or SGLang's `base:adapter`); None for the
        base model. With LoRA off any `model` is the base, as before; with it on, a name that is
        neither the base nor an adapter is an error, so a typo never samples the base silently."""
        if self.lora is None or model is None or model == self.served_model_name:
            return None
        base, sep, name = model.rpartition(":")
        if sep and base == self.served_model_name:
            model = name
        elif model not in self.lora.adapters:
            raise RequestError(
                f"model: {model!r} is neither the served model {self.served_model_name!r} "
                f"nor a loaded lora adapter (loaded: {sorted(self.lora.adapters)})"
            )
        self.check_adapter(model, "model")
        return model

    def version_of(self, req: Request) -> str:
        """The version a reply reports: the base's, or the adapter's (its last one if unloaded since)."""
        if req.lora is not None and (self.lora is None or req.lora not in self.lora.adapters):
            return req.versions[-1] if req.versions else self.scheduler.weight_version
        return self.scheduler.version_of(req.lora)

    async def load_adapter(self, ref: AdapterRef, version: str | None = None) -> None:
        """Read the adapter off the event loop, then add it on the scheduler thread (between steps),
        versioned `version` (a disk push's) or the default."""
        if self.lora is None:
            raise AdapterError("LoRA is not enabled on this engine (start it with --enable-lora)")
        adapter = await asyncio.to_thread(read_adapter, ref, self.lora.dtype, self.lora.device)
        if version is not None:
            adapter.version = version
        await self.run(lambda: self.lora.add(adapter))

    async def unload_adapter(self, name: str) -> None:
        """New requests for it are refused at once; it goes when its last sequence has finished."""
        if self.lora is None:
            raise AdapterError("LoRA is not enabled on this engine (start it with --enable-lora)")
        self.lora.get(name)
        if name in self.unloading:
            raise AdapterError(f"lora adapter {name!r} is already being unloaded")
        done = self.unloading[name] = asyncio.Event()
        try:
            if not self.adapter_users[name]:
                done.set()
            await done.wait()
            await self.run(lambda: self.lora.remove(name))
        finally:
            del self.unloading[name]

    # ---- replies ------------------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def text_of(self, req: Request, n: int, finished: bool) -> str:
        """The text of the first `n` output tokens. As SGLang, a matched stop (token or string) is
        cut from the text unless `no_stop_trim`; the ids always keep the stop token."""
        ids = req.output_ids[:n]
        reason = req.finish_reason if finished else None
        if (
            reason
            and reason["type"] == "stop"
            and isinstance(reason.get("matched"), int)
            and not req.params.no_stop_trim
        ):
            ids = ids[:-1]
        text = self.decode(ids, req.params.skip_special_tokens)
        if finished and req.stop_text_at is not None:
            text = text[: req.stop_text_at]
        return text

    def reply(self, req: Request, n: int, finished: bool, text_in_logprobs: bool = False) -> dict[str, Any]:
        """The docs/protocol.md 1.3 object for a request's first `n` tokens."""
        ids = req.output_ids[:n]
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason if finished else None,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": n,
            "cached_tokens": req.cached_tokens,
            "reasoning_tokens": 0,
            "weight_version": self.version_of(req),
            "weight_versions": _version_spans(req.versions[:n]),
            "num_retractions": req.num_retractions,
        }
        if finished and req.finished_at is not None:
            meta["e2e_latency"] = req.finished_at - req.created
        w = req.wish
        if w.return_logprob:
            tok = self.decode if text_in_logprobs else None
            triple = lambda lp, t: [lp, t, tok([t], False) if tok else None]  # noqa: E731
            # Always present, as SGLang sends them: empty unless `logprob_start_len` is inside the prompt.
            inputs = req.input_ids[w.logprob_start_len :] if req.input_logprobs is not None else []
            meta["input_token_logprobs"] = [triple(lp, t) for lp, t in zip(req.input_logprobs or [], inputs)]
            if w.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None if e is None else [triple(lp, t) for lp, t in e] for e in req.input_top_logprobs or []
                ]
            if w.token_ids_logprob:
                meta["input_token_ids_logprobs"] = [
                    None if e is None else [triple(lp, t) for lp, t in e] for e in req.input_ids_logprobs or []
                ]
            meta["output_token_logprobs"] = [triple(lp, t) for lp, t in zip(req.output_logprobs[:n], ids)]
            meta["output_token_logprobs_length"] = n
            if w.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [[triple(lp, t) for lp, t in e] for e in req.output_top_logprobs[:n]]
            if w.token_ids_logprob:
                meta["output_token_ids_logprobs"] = [
                    [triple(lp, t) for lp, t in e] for e in req.output_ids_logprobs[:n]
                ]
        return {"text": self.text_of(req, n, finished), "output_ids": ids, "meta_info": meta}


def _nth_copy(params: SamplingParams, j: int) -> SamplingParams:
    """Copy j of an `n > 1` request draws with seed + j: n samples, reproducible, not n clones."""
    if params.sampling_seed is None or j == 0:
        return params
    return params.model_copy(update={"sampling_seed": params.sampling_seed + j})


def _version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Weight versions over output positions, as `[{"version", "start", "end"}]` (end exclusive)."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans
