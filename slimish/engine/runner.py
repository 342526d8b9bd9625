"""Model forward for the built-in engine: prefill one request, decode the whole running batch.

KV lives in preallocated buffers (`KVSlab`) that forwards write in place; they grow
geometrically, so a decode step writes one column instead of copying the whole cache. The running
batch's buffers are laid out for its decode steps (`KVSlab.decoding`).

The running batch is left-padded: row i's real tokens are the last `lens[i]` columns, earlier
columns are hidden by the attention mask. A request that joins is prefilled alone (no padding,
so its prompt logits are exact) and then copied into the batch; a request that leaves is dropped
by row, and columns that became padding for every row are cut. This is continuous batching on
the stock HF model classes, with nothing model-specific here.

Prefill runs page by page (`page_size` tokens per forward, always on the same grid from
position 0), so page k's KV depends only on the tokens up to its end: the prefix cache
(prefix_cache.py) can hand a later request exactly the KV it would compute itself.

With `capture_routes` (`--enable-return-routed-experts`), hooks on the MoE routers record the
experts each forwarded token was routed to (`RouteCapture`): the prefill's rows are kept with the
cached pages, as SGLang keeps them with its KV slots, so a cache hit returns the same routes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from slimish import moe
from slimish.batch_invariant import make_batch_invariant
from slimish.engine.attention import MATMUL, use_decode_attention
from slimish.engine.config import EngineConfig
from slimish.engine.decode_forward import decode_forward, supported
from slimish.engine.lora import LoraManager
from slimish.engine.packed import PackedLinears, available
from slimish.engine.prefix_cache import PrefixCache


def engine_device(name: str) -> torch.device:
    """The device `engine.device` names, checked against this machine (`cuda` is `cuda:0`)."""
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"engine.device (--device) is {name!r}, but CUDA is not available here; use cpu")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"engine.device (--device) is {name!r}, but this machine has {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def use_device(device: torch.device) -> None:
    """Make a CUDA `device` the calling thread's current one (CUDA keeps it per thread): NCCL
    groups and tensors made without an explicit device land there, not on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def load_model(path: str, dtype: str, device: torch.device) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    return model


# A decoding slab's columns grow by 1/8 of their capacity, in whole multiples of 16 columns. 1/8:
# the masked columns a step streams past `width` stay under ~1/8 of its work, and a growth (a copy
# of the slab) comes every ~width/8 steps. Multiples of 16: the attention's products (`attend`)
# give the same bits over any multiple of 16 columns, masked ones included (measured), so a row's
# logits do not depend on the capacity that earlier batches left (tests/test_engine_attention.py).
DECODE_GROWTH, DECODE_COLUMNS = 1 / 8, 16
# A decoding slab left more than DECODE_SPAN times as wide as a batch's columns need (by an earlier,
# longer batch) starts over at that batch's own capacity: its views span every column, so the
# batch would stream the earlier one's columns every step (a B=32 step at width ~150 took 1.5-2.2x
# as long in a slab of 1040 columns as in one of 176; views cut at the live columns, which leave a
# gap after each matrix, still 1.4-1.6x: benchmarks/README.md). Within 2x it is kept: its masked
# columns then cost no more than the live ones, and a batch as long as the earlier one need not
# grow it back, a copy of the slab per 1/8.
DECODE_SPAN = 2


