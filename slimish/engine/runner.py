"""Model forward for the built-in engine: prefill one request, decode the whole running batch.

KV lives in preallocated buffers (`KVSlab`) that forwards write in place; they grow
geometrically, so a decode step writes one column instead of copying the whole cache.

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

from collections.abc import Callable, Hashable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from slimish import moe
from slimish.batch_invariant import make_batch_invariant
from slimish.engine.attention import use_decode_attention
from slimish.engine.config import EngineConfig
from slimish.engine.lora import LoraManager
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


def _grown(need: int, have: int) -> int:
    """Capacity for `need` given `have`: unchanged if it fits, else at least doubled."""
    return have if need <= have else max(need, 2 * have)


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
    """K and V of every layer as [rows, kv_heads, columns, head_dim] buffers, plus a 0/1 column
    mask: the live region is `rows` x `width`. A forward writes its new columns at `width` in place
    (through `cache`, an HF cache whose layers are views of the slab); `advance` then moves
    `width` on. Capacity grows geometrically, so decode copies nothing per step."""

    def __init__(self, model: PreTrainedModel) -> None:
        cfg = model.config
        probe = DynamicCache(config=cfg)
        if any(type(layer) is not DynamicLayer for layer in probe.layers):
            raise ValueError(
                f"{cfg.model_type}: the built-in engine supports full-attention models only (its cache has "
                f"{sorted({type(layer).__name__ for layer in probe.layers})})"
            )
        self.heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype, self.device = model.dtype, model.device
        self.rows = self.width = 0
        self.keys: list[torch.Tensor] = [self._empty(0, 0) for _ in probe.layers]
        self.values: list[torch.Tensor] = [self._empty(0, 0) for _ in probe.layers]
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.cache = probe
        self.cache.layers = [_SlabLayer(self, i) for i in range(len(probe.layers))]

    def _empty(self, rows: int, cols: int) -> torch.Tensor:
        # zeros, not empty: padding columns are masked, but 0 * NaN garbage would still be NaN
        return torch.zeros(rows, self.heads, cols, self.head_dim, dtype=self.dtype, device=self.device)

    def live(self, layer: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.width if width is None else width
        return self.keys[layer][: self.rows, :, :w], self.values[layer][: self.rows, :, :w]

    def reserve(self, rows: int, cols: int, exact: bool = False) -> None:
        """Room for `rows` x `cols`, keeping the live region; `exact` allocates no more than asked
        (a prefill knows its length, and its strides then depend on nothing else)."""
        have_rows, have_cols = self.mask.shape
        new_rows, new_cols = (rows, cols) if exact else (_grown(rows, have_rows), _grown(cols, have_cols))
        if new_rows <= have_rows and new_cols <= have_cols:
            return
        new_rows, new_cols = max(new_rows, have_rows), max(new_cols, have_cols)
        r, w = self.rows, self.width
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                bufs[i] = self._empty(new_rows, new_cols)
                bufs[i][:r, :, :w] = old[:r, :, :w]
        mask = torch.zeros(new_rows, new_cols, dtype=torch.long, device=self.device)
        mask[:r, :w] = self.mask[:r, :w]
        self.mask = mask

    def advance(self, columns: int) -> None:
        self.mask[: self.rows, self.width : self.width + columns] = 1
        self.width += columns


class KVBatch:
    """The left-padded KV cache and attention mask of the running batch."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.slab = KVSlab(model)
        self.lens: list[int] = []

    def __len__(self) -> int:
        return len(self.lens)

    @property
    def width(self) -> int:
        return self.slab.width

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
            s.mask[:n, shift:new_width] = s.mask[:n, :width].clone()
            s.mask[:n, :shift] = 0
        for j, (src, length) in enumerate(zip(sources, lens)):
            row, pad = n + j, new_width - length
            for dst, part in ((s.keys, src.keys), (s.values, src.values)):
                for buf, src_buf in zip(dst, part):
                    buf[row, :, pad:new_width] = src_buf[0, :, :length]
            s.mask[row, :pad] = 0
            s.mask[row, pad:new_width] = 1
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
            s.mask[: len(rows), :width] = s.mask[index, start : s.width]
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
    batch-invariant kernels (batch_invariant.py), whatever the decode attention backend says."""

    def __init__(
        self,
        model: PreTrainedModel,
        page_size: int,
        prefix_cache: PrefixCache | None,
        lora: LoraManager | None = None,
        decode_attention_backend: str = EngineConfig.decode_attention_backend,
        capture_routes: bool = False,
        deterministic: bool = False,
    ) -> None:
        if deterministic:
            make_batch_invariant(model)
        else:
            use_decode_attention(model, decode_attention_backend)
        self.model = model
        self.device = model.device
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.lora = lora
        self.capture = RouteCapture(model) if capture_routes else None
        self.decode_routes: torch.Tensor | None = None  # [rows, layers, top_k] of the last decode step

    def _adapters(self, adapters: list[str | None] | None) -> ContextManager[None]:
        return self.lora.rows(adapters) if self.lora is not None and adapters is not None else nullcontext()

    def flush_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def _hit_limit(self, n_ids: int, logits_from: int | None) -> int:
        """How much of a prompt may come from the cache: never its last token (its logits are
        needed), nor a position whose logits were asked for (`logits_from`)."""
        return min(n_ids - 1, n_ids if logits_from is None else logits_from)

    def cached_prefix(self, namespace: Hashable, input_ids: list[int], logits_from: int | None) -> int:
        """Tokens of this prompt that `prefill` would take from the cache now."""
        if self.prefix_cache is None:
            return 0
        return (
            len(self.prefix_cache.match(namespace, input_ids, self._hit_limit(len(input_ids), logits_from)))
            * self.page_size
        )

    @torch.inference_mode()
    def prefill(
        self, input_ids: list[int], logits_from: int | None, namespace: Hashable, adapter: str | None = None
    ) -> PrefillOutput:
        """KV of `input_ids` and the logits of positions `logits_from..` (None: the last only),
        and with capture the routes of every position.

        Cached whole pages are copied in; the rest runs one page per forward, and the whole
        pages computed go into the cache under `namespace`."""
        n, p = len(input_ids), self.page_size
        slab = KVSlab(self.model)
        slab.reserve(1, n, exact=True)
        slab.rows = 1
        pages = (
            self.prefix_cache.match(namespace, input_ids, self._hit_limit(n, logits_from)) if self.prefix_cache else []
        )
        for k, page in enumerate(pages):
            for i, (keys, values) in enumerate(zip(slab.keys, slab.values)):
                keys[0, :, k * p : (k + 1) * p] = page.kv[i, 0]
                values[0, :, k * p : (k + 1) * p] = page.kv[i, 1]
        slab.advance(len(pages) * p)
        first = n - 1 if logits_from is None else logits_from
        logits, routes = [], [page.routes for page in pages]
        for start in range(slab.width, n, p):
            end = min(start + p, n)
            keep = max(end - max(first, start), 0)
            with self._adapters([adapter]):
                out = self.model(
                    input_ids=torch.tensor([input_ids[start:end]], device=self.device),
                    position_ids=torch.arange(start, end, device=self.device).unsqueeze(0),
                    cache=slab.cache,
                    use_cache=True,
                    logits_to_keep=keep if keep else torch.empty(0, dtype=torch.long, device=self.device),
                )
            slab.advance(end - start)
            logits.append(out.logits[0].float())
            if self.capture is not None:
                routes.append(self.capture.take(end - start, self.device))
        rows = torch.cat(routes) if self.capture is not None else None
        if self.prefix_cache is not None:
            self.prefix_cache.insert(namespace, input_ids, n // p, lambda k: _page(slab, rows, k * p, (k + 1) * p))
        return PrefillOutput(slab=slab, logits=torch.cat(logits), cached_tokens=len(pages) * p, routes=rows)

    @torch.inference_mode()
    def decode(self, batch: KVBatch, tokens: list[int], adapters: list[str | None] | None = None) -> torch.Tensor:
        """Feed one token per row (row i with `adapters[i]`, all base when None); returns next-token logits [rows, vocab] in fp32."""
        s, device = batch.slab, self.device
        s.reserve(len(batch), s.width + 1)
        s.mask[: s.rows, s.width] = 1
        with self._adapters(adapters):
            out = self.model(
                input_ids=torch.tensor(tokens, device=device).unsqueeze(1),
                # 4D, so HF passes it through instead of building one per step (attention.py)
                attention_mask=s.mask[: s.rows, None, None, : s.width + 1].bool(),
                position_ids=torch.tensor(batch.lens, device=device).unsqueeze(1),
                cache=s.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        s.advance(1)
        batch.lens = [n + 1 for n in batch.lens]
        if self.capture is not None:
            self.decode_routes = self.capture.take(len(tokens), device)
        return out.logits[:, -1, :].float()


def _page(slab: KVSlab, routes: torch.Tensor | None, start: int, end: int) -> CachedPage:
    """Columns [start, end) of a one-row slab as one page (KV [layers, 2, kv_heads, page,
    head_dim]), with the routes of those positions."""
    kv = torch.stack([torch.stack([k[0, :, start:end], v[0, :, start:end]]) for k, v in zip(slab.keys, slab.values)])
    return CachedPage(kv, None if routes is None else routes[start:end].clone())
