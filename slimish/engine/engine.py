"""The asyncio face of the built-in engine: turns validated requests into scheduled sequences and
their progress back into reply objects (docs/protocol.md 1.3).

The HTTP layers (native `/generate` in server.py, OpenAI routes in openai_api.py) both go
through `Engine.submit`, so validation, tokenisation and reply building exist once (their pure
parts in items.py and replies.py). The admin routes go through its methods too (abort, pause,
`load_weights`, `set_weight_version`, `flush_cache`...): the scheduler and the runner are this
class's alone, and every change of state runs on the scheduler thread, between steps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from slimish.colocate import WeightStore
from slimish.engine.config import EngineConfig
from slimish.engine.grammar import GrammarError, Grammars, matcher
from slimish.engine.items import Item, RequestError, check_limits, check_routes, nth_copy
from slimish.engine.lora import Adapter, AdapterError, AdapterRef, LoraManager, read_adapter
from slimish.engine.metrics import Metrics
from slimish.engine.prefix_cache import PrefixCache
from slimish.engine.profiler import Profiler
from slimish.engine.replies import native_reply, text_of
from slimish.engine.runner import Runner, engine_device, load_model, use_device
from slimish.engine.scheduler import LogprobWish, Scheduler, Sequence
from slimish.engine.weights import WeightUpdater
from slimish.formats.model import ModelFormat
from slimish.moe import route_shape
from slimish.protocol import MEMORY_TAGS, GenerateReqInput, SamplingParams


class Unavailable(RuntimeError):
    """The engine cannot serve now (503): its weights are torn by a failed broadcast."""


class Overloaded(RuntimeError):
    """The engine's queue is full (503 with `Retry-After`): retry later, or on another engine."""


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
        if cfg.shared_weights:  # colocated: the trainer's weights, in place of the loaded copy
            WeightStore(cfg.shared_weights).attach(self.model, fill=False, field="engine.dtype (--dtype)")
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
        # The generation loop and the model's forward passes: private, the routes go through
        # this class's methods (on the scheduler thread, between steps, where they change state).
        self.route_shape = route_shape(self.model.config)  # (layers, top_k); None: a dense model
        capture = cfg.enable_return_routed_experts and self.route_shape is not None
        if cfg.enable_deterministic_inference:
            torch.set_num_threads(1)  # batch-invariant kernels need a row never split between threads
        elif cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        self._runner = Runner(
            self.model,
            cfg.page_size,
            prefix_cache,
            self.lora,
            cfg.decode_attention_backend,
            capture_routes=capture,
            deterministic=cfg.enable_deterministic_inference,
            cpu_packed_linear=cfg.cpu_packed_linear,
        )
        self._scheduler = Scheduler(
            self._runner,
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
        self._scheduler.start()

    def stop(self) -> None:
        self._scheduler.stop()

    async def run(self, fn: Any, needs_idle: bool = False) -> Any:
        """Run `fn` on the scheduler thread (between steps) and await its result."""
        return await asyncio.wrap_future(self._scheduler.call(fn, needs_idle))

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
                return_routed_experts=body.return_routed_experts,  # scalars for every item, as SGLang's
                routed_experts_start_len=body.routed_experts_start_len,
            )
            for j in range(n):
                if isinstance(body.rid, list):
                    rid = body.rid[i] if n == 1 else f"{body.rid[i]}-{j}"
                else:
                    rid = f"{base}-{i * n + j}" if batch else base
                items.append(Item(ids, nth_copy(params[i], j), rid, wish, lora=body.per_item("lora_path", i)))
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
        try:
            item.grammar = self.grammars.compile(item.params)  # compiled once per text (xgrammar's cache)
        except GrammarError as exc:
            raise RequestError(str(exc)) from None
        check_limits(item, self.cfg, self.vocab_size, self.context_length)
        check_routes(item, self.cfg, self.route_shape is not None)

    def submit(self, items: list[Item], stream: bool) -> AsyncIterator[tuple[list[Sequence], Update]]:
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
            def emit(req: Sequence, finished: bool) -> None:
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
            Sequence(
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
            self._scheduler.submit(r)
        return self._progress(reqs, queue, stream)

    async def _progress(
        self, reqs: list[Sequence], queue: asyncio.Queue[Update], stream: bool
    ) -> AsyncIterator[tuple[list[Sequence], Update]]:
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
                aborted = self._scheduler.call(lambda: self._scheduler.abort(rids=rids))
                aborted.add_done_callback(lambda _: self.metrics.finished(reqs, stream))

    async def generate(self, items: list[Item]) -> list[Sequence]:
        """Run to completion; the finished requests in item order."""
        reqs: list[Sequence] = []
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

    def version_of(self, req: Sequence) -> str:
        """The version a reply reports: the base's, or the adapter's (its last one if unloaded since)."""
        if req.lora is not None and (self.lora is None or req.lora not in self.lora.adapters):
            return req.versions[-1] if req.versions else self._scheduler.weight_version
        return self._scheduler.version_of(req.lora)

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

    # ---- control and state (the admin and info routes) -----------------------------------------

    @property
    def weight_version(self) -> str:
        """The base model's weight version: SGLang's label, "default" until a push sets one."""
        return self._scheduler.weight_version

    def in_flight(self) -> tuple[int, int]:
        """Sequences running and waiting now."""
        return len(self._scheduler.running), len(self._scheduler.waiting)

    def kv_cache_bytes(self) -> int:
        return self._scheduler.kv_bytes()

    @property
    def last_gen_throughput(self) -> float:
        return self._scheduler.last_gen_throughput

    def render_metrics(self) -> bytes:
        return self.metrics.render(self._scheduler)

    async def abort(self, rid: str = "", abort_all: bool = False, message: str = "Abort by request.") -> None:
        await self.run(lambda: self._scheduler.abort(rid, abort_all, message=message))

    async def pause(self, mode: str) -> None:
        await self.run(lambda: self._scheduler.pause(mode))

    async def resume(self) -> None:
        await self.run(self._scheduler.resume)

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while sequences are in flight, as SGLang does."""

        def flush() -> bool:
            if self._scheduler.running or self._scheduler.waiting:
                return False
            self._runner.flush_cache()
            return True

        return await self.run(flush)

    async def occupy_memory(self, tags: list[str] | None, release: bool) -> None:
        """`/release_memory_occupation` (`release`) and `/resume_memory_occupation` on host memory:
        `kv_cache` frees the KV (Scheduler.release_kv); `weights` and `cuda_graph` free nothing
        here (a colocated engine's weights are the trainer's one copy). None or []: every tag."""
        if unknown := sorted(set(tags or ()) - set(MEMORY_TAGS)):
            raise RequestError(f"tags: {unknown} are not memory tags; some of {list(MEMORY_TAGS)}, or null for all")
        if not tags or "kv_cache" in tags:
            await self.run(self._scheduler.release_kv if release else self._scheduler.resume_kv)

    async def set_weight_version(self, version: str, abort_all: bool = False) -> None:
        """Label the base model's weights `version`, aborting every sequence first if asked."""

        def apply() -> None:
            if abort_all:
                self._scheduler.abort(abort_all=True)
            self._scheduler.weight_version = version

        await self.run(apply)

    async def load_weights(
        self, load: Callable[[], None], version: str | None = None, lora: str | None = None, abort_all: bool = False
    ) -> None:
        """Abort every sequence first if asked; run `load` while none runs (SGLang's writer lock)
        or while paused; drop the KV cache, which even a failed load may have made stale; then
        version the base model, or only the adapter `lora`. When a failed load left the weights
        torn, the sequences on them are aborted (a paused one must not resume) before it raises."""
        if self.cfg.shared_weights and lora is None:
            raise ValueError(f"these weights are a colocated trainer's (--shared-weights {self.cfg.shared_weights})")
        if abort_all:
            await self.abort(abort_all=True)

        def load_and_version() -> None:
            try:
                load()
            finally:
                self._runner.flush_cache()
            if version is not None and lora is None:
                self._scheduler.weight_version = version
            elif version is not None:
                self.lora.get(lora).version = version  # type: ignore[union-attr]

        try:
            await self.run(load_and_version, needs_idle=True)
        except Exception:
            if (torn := self.torn_error(lora)) is not None:
                aborted = f"Abort: {torn}"
                await self.run(lambda: self._scheduler.abort(abort_all=lora is None, lora=lora, message=aborted))
            raise

    async def load_weights_from_disk(self, path: str, version: str | None = None, abort_all: bool = False) -> None:
        def load() -> None:
            self.weights.update_from_disk(path)
            self.model_path = path

        await self.load_weights(load, version, abort_all=abort_all)

    def torn_error(self, lora: str | None = None) -> str | None:
        """Why the base model's weights (or the adapter `lora`'s) are torn by a failed push; None if whole."""
        if lora is None:
            return self.weights.torn_error()
        adapter = self.lora.adapters.get(lora) if self.lora is not None else None  # None if unloaded meanwhile
        return adapter.torn_error() if adapter is not None else None

    # ---- replies ------------------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def text_of(self, seq: Sequence, n: int, finished: bool) -> str:
        return text_of(seq, n, finished, self.decode)

    def reply(self, seq: Sequence, n: int, finished: bool, text_in_logprobs: bool = False) -> dict[str, Any]:
        """The docs/protocol.md 1.3 object for a sequence's first `n` tokens (replies.py)."""
        return native_reply(seq, n, finished, self.decode, self.version_of(seq), text_in_logprobs)
