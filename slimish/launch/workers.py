"""A router's worker list, read and changed through its admin routes (sglang-router 0.3's
`GET /list_workers`, `GET|POST /workers`, `DELETE /workers/<id>`, which the slimish router serves
as well): the engines behind a run's existing router, a relaunched engine swapped in for a dead
one, and engines behind another run's router by name. Named workers (`POST /workers {"url",
"model_id"}`) get only requests whose `model` names them (admin fan-outs, so weight pushes, skip
them); on-policy distillation's teacher uses them to share the policy's router
(`launch.teacher.served_name`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from slimish.protocol import auth_headers


def key_client(api_key: str | None, base_url: str = "") -> httpx.Client:
    """A client for a run's calls to its router's admin routes and to its engines, carrying the
    run's key (launch.api_key is both the router's and the engines'). Reuse one where calls
    repeat: each new httpx client builds an SSL context (~23 ms of CPU)."""
    return httpx.Client(base_url=base_url.rstrip("/"), headers=auth_headers(api_key), timeout=10.0)


def existing_engine_urls(http: httpx.Client, url: str, skip_model: str | None = None) -> list[str]:
    """A router's workers (`GET /list_workers`) less those registered under `skip_model` (the
    teacher's, never pushed to), or `[url]` when `url` is an engine itself."""
    r = http.get(url.rstrip("/") + "/list_workers")
    if r.status_code == 404:
        return [url.rstrip("/")]
    r.raise_for_status()
    skipped = _named(http, url, skip_model) if skip_model is not None else {}
    return [u for u in r.json()["urls"] if u.rstrip("/") not in skipped]


def replace_worker(router_url: str, old: str | None, new: str, api_key: str | None = None) -> None:
    """Swap `old` for `new` in a router's worker list with the sglang-router 0.3 registry routes
    (`GET|POST /workers`, `DELETE /workers/<id>`), which the slimish router serves as well."""
    with key_client(api_key, router_url) as http:
        listed = http.get("/workers")
        listed.raise_for_status()
        ids = {w["url"].rstrip("/"): w["id"] for w in listed.json()["workers"]}
        old, new = (old or "").rstrip("/"), new.rstrip("/")
        if old in ids and old != new:
            http.delete(f"/workers/{ids[old]}").raise_for_status()
        if new not in ids:  # one still listed comes back by the router's health checks
            http.post("/workers", json={"url": new}).raise_for_status()


def named_workers(router_url: str, name: str, api_key: str | None = None) -> dict[str, dict]:
    """The router's workers registered under `name` (`GET /workers`), by URL."""
    with key_client(api_key) as http:
        return _named(http, router_url, name)


def _named(http: httpx.Client, router_url: str, name: str) -> dict[str, dict]:
    r = http.get(router_url.rstrip("/") + "/workers")
    r.raise_for_status()
    return {w["url"].rstrip("/"): w for w in r.json()["workers"] if w.get("model_id") == name}


@contextmanager
def registered(router_url: str, urls: list[str], name: str, api_key: str | None, timeout: float) -> Iterator[None]:
    """`urls` registered on the router under `name` and healthy there (within `timeout` s) for
    the block; removed from it when the block ends, so a router that outlives the run keeps no
    dead teacher."""
    with key_client(api_key, router_url) as http:  # one client for the polls: each new one builds an SSL context
        ids = []
        try:
            for url in urls:
                r = http.post("/workers", json={"url": url, "model_id": name})
                if r.status_code != 202:
                    raise RuntimeError(
                        f"launch.teacher.served_name: {router_url} refused worker {url} as {name!r}: {r.status_code} {r.text}"
                    )
                ids.append(r.json()["worker_id"])
            deadline = time.monotonic() + timeout
            while not all(
                _named(http, router_url, name).get(u, {}).get("is_healthy") for u in urls
            ):  # ours only: a stale one may be down
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"launch.teacher.served_name: {urls} not healthy on {router_url} within {timeout:g} s"
                    )
                time.sleep(0.1)  # polling the router's health view, bounded by the deadline
            yield
        finally:
            for worker_id in ids:
                http.delete(f"/workers/{worker_id}")