def _decode_columns(cols: int) -> int:
    """`cols` rounded up to a whole multiple of DECODE_COLUMNS."""
    return -(-cols // DECODE_COLUMNS) * DECODE_COLUMNS


def _grown(need: int, have: int, share: float = 1.0, least: int = 0) -> int:
    """Capacity for `need` given `have`: unchanged if it fits, else grown by at least `share` of
    `have` and by `least`."""
    return have if need <= have else max(need, have + max(int(have * share), least))


class _SlabLayer(DynamicLayer):
    """One layer's view of a `KVSlab`: `update` writes the new columns in place and returns the
    live region, as `DynamicLayer.update` returns its concatenation."""

    def __init__(self, slab: "KVSlab", index: int) -> None:
        super().__init__()
        self.slab, self.index = slab, index
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s, q = self.slab, key_states.shape[-2]
        s.keys[self.index][: s.rows, :, s.width : s.width + q] = key_states
        s.values[self.index][: s.rows, :, s.width : s.width + q] = value_states
        self.keys, self.values = s.live(self.index, s.width + q)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.slab.width


class KVSlab:
    """K and V of every layer as [rows, kv_heads, columns, head_dim] buffers: the live region is
    `rows` x `width`. A forward writes its new columns at `width` in place (through `cache`, an HF
    cache whose layers are views of the slab); `advance` then moves `width` on. Capacity grows
    geometrically, so decode copies nothing per step.

    A `decoding` slab (the running batch's, which only decode steps read) is laid out for them, as
    measured in benchmarks/README.md ("The running batch's slab laid out for decode"): its views
    span every column of its capacity, masked past `width` (`KVBatch.attention_mask`), so that the
    [columns, head_dim] matrices a step streams lie back to back in memory (views that end at
    `width` leave a gap after each, and stream 25-37% slower); its columns grow by DECODE_GROWTH
    rather than doubling, and start over where an earlier batch left them more than DECODE_SPAN
    times what the running one needs; and V is stored transposed, [rows, kv_heads, head_dim,
    columns] (the views are the same shape), which the attention's second product reads 1.6-2x
    faster (`attend`)."""

    def __init__(self, model: PreTrainedModel, decoding: bool = False) -> None:
        cfg = model.config
        probe = DynamicCache(config=cfg)
        if any(type(layer) is not DynamicLayer for layer in probe.layers):
            raise ValueError(
                f"{cfg.model_type}: the built-in engine supports full-attention models only (its cache has "
                f"{sorted({type(layer).__name__ for layer in probe.layers})})"
            )
        self.heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype, self.device, self.decoding = model.dtype, model.device, decoding
        self.rows = self.width = 0
        self.keys: list[torch.Tensor] = [self._empty(0, 0) for _ in probe.layers]
        self.values: list[torch.Tensor] = [self._empty(0, 0, values=True) for _ in probe.layers]
        self.cache = probe
        self.cache.layers = [_SlabLayer(self, i) for i in range(len(probe.layers))]

    def _empty(self, rows: int, cols: int, values: bool = False) -> torch.Tensor:
        # zeros, not empty: padding columns are masked, but 0 * NaN garbage would still be NaN
        if values and self.decoding:
            buf = torch.zeros(rows, self.heads, self.head_dim, cols, dtype=self.dtype, device=self.device)
            return buf.transpose(2, 3)
        return torch.zeros(rows, self.heads, cols, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> tuple[int, int]:
        """The rows and columns the buffers hold."""
        return self.keys[0].shape[0], self.keys[0].shape[2]

    def columns(self, width: int) -> int:
        """The columns a view spans when `width` are live: all of them when `decoding`."""
        return self.capacity[1] if self.decoding else width

    def live(self, layer: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.columns(self.width if width is None else width)
        return self.keys[layer][: self.rows, :, :w], self.values[layer][: self.rows, :, :w]

    def reserve(self, rows: int, cols: int, exact: bool = False) -> None:
        """Room for `rows` x `cols`, keeping the live region; `exact` allocates no more than asked
        (a prefill knows its length, and its strides then depend on nothing else)."""
        have_rows, have_cols = self.capacity
        if exact:
            new_rows, new_cols = rows, cols
        elif self.decoding:
            if have_cols > DECODE_SPAN * _decode_columns(cols):
                have_rows = have_cols = 0  # start over, live region kept: see DECODE_SPAN
            grown = _grown(cols, have_cols, DECODE_GROWTH, DECODE_COLUMNS)
            new_rows, new_cols = _grown(rows, have_rows), _decode_columns(grown)
        else:
            new_rows, new_cols = _grown(rows, have_rows), _grown(cols, have_cols)
        if new_rows <= have_rows and new_cols <= have_cols:
            return
        new_rows, new_cols = max(new_rows, have_rows), max(new_cols, have_cols)
        r, w = self.rows, self.width
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                bufs[i] = self._empty(new_rows, new_cols, values=bufs is self.values)
                bufs[i][:r, :, :w] = old[:r, :, :w]

    def row(self, i: int) -> KVSlab:
        """Row `i` as a one-row slab sharing this one's memory, to be read (a batched prefill's
        requests each take theirs); its `cache` still writes to the whole slab."""
        view = copy.copy(self)
        view.keys, view.values = [k[i : i + 1] for k in self.keys], [v[i : i + 1] for v in self.values]
        view.rows = 1
        return view

    def advance(self, columns: int) -> None:
        self.width += columns


class KVBatch:
    """The left-padded KV cache of the running batch: row i's `lens[i]` columns end at `width`."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.slab = KVSlab(model, decoding=True)
        self.lens: list[int] = []

    def __len__(self) -> int:
        return len(self.lens)

    @property
    def width(self) -> int:
        return self.slab.width

    def attention_mask(self, lens: torch.Tensor) -> torch.Tensor:
        """The next decode step's mask [rows, 1, 1, columns] (True: attend; 4D, so HF passes it
        through instead of building one per step, attention.py): each row's `lens` columns, which
        end at `width`, and the new one at `width`, over every column the slab's views span."""
        s = self.slab
        cols = torch.arange(s.columns(s.width + 1), device=s.device)
        return ((cols >= s.width - lens[:, None]) & (cols <= s.width))[:, None, None, :]

    @torch.inference_mode()
    def add(self, sources: list["KVSlab"], lens: list[int]) -> None:
        """Append prefilled single-row slabs (their first `lens[i]` columns) as new rows."""
        s, n, width = self.slab, len(self), self.width
        new_width = max([width, *lens])
        s.reserve(n + len(lens), new_width + 1)  # + 1: the next decode step's column
        if new_width > width:  # shift the old rows right: every row ends at the last column
            shift = new_width - width
            for buf in (*s.keys, *s.values):
                buf[:n, :, shift:new_width] = buf[:n, :, :width].clone()
        for j, (src, length) in enumerate(zip(sources, lens)):
            row, pad = n + j, new_width - length
            for dst, part in ((s.keys, src.keys), (s.values, src.values)):
                for buf, src_buf in zip(dst, part):
                    buf[row, :, pad:new_width] = src_buf[0, :, :length]
        s.rows, s.width = n + len(lens), new_width
        self.lens += lens

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order) and cut columns that are padding for all of them."""
        s = self.slab
        self.lens = [self.lens[r] for r in rows]
        start = s.width - max(self.lens, default=0)
        if rows != list(range(len(rows))) or start:
            index, width = torch.tensor(rows, dtype=torch.long, device=s.device), s.width - start
            for buf in (*s.keys, *s.values):
                buf[: len(rows), :, :width] = buf[index, :, start : s.width]
        s.rows, s.width = len(rows), s.width - start


class RouteCapture:
    """The top-k expert ids each MoE router chose in the last forward, as SGLang's routed-experts
    capturer keeps them (sglang 0.5.23: python/sglang/srt/state_capturer/base.py:38-42): int32
    `[tokens, num_hidden_layers, top_k]`, a dense layer's rows 0, shared experts not included
    (routers return only the top-k). Hooks run on every forward, so the engine installs this only
    when routes may be asked for."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.layers, self.top_k = moe.route_shape(model.config)
        self._chosen: dict[int, torch.Tensor] = {}
        for layer, router in moe.routers(model).items():
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> Callable[..., None]:
        def keep(module: torch.nn.Module, args: tuple, out: tuple) -> None:
            self._chosen[layer] = out[2]  # (logits, weights, indices [tokens, top_k])

        return keep

    def take(self, tokens: int, device: torch.device) -> torch.Tensor:
        """The last forward's routes of its `tokens` tokens (flattened batch x sequence), on the CPU."""
        rows = torch.zeros(tokens, self.layers, self.top_k, dtype=torch.int32, device=device)
        for layer, indices in self._chosen.items():
            rows[:, layer] = indices.reshape(tokens, self.top_k)
        self._chosen.clear()
        return rows.cpu()


@dataclass
class CachedPage:
    """What the prefix cache holds for one page."""

    kv: torch.Tensor  # [layers, 2 (k, v), kv_heads, page_size, head_dim]
    routes: torch.Tensor | None  # [page_size, layers, top_k] int32 when routes are captured


@dataclass
class PrefillRequest:
    input_ids: list[int]
    logits_from: int | None  # the first position whose logits are wanted; None: the last only
    namespace: Hashable  # what the KV depends on besides the tokens (the prefix cache's key)
    adapter: str | None = None  # the LoRA adapter's name; None: the base model


@dataclass
class PrefillOutput:
    slab: KVSlab  # one row: the prompt's KV
    logits: torch.Tensor  # [positions, vocab] fp32: from `logits_from` to the end, or just the last
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    routes: torch.Tensor | None = None  # [prompt tokens, layers, top_k] int32 when captured (RouteCapture)


class Runner:
    """Forwards over a model, and the prefix cache they share; the scheduler owns the batch. With
    `lora`, each row is run with its own adapter (None: the base model); the scheduler has given
    each one a slot. `decode_attention_backend` is how one-token forwards attend (attention.py).
    `capture_routes`: record the routers' choices (a MoE model only; `decode_routes` holds the
    last decode step's). `deterministic` (`--enable-deterministic-inference`): every forward runs
    batch-invariant kernels (batch_invariant.py), whatever the decode attention backend says.
    `cpu_packed_linear`: otherwise, an fp32 CPU model's linear layers run on packed weights (packed.py).
    Decode steps of the llama family run `decode_forward` (decode_forward.py) where they can."""

    def __init__(
        self,
        model: PreTrainedModel,
        page_size: int,
        prefix_cache: PrefixCache | None,
        lora: LoraManager | None = None,
        decode_attention_backend: str = EngineConfig.decode_attention_backend,
        capture_routes: bool = False,
        deterministic: bool = False,
        cpu_packed_linear: bool = EngineConfig.cpu_packed_linear,
    ) -> None:
        self.packed: PackedLinears | None = None
        if deterministic:
            make_batch_invariant(model)
        else:
            use_decode_attention(model, decode_attention_backend)
            if cpu_packed_linear and available(model):
                self.packed = PackedLinears(model)
        self.model = model
        self.device = model.device
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.lora = lora
        self.capture = RouteCapture(model) if capture_routes else None
        # decode_forward.py: HF's own forward for the rest (its hooks capture routes; its attention may be SDPA)
        self.own_decode = (
            not deterministic and decode_attention_backend == MATMUL and not capture_routes and supported(model)
        )
        self.decode_routes: torch.Tensor | None = None  # [rows, layers, top_k] of the last decode step

    def _adapters(self, adapters: list[str | None] | None) -> ContextManager[None]:
        return self.lora.rows(adapters) if self.lora is not None and adapters is not None else nullcontext()

    def flush_cache(self) -> None:
        """Drop what was derived from the weights: cached KV and packed weights (every weight load calls this)."""
        if self.packed is not None:
            self.packed.drop()
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def hit_limit(self, n_ids: int, logits_from: int | None) -> int:
        """How much of a prompt may come from the cache: never its last token (its logits are
        needed), nor a position whose logits were asked for (`logits_from`)."""
        return min(n_ids - 1, n_ids if logits_from is None else logits_from)

    def cached_prefix(self, namespace: Hashable, input_ids: list[int], logits_from: int | None) -> int:
        """Tokens of this prompt that `prefill` would take from the cache now."""
        if self.prefix_cache is None:
            return 0
        return (
            len(self.prefix_cache.match(namespace, input_ids, self.hit_limit(len(input_ids), logits_from)))
            * self.page_size
        )

    def prefill(
        self, input_ids: list[int], logits_from: int | None, namespace: Hashable, adapter: str | None = None
    ) -> PrefillOutput:
        """One request's `prefill_many`."""
        return self.prefill_many([PrefillRequest(input_ids, logits_from, namespace, adapter)])[0]

    @torch.inference_mode()
    def prefill_many(self, requests: list[PrefillRequest]) -> list[PrefillOutput]:
        """Each request's KV and the logits of its positions `logits_from..` (None: the last
        only), and with capture the routes of every position.

        Cached whole pages are copied in; the rest runs one page per forward, and the whole
        pages computed go into the cache under the request's namespace. Requests with the same
        page schedule (as long, as many cached pages, the same logits wanted) run together, one
        forward per page for all of them (SGLang's extend batch, as equal rows): the kernels give a
        row the same bits whatever rows share its forward, so each request gets exactly what it
        would alone (tests/test_engine_decode.py). Rows of other lengths are not padded in: SDPA
        over a longer page changes the last bits (benchmarks/README.md). A request whose first
        page to compute is an earlier one's waits until that one is cached."""
        p = self.page_size
        groups: dict[tuple[int, int, int | None], list[tuple[int, list[CachedPage]]]] = {}
        later, firsts = [], set()
        for i, r in enumerate(requests):
            n = len(r.input_ids)
            pages = (
                self.prefix_cache.match(r.namespace, r.input_ids, self.hit_limit(n, r.logits_from))
                if self.prefix_cache
                else []
            )
            end = (len(pages) + 1) * p  # the first page this request computes; cached if whole
            if self.prefix_cache is not None and end <= n:
                first = (r.namespace, tuple(r.input_ids[:end]))
                if first in firsts:
                    later.append(i)
                    continue
                firsts.add(first)
            groups.setdefault((n, len(pages), r.logits_from), []).append((i, pages))
        outputs: dict[int, PrefillOutput] = {}
        for members in groups.values():
            done = self._prefill_group([requests[i] for i, _ in members], [pages for _, pages in members])
            outputs.update(zip([i for i, _ in members], done))
        if later:
            outputs.update(zip(later, self.prefill_many([requests[i] for i in later])))
        return [outputs[i] for i in range(len(requests))]

    def _prefill_group(self, requests: list[PrefillRequest], cached: list[list[CachedPage]]) -> list[PrefillOutput]:
        """Requests of one page schedule, in one slab of a row each, page by page."""
        rows, n, p, logits_from = len(requests), len(requests[0].input_ids), self.page_size, requests[0].logits_from
        slab = KVSlab(self.model)
        slab.reserve(rows, n, exact=True)
        slab.rows = rows
        for row, pages in enumerate(cached):
            for k, page in enumerate(pages):
                for i, (keys, values) in enumerate(zip(slab.keys, slab.values)):
                    keys[row, :, k * p : (k + 1) * p] = page.kv[i, 0]
                    values[row, :, k * p : (k + 1) * p] = page.kv[i, 1]
        slab.advance(len(cached[0]) * p)
        first = n - 1 if logits_from is None else logits_from
        ids = torch.tensor([r.input_ids for r in requests], device=self.device)
        logits, routes = [], [[page.routes for page in pages] for pages in cached]
        for start in range(slab.width, n, p):
            end = min(start + p, n)
            keep = max(end - max(first, start), 0)
            with self._adapters([r.adapter for r in requests]):
                out = self.model(
                    input_ids=ids[:, start:end],
                    position_ids=torch.arange(start, end, device=self.device).expand(rows, -1),
                    cache=slab.cache,
                    use_cache=True,
                    logits_to_keep=keep if keep else torch.empty(0, dtype=torch.long, device=self.device),
                )
            slab.advance(end - start)
            logits.append(out.logits.float())
            if self.capture is not None:
                taken = self.capture.take(rows * (end - start), self.device)
                for row, chunk in enumerate(taken.view(rows, end - start, *taken.shape[1:])):
                    routes[row].append(chunk)
        outputs = []
        for row, r in enumerate(requests):
            view, row_routes = slab.row(row), torch.cat(routes[row]) if self.capture is not None else None
            if self.prefix_cache is not None:
                self.prefix_cache.insert(
                    r.namespace, r.input_ids, n // p, lambda k, v=view, rr=row_routes: _page(v, rr, k * p, (k + 1) * p)
                )
            row_logits = torch.cat([chunk[row] for chunk in logits])
            outputs.append(PrefillOutput(view, row_logits, len(cached[row]) * p, row_routes))
        return outputs

    @torch.inference_mode()
    def decode(self, batch: KVBatch, tokens: list[int], adapters: list[str | None] | None = None) -> torch.Tensor:
        """Feed one token per row (row i with `adapters[i]`, all base when None); returns next-token logits [rows, vocab] in fp32."""
        s, device = batch.slab, self.device
        s.reserve(len(batch), s.width + 1)
        ids = torch.tensor(tokens, device=device).unsqueeze(1)
        lens = torch.tensor(batch.lens, device=device)
        mask = batch.attention_mask(lens)
        positions = lens.unsqueeze(1)
        if self.own_decode and not any(adapters or ()):  # no adapter row: LoRA's hooks would add nothing
            logits = decode_forward(self.model, s.cache.layers, ids, positions, mask, self.packed)
        else:
            with self._adapters(adapters):
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    cache=s.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            logits = out.logits[:, -1, :]
        s.advance(1)
        batch.lens = [n + 1 for n in batch.lens]
        if self.capture is not None:
            self.decode_routes = self.capture.take(len(tokens), device)
        return logits.float()


def _page(slab: KVSlab, routes: torch.Tensor | None, start: int, end: int) -> CachedPage:
    """Columns [start, end) of a one-row slab as one page (KV [layers, 2, kv_heads, page,
    head_dim]), with the routes of those positions."""
    kv = torch.stack([torch.stack([k[0, :, start:end], v[0, :, start:end]]) for k, v in zip(slab.keys, slab.values)])
    return CachedPage(kv, None if routes is None else routes[start:end].clone())
