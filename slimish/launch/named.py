"""Engines behind another run's router by name: sglang-router 0.3's `POST /workers {"url",
"model_id"}`, which the slimish router serves as named workers (only requests whose `model`
names them reach them; admin fan-outs, so weight pushes, skip them). On-policy distillation's
teacher uses it to share the policy's router (`launch.teacher.served_name`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from slimish.launch.local import admin_headers


def named_workers(router_url: str, name: str, api_key: str | None = None) -> dict[str, dict]:
    """The router's workers registered under `name` (`GET /workers`), by URL."""
    with _admin_client(router_url, api_key) as http:
        return _named(http, name)


def _admin_client(router_url: str, api_key: str | None) -> httpx.Client:
    return httpx.Client(base_url=router_url.rstrip("/"), headers=admin_headers(api_key), timeout=10.0)


def _named(http: httpx.Client, name: str) -> dict[str, dict]:
    r = http.get("/workers")
    r.raise_for_status()
    return {w["url"].rstrip("/"): w for w in r.json()["workers"] if w.get("model_id") == name}


@contextmanager
def registered(router_url: str, urls: list[str], name: str, api_key: str | None, timeout: float) -> Iterator[None]:
    """`urls` registered on the router under `name` and healthy there (within `timeout` s) for
    the block; removed from it when the block ends, so a router that outlives the run keeps no
    dead teacher."""
    with _admin_client(router_url, api_key) as http:  # one client for the polls: each new one builds an SSL context
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
                _named(http, name).get(u, {}).get("is_healthy") for u in urls
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
