"""Continuous batching for the built-in engine, on one thread that owns the model.

Each loop turn: run control commands (abort, pause, weight updates), admit waiting requests
within a prefill-token budget (each is prefilled alone and joins the batch at once; identical
prompts admitted together share one prefill, and whole pages a prompt shares with earlier ones
come from the prefix cache and cost no budget), then one
decode step for the whole batch; finished requests leave right after the step that ended them.
Because admission happens between decode steps and the prefill budget is bounded, a short
request never waits for a long one to finish.

Everything that touches the model or the batch runs on this thread; other threads talk to it
through `submit` and `call`, so the weight-update code needs no locks of its own.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import re
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from slimish.batch_invariant import log_softmax
from slimish.engine.runner import KVBatch, PrefillOutput, PrefillRequest, Runner, use_device
from slimish.engine.sampling import Logprobs, RowState, sample, temperature_of
from slimish.protocol import DEFAULT_WEIGHT_VERSION, SamplingParams

log = logging.getLogger(__name__)


# (KV namespace, the ids to prefill, the first prompt position whose logits are needed)
PrefillKey = tuple[Hashable, tuple[int, ...], int | None]


@dataclass
class LogprobWish:
    """What a request asked to get back besides tokens."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


@dataclass
class Sequence:
    """One sequence being generated. Lists only grow, so readers on other threads may slice them."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    stop_ids: set[int]
    wish: LogprobWish
    emit: Callable[["Sequence", bool], None]  # (request, finished); called on the scheduler thread
    decode_text: Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    versions: list[str] = field(default_factory=list)  # weight version of each output token
    # With `wish.return_routed_experts`: int32 [tokens, layers, top_k] chunks, the routes of every
    # token forwarded (the prefill's, then one per decode step); a re-prefill replaces them.
    routes: list[torch.Tensor] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    stop_text_at: int | None = None  # where a matched stop string starts in the text
    num_retractions: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV this request did not compute (prefix cache, shared prefill)
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    generator: torch.Generator | None = None
    grammar: Any = None  # an xgrammar matcher: masks each step, fed each token
    lora: str | None = None  # the LoRA adapter's name; None: the base model

    def __post_init__(self) -> None:
        if self.params.sampling_seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.sampling_seed)

    def row_state(self) -> RowState:
        return RowState(self.params, self.input_ids, self.output_ids, self.stop_ids, self.generator, self.grammar)


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future
    needs_idle: bool  # wait until no request runs, or generation is paused (SGLang's writer lock)


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        max_running_requests: int,
        max_prefill_tokens: int,
        share_prefills: bool,
        on_step: Callable[["Scheduler"], None] | None = None,
    ) -> None:
        self.runner = runner
        self.batch = KVBatch(runner.model)
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.share_prefills = share_prefills  # one prefill for identical prompts admitted together (n copies)
        self.on_step = on_step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # row i of the batch is running[i]
        self.paused: str | None = None  # None, or the pause mode
        self.released = False  # the KV freed (/release_memory_occupation): nothing generates
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.last_gen_throughput = 0.0
        self._inbox: deque[Sequence] = deque()
        self._admitting: list[Sequence] = []
        self._commands: deque[_Command] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="slimish-scheduler", daemon=True)

    # ---- thread-safe entry points ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def submit(self, req: Sequence) -> None:
        with self._wake:
            self._inbox.append(req)
            self._wake.notify()

    def call(self, fn: Callable[[], Any], needs_idle: bool = False) -> concurrent.futures.Future:
        """Run `fn` on the scheduler thread between steps; the future holds its result."""
        cmd = _Command(fn, concurrent.futures.Future(), needs_idle)
        with self._wake:
            self._commands.append(cmd)
            self._wake.notify()
        return cmd.future

    # ---- commands (run on the scheduler thread via `call`) ------------------------------------

    def abort(
        self,
        rid: str = "",
        abort_all: bool = False,
        rids: set[str] = frozenset(),
        message: str = "Abort by request.",
        lora: str | None = None,
    ) -> int:
        """Abort by id, all, or every request of the adapter named `lora`."""
        hit = [
            r
            for r in [*self.waiting, *self.running]
            if abort_all or r.rid == rid or r.rid in rids or (lora and r.lora == lora)
        ]
        for r in hit:
            self._finish(r, {"type": "abort", "message": message, "status_code": None, "err_type": None})
        self._drop_finished()
        return len(hit)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(abort_all=True, message="Abort by pause_generation.")
        elif mode == "retract":
            for r in reversed(self.running):
                r.num_retractions += 1
                self.waiting.appendleft(r)
            self.running = []
            self.batch.keep([])
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def release_kv(self) -> None:
        """`/release_memory_occupation`: the batch's KV buffers and the prefix cache are freed, and
        nothing is admitted until `resume_kv` (new requests wait, as while paused); the next batch
        grows its buffers afresh. Refused unless idle, as SGLang asserts (waiting requests are
        allowed while paused)."""
        if self.running or (self.waiting and self.paused is None):
            raise ValueError(
                f"release_memory_occupation needs the engine idle: {len(self.running)} running, "
                f"{len(self.waiting)} waiting; pause generation or let them finish first"
            )
        self.batch = KVBatch(self.runner.model)
        self.runner.flush_cache()
        self.released = True

    def resume_kv(self) -> None:
        if not self.released:
            raise ValueError("resume_memory_occupation: kv_cache is not released")
        self.released = False

    def kv_bytes(self) -> int:
        """Bytes of KV held: the batch's buffers and the prefix cache's pages."""
        s = self.batch.slab
        per_token = 2 * len(s.keys) * s.heads * s.head_dim * s.dtype.itemsize
        cached = self.runner.prefix_cache.tokens if self.runner.prefix_cache is not None else 0
        return sum(t.nbytes for t in (*s.keys, *s.values)) + cached * per_token

    def version_of(self, lora: str | None) -> str:
        """The weight version of the base model, or of the adapter named `lora`."""
        return self.weight_version if lora is None else self.runner.lora.get(lora).version

    # ---- the loop -----------------------------------------------------------------------------

    def _has_work(self) -> bool:
        if self._commands or self._inbox:
            return True
        return self.paused is None and not self.released and bool(self.waiting or self.running)

    def _loop(self) -> None:
        use_device(self.runner.device)
        while True:
            with self._wake:
                while not self._stopped and not self._has_work():
                    self._wake.wait()
                if self._stopped:
                    return
                self.waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                blocked = self._run_commands()
                if self.paused is None and not self.released:
                    if not blocked:
                        self._admit()
                    if self.running:
                        self._decode()
            except Exception as exc:  # a bug must not kill the server: fail what is running
                log.error("scheduler step failed:\n%s", traceback.format_exc())
                for r in [*self.running, *self.waiting, *self._admitting]:
                    self._finish(
                        r,
                        {
                            "type": "abort",
                            "message": f"engine error: {exc}",
                            "status_code": 500,
                            "err_type": "internal",
                        },
                    )
                self._drop_finished()
            if self.on_step:
                self.on_step(self)

    def _run_commands(self) -> bool:
        """Run what can run now; True while an idle-needing command waits (admission stops)."""
        while self._commands:
            cmd = self._commands[0]
            if cmd.needs_idle and self.paused is None and self.running:
                return True
            self._commands.popleft()
            try:
                cmd.future.set_result(cmd.fn())
            except Exception as exc:
                cmd.future.set_exception(exc)
        return False

    def _admit(self) -> None:
        """Take waiting requests within the prefill budget, prefill them together
        (`Runner.prefill_many`: one forward per page for those of one page schedule), then let each
        sample its first token and join the batch."""
        budget = self.max_prefill_tokens
        admitted: list[tuple[Sequence, int, bool]] = []  # (request, its prefill's index, shared with an earlier one)
        self._admitting = []  # off `waiting`, not yet `running`: a failing step must fail these too
        held: list[Sequence] = []  # no adapter slot free this round
        prefills: list[PrefillRequest] = []
        index_of: dict[PrefillKey, int] = {}  # with share_prefills: this round's prefills, by what makes them identical
        planned: set[tuple[Hashable, tuple[int, ...]]] = set()  # the whole pages this round's prefills will cache
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            req = self.waiting[0]
            key = self._prefill_key(req)
            shared = key in index_of
            cost = 0 if shared else self._prefill_cost(key, planned)
            if admitted and cost > budget:
                break
            self.waiting.popleft()
            if not self._adapter_slot(req, self._admitting):
                held.append(req)
                continue
            budget -= cost
            if not shared:
                namespace, ids, logits_from = key
                if self.share_prefills:
                    index_of[key] = len(prefills)
                    planned.update(
                        (namespace, ids[:end])
                        for end in range(self.runner.page_size, len(ids) + 1, self.runner.page_size)
                    )
                prefills.append(PrefillRequest(list(ids), logits_from, namespace, req.lora))
            admitted.append((req, index_of[key] if shared else len(prefills) - 1, shared))
            self._admitting.append(req)
        self.waiting.extendleft(reversed(held))
        outputs = self.runner.prefill_many(prefills) if prefills else []
        firsts = [(req, outputs[index]) for req, index, shared in admitted if self._start(req, outputs[index], shared)]
        if firsts:  # every admitted request's first token in one sampling call
            logits = torch.cat([out.logits[-1:] for _, out in firsts])
            self._append_all([req for req, _ in firsts], logits)
        joined = [(req, outputs[index].slab) for req, index, _ in admitted if req.finish_reason is None]
        if joined:
            slabs = [slab for _, slab in joined]
            self.batch.add(slabs, [s.width for s in slabs])
            self.running += [req for req, _ in joined]
        self._admitting = []

    def _adapter_slot(self, req: Sequence, joined: list[Sequence]) -> bool:
        """Whether `req`'s adapter has a slot next to the batch's (`--max-loras-per-batch`)."""
        lora = self.runner.lora
        if lora is None or req.lora is None:
            return True
        return lora.acquire(req.lora, {r.lora for r in [*self.running, *joined] if r.lora is not None})

    def kv_namespace(self, req: Sequence) -> Hashable:
        """What the KV of `req` depends on besides its tokens, so that the prefix cache and shared
        prefills never mix KV across namespaces: the weights (a weight load also flushes the
        cache) and the request's adapter, as loaded (`uid`: a reload under the same name is
        another adapter) and versioned."""
        if req.lora is None or self.runner.lora is None:
            return (self.weight_version,)
        adapter = self.runner.lora.get(req.lora)
        return (self.weight_version, adapter.uid, adapter.version)

    @staticmethod
    def _logits_from(req: Sequence) -> int | None:
        """The first prompt position whose logits the request needs (row j-1 scores token j)."""
        start = req.wish.logprob_start_len
        if req.output_ids or not (req.wish.return_logprob and 0 <= start < len(req.input_ids)):
            return None
        return max(start - 1, 0)

    def _prefill_ids(self, req: Sequence) -> list[int]:
        """A retracted request resumes: its last output token is not in the cache yet."""
        return req.input_ids + req.output_ids[:-1] if req.output_ids else req.input_ids

    def _prefill_key(self, req: Sequence) -> PrefillKey:
        """(KV namespace, the ids to prefill, the first position whose logits are needed): what
        makes two prefills identical, and all a prefill needs."""
        return (self.kv_namespace(req), tuple(self._prefill_ids(req)), self._logits_from(req))

    def _prefill_cost(self, key: PrefillKey, planned: set[tuple[Hashable, tuple[int, ...]]]) -> int:
        """Prompt tokens to compute: past the cached prefix, and past the whole pages an earlier
        prefill of this round caches first (`planned`; `Runner.prefill_many` runs them in that order)."""
        namespace, ids, logits_from = key
        cached, page = self.runner.cached_prefix(namespace, list(ids), logits_from), self.runner.page_size
        while (
            cached + page <= self.runner.hit_limit(len(ids), logits_from)
            and (namespace, ids[: cached + page]) in planned
        ):
            cached += page
        return len(ids) - cached

    def _start(self, req: Sequence, out: PrefillOutput, shared: bool) -> bool:
        """A prefilled request's prompt logprobs and routes; whether it samples a first token now
        (`_admit` samples those of one round together). A resumed request has its first token
        already; a prompt-scoring one (max_new_tokens 0) finishes here. `shared`: an identical
        request of this round computed the prefill."""
        logits_from = self._logits_from(req)
        cached = len(self._prefill_ids(req)) if shared else out.cached_tokens
        if req.wish.return_routed_experts:  # a resumed request's too: as SGLang, they are recomputed
            req.routes = [out.routes]
        if req.output_ids:  # resumed: what its first prefill found stays reported
            return False
        req.cached_tokens = cached
        if logits_from is not None:
            self._input_logprobs(req, out.logits)
        if req.params.max_new_tokens == 0:  # prompt scoring: input logprobs only
            self._finish(req, {"type": "length", "length": 0})
            return False
        return True

    def _decode(self) -> None:
        t0 = time.monotonic()
        logits = self.runner.decode(
            self.batch, [r.output_ids[-1] for r in self.running], [r.lora for r in self.running]
        )
        for i, r in enumerate(self.running):
            if r.wish.return_routed_experts:
                r.routes.append(self.runner.decode_routes[i : i + 1])
        self._append_all(self.running, logits)
        self.last_gen_throughput = len(self.running) / max(time.monotonic() - t0, 1e-9)
        self._drop_finished()

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.running) if r.finish_reason is None]
        if len(keep) < len(self.running):
            self.batch.keep(keep)
            self.running = [self.running[i] for i in keep]
        self.waiting = deque(r for r in self.waiting if r.finish_reason is None)

    # ---- per-token bookkeeping ----------------------------------------------------------------

    def _append_all(self, reqs: list[Sequence], logits: torch.Tensor) -> None:
        """Samples the next token of each request (row k of `logits` is `reqs[k]`'s) and appends
        it. The chosen tokens' logprobs are read in one gather: a row read per request cost
        ~2.5 us each, 0.15 ms a step at 64 rows."""
        tokens, logprobs = sample(logits, [r.row_state() for r in reqs])
        chosen = logprobs.of(tokens)
        for k, req in enumerate(reqs):
            self._append(req, tokens[k], chosen[k], logprobs, k)

    def _append(self, req: Sequence, token: int, logprob: float, logprobs: Logprobs, row: int) -> None:
        """`token` and its `logprob`; row `row` of `logprobs` is its distribution (top logprobs)."""
        req.output_ids.append(token)
        req.versions.append(self.version_of(req.lora))
        if req.grammar is not None:
            req.grammar.accept_token(token)  # the mask allowed it, so the matcher takes it
        w = req.wish
        if w.return_logprob:
            req.output_logprobs.append(logprob)
            if w.top_logprobs_num > 0:
                req.output_top_logprobs.append(_top(logprobs.row(row), w.top_logprobs_num))
            if w.token_ids_logprob:
                req.output_ids_logprobs.append(_pick(logprobs.row(row), w.token_ids_logprob))
        reason = self._finish_reason(req, token)
        if reason is not None:
            self._finish(req, reason)
        else:
            req.emit(req, False)

    def _finish_reason(self, req: Sequence, token: int) -> dict[str, Any] | None:
        p = req.params
        if token in req.stop_ids:  # sampling masks stop ids until min_new_tokens
            return {"type": "stop", "matched": token}
        if req.grammar is not None and req.grammar.is_terminated():
            return {"type": "stop", "matched": token}  # the grammar ended on one of its stop tokens
        stops, regexes = p.stop_strings(), p.stop_regexes()
        if stops or regexes:
            text = req.decode_text(req.output_ids, p.skip_special_tokens)
            hits = [(text.find(s), s) for s in stops if s and s in text]
            hits += [(m.start(), m.group(0)) for m in (re.search(rx, text) for rx in regexes) if m]
            if hits:
                at, matched = min(hits)
                req.stop_text_at = None if p.no_stop_trim else at
                return {"type": "stop", "matched": matched}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        return None

    def _finish(self, req: Sequence, reason: dict[str, Any]) -> None:
        if req.finish_reason is not None:
            return
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        req.emit(req, True)

    def _input_logprobs(self, req: Sequence, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens from `logprob_start_len` on; the first token has none."""
        # row r of `logits` is position `first + r`, which predicts token `first + r + 1`
        lp = log_softmax(logits / temperature_of(req.params))
        ids, start, w, first = req.input_ids, req.wish.logprob_start_len, req.wish, self._logits_from(req)
        positions = range(start, len(ids))
        req.input_logprobs = [None if j == 0 else float(lp[j - 1 - first, ids[j]]) for j in positions]
        if w.top_logprobs_num > 0:
            req.input_top_logprobs = [
                None if j == 0 else _top(lp[j - 1 - first], w.top_logprobs_num) for j in positions
            ]
        if w.token_ids_logprob:
            req.input_ids_logprobs = [
                None if j == 0 else _pick(lp[j - 1 - first], w.token_ids_logprob) for j in positions
            ]


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[float | None, int]]:
    vals, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return list(zip(_finite(vals.tolist()), ids.tolist()))


def _pick(logprobs: torch.Tensor, ids: list[int]) -> list[tuple[float | None, int]]:
    return list(zip(_finite(logprobs[torch.tensor(ids, device=logprobs.device)].tolist()), ids))


def _finite(values: list[float]) -> list[float | None]:
    """log 0 of a masked token is -inf, which JSON cannot carry: null, as SGLang's orjson writes it."""
    return [v if math.isfinite(v) else None for v in values]
