"""Weight sync of a colocated run (`launch.colocate`, docs/colocate.md): the trainer's parameters
and every engine's are views of one shared store (slimish/colocate.py), so the optimiser's step has
already written the weights the engines serve. A push moves no bytes:

    /resume_memory_occupation (the KV cache) -> version flip (/update_weight_version)

SGLang's own routes, on every engine at once. In sync mode nothing is paused: the engines are idle
between the rollout and the push, and their KV cache is released meanwhile (`release`: it frees
the prefix cache too), so the trainer has that memory while it trains. The first push (nothing
ran before it) flips the version and flushes the cache (/flush_cache) instead. The push first
checks that what the trainer exports lies in the store (a copy would mean the engines do not serve
it), and `connect` that every engine maps this store.

In async mode the engines generate while the trainer trains, so the optimiser's step, the only
write into the store, must not run under a forward: the trainer calls `hold` before its first
optimiser step of an RL step (`Trainer.before_weight_write`), which pauses generation on every
engine (/pause_generation with `weight_sync.pause_mode`; it returns between two engine steps, so
no forward is running); the push then flips the version and continues (/continue_generation).
Every token is sampled either before the hold, from the old weights and labelled the old
version, or after the continue, labelled the new one: a sample spanning versions records both,
as in an async broadcast run. The KV cache is not released in async mode (the engines keep it
for the requests in flight); the version flip keeps KV made by the old weights out of the
prefix cache's matches (its namespace is the weight version), so nothing is flushed either.

With `trainer.lora` the base weights are shared the same way (the trainer maps them before its
adapter is added; they never change), and so is the adapter: the trainer's adapter parameters are
views of a second store (`Backend.adapter_store`), which the first push loads on every engine as
the adapter's directory (`/load_lora_adapter`: the engine maps its tensors). The engine serves an
adapter from its batch slots, padded and scaled copies (slimish/engine/lora.py), so a later push
is `/update_weight_version` with `lora_name`: every engine copies the adapter's tensors into its
slot and versions it; no byte crosses a socket. In async mode generation is held for each step's
optimiser writes as for the whole policy (a slot taken meanwhile would copy half-written tensors).
An adapter whose exported tensors are not whole parameters (a MoE model's per-expert form) has no
store and is broadcast as in any run (`WeightSync`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from slimish.colocate import WeightStore
from slimish.protocol import wire_version
from slimish.trainer.backend import WeightExport
from slimish.trainer.engine_control import WeightSyncError
from slimish.trainer.lora import ADAPTER_CONFIG
from slimish.trainer.weight_sync import WeightSync, timings


class ColocatedSync:
    """`WeightSync`'s interface (connect, push, close, urls) for engines that map `store`; `sync`,
    the run's `WeightSync` to them, carries its calls and its adapter pushes."""

    def __init__(self, store: WeightStore, sync: WeightSync) -> None:
        self.store, self.sync = store, sync
        self.urls, self.engines = sync.urls, sync.engines
        self.released = False
        self.held: float | None = None  # since when generation is paused for the optimiser (async mode)
        self.pushed = False
        self.adapter_store: WeightStore | None = None  # the trainer's shared adapter, once a push loaded it

    def connect(self) -> None:
        """Checks that every engine maps this store (`--shared-weights`). A broadcast adapter's
        group is formed by its first push (a shared one needs none)."""
        infos = self.engines.all(lambda c: c.server_info())
        wrong = {
            url: info.get("shared_weights")
            for url, info in zip(self.urls, infos)
            if info.get("shared_weights") is None or Path(info["shared_weights"]) != self.store.path
        }
        if wrong:
            raise WeightSyncError(
                f"launch.colocate: engines {wrong} do not map the run's weight store {self.store.path} "
                "(their --shared-weights); a colocated push reaches only engines that do"
            )

    def close(self) -> None:
        self.sync.close()

    def release(self) -> None:
        """The engines' KV cache freed while the trainer trains; the next push takes it back."""
        self._memory("/release_memory_occupation")
        self.released = True

    def hold(self) -> None:
        """Async mode, before an optimiser step writes the store: generation paused on every
        engine (once per RL step) until the push continues it. A broadcast adapter's store is never
        written (its own push pauses), so nothing is held."""
        if self.held is not None or (self.sync.adapter is not None and self.adapter_store is None):
            return
        mode = self.sync.cfg.pause_mode
        self.engines.pause(mode, begin=mode == "drain")  # drain: the session's wait is the drain
        self.held = time.perf_counter()

    def push(self, export: WeightExport, version: int) -> dict[str, float]:
        """Every engine serves the trainer's current parameters (or adapter) as `version`;
        `WeightSync.push`'s timings, `bytes` 0 for the shared weights, and `paused`, how long
        generation was held for the trainer (async mode; 0 otherwise)."""
        wire_version(version)
        started, released, first = time.perf_counter(), self.released, not self.pushed
        if released:
            self._memory("/resume_memory_occupation")
            self.released = False
        if export.adapter_config is not None and export.shared is None:  # broadcast: nothing was held
            self.sync.connect()
            return {**self.sync.push(export, version), "paused": 0.0}
        store = self.store if export.shared is None else export.shared
        copies = [name for name, t in export.tensors if not store.holds(t)]
        if copies:
            raise WeightSyncError(
                f"push: {len(copies)} exported tensors (e.g. {copies[0]!r}) are not in the weight store "
                f"{store.path}: the trainer's parameters must be views of it (WeightStore.attach)"
            )
        held, self.held = self.held, None
        try:
            if export.adapter_config is None:
                self.engines.set_version(version)
            else:
                self._flip_adapter(export.shared, export.adapter_config, version)
        finally:
            if held is not None:  # the optimiser step is done: generation goes on, on the new version
                self.engines.resume(end=self.sync.cfg.pause_mode == "drain", resume=True)
        self.pushed = True
        if first and not released:  # nothing has run yet: a cache made by no one's weights
            self.engines.all(lambda c: c.flush_cache())
        ended = time.perf_counter()
        return {**timings(ended - started, 0.0, 0, 0), "paused": 0.0 if held is None else ended - held}

    def _flip_adapter(self, store: WeightStore, config: dict[str, Any], version: int) -> None:
        """The run's adapter is `store`'s tensors as `version` on every engine: loaded from the
        store's directory the first time, its slots refreshed afterwards."""
        name = self.sync.adapter
        assert name is not None
        if self.adapter_store is None:
            (store.path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
            self.engines.load_adapter(name, store.path, version)
            self.adapter_store = store
        else:
            self.engines.set_version(version, adapter=name)

    def _memory(self, route: str) -> None:
        """`route` for the KV cache on every engine; SGLang replies null (a refusal is an error)."""
        self.engines.all(lambda c: c.request("POST", route, {"tags": ["kv_cache"]}))
