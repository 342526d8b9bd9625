"""The trainer's control of the engines it pushes into: every call made to all engines at once.

Weight sync (weight_sync.py) moves the tensors; this is the HTTP around them: forming and
destroying the weight-update group, pausing and continuing generation, weight-update sessions,
loading a run's adapter through the router, and setting or checking versions. The trainer is sync
code; the HTTP side is the async `Client`, run on a private event-loop thread, so the calls to all
engines are in flight together (while the trainer's thread broadcasts, or joins the group).

Weight versions are ints here as everywhere in slimish; `wire_version` writes them as SGLang's
routes carry them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from slimish.client import Client, ServerError
from slimish.distributed import ProcessGroup, init_custom_process_group, master_store
from slimish.loop_thread import LoopThread
from slimish.protocol import InitWeightsUpdateGroupReq, wire_version

T = TypeVar("T")


class WeightSyncError(RuntimeError):
    pass


def in_thread(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """`fn(*args)` on a daemon thread: one left blocked in a rendezvous must not hold up exit."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="weight-sync-join", daemon=True).start()
    return future


class EngineControl:
    """One client per engine (and one for the router, which fans adapter loads out), each call
    made on every engine at once and its failures raised as one `WeightSyncError`."""

    def __init__(self, urls: list[str], api_key: str | None, timeout: float, router_url: str | None = None) -> None:
        self.urls = urls
        self.timeout = timeout
        self._loop = LoopThread("weight-sync-http")
        self.clients = [Client(u, api_key=api_key, timeout=timeout) for u in urls]
        self.router = Client(router_url, api_key=api_key, timeout=timeout) if router_url else None
        self.sessions: bool | None = None  # engines have begin/end_weight_update; None until probed
        self.adapter_versions: bool | None = None  # engines version each adapter; None until probed

    # -- calls on every engine ---------------------------------------------------------------

    def start(self, call: Callable[[Client, Any], Any], args: list[Any]) -> concurrent.futures.Future:
        """`call(client, arg)` on every engine at once; the future holds their results in order."""

        async def gather() -> list[Any]:
            return await asyncio.gather(*(call(c, a) for c, a in zip(self.clients, args)), return_exceptions=True)

        return self._loop.submit(gather())

    def wait(self, future: concurrent.futures.Future) -> list[Any]:
        results = future.result(timeout=self.timeout)
        failed = [(url, r) for url, r in zip(self.urls, results) if isinstance(r, BaseException)]
        if failed:
            raise WeightSyncError("; ".join(f"{url}: {exc}" for url, exc in failed)) from failed[0][1]
        return results

    def all(self, call: Callable[[Client], Any]) -> list[Any]:
        return self.wait(self.start(lambda c, _: call(c), [None] * len(self.clients)))

    def check(self, results: list[Any], route: str) -> None:
        bad = [(url, r.message) for url, r in zip(self.urls, results) if not r.success]
        if bad:
            raise WeightSyncError(f"{route} failed: " + "; ".join(f"{url}: {msg}" for url, msg in bad))

    # -- the weight-update group ----------------------------------------------------------------

    def form_group(self, master_address: str, group_name: str, backend: str) -> ProcessGroup:
        """One process group with every engine: this process is rank 0, engine e's TP ranks follow;
        blocks until all joined."""
        infos = self.all(lambda c: c.server_info())
        for url, info in zip(self.urls, infos):
            # SGLang's update group holds one replica's one stage: an engine's ranks are rank_offset
            # + tp_rank, and it asserts dp_size == 1 (sglang 0.5.23:
            # python/sglang/srt/model_executor/model_runner_components/weight_updater.py:124,
            # python/sglang/srt/managers/tokenizer_control_mixin.py:451).
            sizes = {key: int(info.get(key) or 1) for key in ("dp_size", "pp_size")}
            if any(size != 1 for size in sizes.values()):
                raise WeightSyncError(
                    f"{url}: {', '.join(f'{k}={v}' for k, v in sizes.items() if v != 1)}: a weight-update "
                    "group reaches one data-parallel replica of one pipeline stage; start engines with "
                    "dp_size=1 and pp_size=1 (more engines instead of data parallelism), or use "
                    "weight_sync.transport=disk"
                )
        tp = [int(info.get("tp_size", 1)) for info in infos]
        world = 1 + sum(tp)
        timeout = timedelta(seconds=self.timeout)
        store = master_store(master_address, world, timeout)
        reqs = [
            InitWeightsUpdateGroupReq(
                master_address=master_address,
                master_port=store.port,
                rank_offset=1 + sum(tp[:e]),
                world_size=world,
                group_name=group_name,
                backend=backend,
            )
            for e in range(len(tp))
        ]
        # The engines block in their init until rank 0 joins, so join while their calls are in
        # flight; on a thread, so that an engine refusing at once fails this at once.
        joined = self.start(lambda c, r: c.init_weights_update_group(r), reqs)
        group = in_thread(init_custom_process_group, backend, store, world, 0, group_name, timeout)
        self.check(self.wait(joined), "/init_weights_update_group")
        return group.result(timeout=self.timeout)

    def destroy_group(self, group_name: str) -> None:
        """The group gone on every engine; an engine that is gone has no group left to destroy."""
        try:
            self.all(lambda c: c.destroy_weights_update_group(group_name))
        except Exception:
            pass

    def close(self) -> None:
        try:
            self.wait(self.start(lambda c, _: c.close(), [None] * len(self.clients)))
            if self.router is not None:
                self._loop.submit(self.router.close()).result(timeout=self.timeout)
        finally:
            self._loop.close()

    # -- a push's frame ------------------------------------------------------------------------

    def pause(self, mode: str, begin: bool) -> None:
        """Pause, then open a weight-update session when `begin` (under `drain` the other way
        round: weight_sync.py's docstring), on every engine at once; the first session opened
        finds out whether the engines have sessions."""

        async def prepare(c: Client) -> bool | None:
            if mode != "drain":
                await c.pause(mode)
            opened = await c.begin_weight_update() if begin else None
            if mode == "drain" and opened:
                await c.pause("retract")  # drained: generation waits for the push from here on
            return opened

        opened = self.all(prepare)
        if begin and self.sessions is None:
            if len(set(opened)) != 1:
                raise WeightSyncError(
                    f"engines disagree on /begin_weight_update support: {dict(zip(self.urls, opened))}"
                )
            self.sessions = opened[0]
        if begin and mode == "drain" and not self.sessions:
            raise WeightSyncError(
                "weight_sync.pause_mode=drain: the engines have no /begin_weight_update (SGLang before 0.5.23), "
                "whose wait for the running requests is the drain; use retract"
            )

    def resume(self, end: bool, resume: bool) -> None:
        """Close the session (`end`: it is per engine, not per group), then continue generation,
        on every engine at once (a continue first would let end wait for every generation it
        resumed). Generation continues even if the end failed. When an error is already on its
        way out, a failure here does not replace it."""

        async def finish(c: Client) -> None:
            try:
                closed = await c.end_weight_update() if end else None
            finally:
                if resume:
                    await c.resume()
            if closed is not None and not closed.success:
                raise WeightSyncError(f"/end_weight_update failed: {closed.message}")

        if sys.exc_info()[1] is None:
            self.all(finish)
            return
        try:
            self.all(finish)
        except Exception:
            pass

    # -- versions and adapters -----------------------------------------------------------------

    def set_version(self, version: int, adapter: str | None = None) -> None:
        """Every engine reports `version` (for its base and every adapter, or for `adapter` alone,
        its slots refreshed from its tensors) from now on."""
        new = wire_version(version)
        self.check(
            self.all(lambda c: c.update_weight_version(new, abort_all_requests=False, lora_name=adapter)),
            "/update_weight_version",
        )

    def versions_each_adapter(self) -> bool:
        """Whether the engines version each adapter (slimish's `/get_weight_version` and
        `lora_name` on a broadcast) rather than only the whole server, as SGLang 0.5.23 does
        (it has no such route: 404). Asked once."""
        if self.adapter_versions is None:

            async def probe(c: Client) -> bool:
                try:
                    await c.get_weight_version()
                except ServerError as exc:
                    if exc.status == 404:
                        return False
                    raise
                return True

            found = self.all(probe)
            if len(set(found)) != 1:
                raise WeightSyncError(f"engines disagree on /get_weight_version support: {dict(zip(self.urls, found))}")
            self.adapter_versions = found[0]
        return self.adapter_versions

    def load_adapter(self, name: str, path: Path, version: int | None) -> None:
        """Create adapter `name` from the directory `path` on every engine (the router fans the
        calls out): unloaded first, so that a restarted run or a disk push replaces it. A disk
        push versions it with `weight_version` on the load (a slimish extension: the load is its
        only call), checked on every engine."""
        assert self.router is not None
        router, wire = self.router, None if version is None else wire_version(version)

        async def reload() -> None:
            try:
                await router.unload_lora_adapter(name)
            except ServerError:  # not loaded yet: the usual first push
                pass
            await router.load_lora_adapter(name, str(path), weight_version=wire)

        try:
            self._loop.submit(reload()).result(timeout=self.timeout)
        except ServerError as exc:
            raise WeightSyncError(f"/load_lora_adapter {name!r} from {path} failed: {exc.message}") from exc
        if wire is not None:
            served = self.all(lambda c: c.get_weight_version(name))
            if any(v != wire for v in served):
                raise WeightSyncError(
                    f"adapter {name!r} loaded from disk as version {version}, but the engines report "
                    f"{dict(zip(self.urls, served))}: they ignore `weight_version` on /load_lora_adapter "
                    "(a slimish extension; SGLang engines need the broadcast push)"
                )
