"""An engine fleet that grows and shrinks while a run trains.

The router's registry is the fleet: engines join it (`POST /workers`, `/add_worker`, a launcher)
and leave it (`DELETE /workers/<id>`, or by dying) whenever they like. The
weight-update group, formed once per `WeightSync`, is not: every member must take part in every
broadcast, so a member gone makes the next push wait for it, and a newcomer outside it never gets
weights. So at each push the trainer reads the fleet (`Fleet.before_push`) and, if it is no longer the
group's, forms a new group over it before pushing: newcomers get the whole policy (or the run's
adapter) with that push, the gone are dropped. One path for every change: an engine of ours that
died is restarted first (`Servers.restart_dead`) and is simply part of the fleet read after; an
engine from outside that died is not restarted, only left out.

Until that push a newcomer must serve nothing: the router holds a worker that joins a running
fleet out of rotation until its `/model_info` weight_version equals the fleet's
(slimish/router/workers.py). That gate is the router's, so it holds for SGLang engines as for
ours. Requests in flight on an engine that dies are retried by the router on another
(slimish/router/proxy.py); an engine removed from the registry finishes what it has.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from slimish.launch.local import Servers
from slimish.launch.workers import existing_engine_urls

if TYPE_CHECKING:
    from slimish.launch.config import LaunchConfig

PROBE_TIMEOUT_S = 5.0  # an engine that cannot answer /model_info in this long is left out of the push


def fleet_urls(http: httpx.Client, router_url: str, own: list[str], skip_model: str | None = None) -> list[str]:
    """The engines the next push goes to: the run's own engines (`own`, alive: restart_dead ran
    just before), then the router's other workers, less those registered under `skip_model` (the
    teacher's), that answer `/model_info` now. Not the router's health view: an engine started
    with `--await-weights` fails `/health` until a push has set its weights, and one that died
    since its last health check must not stall the group's forming. `[router_url]` when it is an
    engine, not a router. `http`: a `key_client` with the run's key, as the router's admin routes
    and the engines' `/model_info` are keyed routes in a keyed run (a probe without it would find
    no engine alive)."""
    own = [u.rstrip("/") for u in own]
    others = [u.rstrip("/") for u in existing_engine_urls(http, router_url, skip_model)]
    others = [u for u in others if u not in own]
    with ThreadPoolExecutor(max_workers=max(1, len(others))) as pool:
        alive = list(pool.map(lambda url: _answers(http, url), others))
    return own + [u for u, up in zip(others, alive) if up]


def _answers(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url + "/model_info", timeout=PROBE_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Fleet:
    """The engines the next push goes to (`before_push`), against the weight-update group's."""

    urls: list[str]
    restarted: list[str]  # the run's own engines that had exited, started again
    joined: list[str]  # in the fleet, not in the group
    left: list[str]  # in the group, not in the fleet
    outsiders: list[str]  # the joined that are not the run's own: the router holds them until the push

    @classmethod
    def before_push(
        cls, servers: Servers, group: list[str], launch: LaunchConfig, await_weights: bool, http: httpx.Client
    ) -> Fleet:
        """The run's dead engines restarted (`Servers.restart_dead`), then the fleet read over
        `http` (the run's `key_client`: one for every push)."""
        restarted = servers.restart_dead(launch.start_timeout, await_weights=await_weights)
        own = servers.own_urls()
        urls = fleet_urls(http, servers.router_url, own, launch.teacher.served_name)
        joined = [u for u in urls if u not in group]
        return cls(urls, restarted, joined, [u for u in group if u not in urls], [u for u in joined if u not in own])

    @property
    def changed(self) -> bool:
        """Whether the group must be formed again: a restarted engine lost its place in it too."""
        return bool(self.restarted or self.joined or self.left)

    def news(self, version: int) -> list[str]:
        """What changed, for the run's log."""
        lines = []
        if self.restarted:
            lines.append(
                f"engines {', '.join(self.restarted)} had exited: restarted, they serve from version {version} on"
            )
        said = [f"{', '.join(u)} {what}" for u, what in ((self.joined, "joined"), (self.left, "left")) if u]
        if said:
            lines.append(
                f"engine fleet changed ({'; '.join(said)}): {len(self.urls)} engines from version {version} on"
            )
        return lines

    def admitted(self, http: httpx.Client, router_url: str, timeout: float) -> list[str]:
        """Waits (up to `timeout` s) until the router routes to every outsider: healthy, no longer
        joining. Those the push just brought the fleet's weights take load from the next request
        on, not from the router's next check. Returns those it still holds then."""
        deadline = time.monotonic() + timeout
        while self.outsiders:
            r = http.get(router_url.rstrip("/") + "/workers")
            r.raise_for_status()
            routed = {w["url"] for w in r.json()["workers"] if w["is_healthy"] and not w.get("joining")}
            held = [u for u in self.outsiders if u not in routed]
            if not held or time.monotonic() > deadline:
                return held
            time.sleep(0.05)  # polling the router's view, bounded by the deadline
        return []
