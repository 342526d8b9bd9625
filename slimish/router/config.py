"""The router's schema (`slimish router`, and the router inside `slimish serve`)."""

from __future__ import annotations

from dataclasses import dataclass

from slimish.net import FD_DOC
from slimish.schema import at_least, doc, doc_factory, one_of

POLICIES = ("least_inflight", "round_robin", "cache_aware", "session")
# Help shared by a group of fields.
KEYS_DOC = (
    "Security. With no keys set nothing is checked (like SGLang). `admin_api_key` falls back to `api_key`, so "
    "setting only `--api-key` does not leave worker management open. The router sends `api_key` to its workers on "
    "every call (as sglang-router its `--api-key`), so keyed engines take the same key."
)
CONCURRENCY_DOC = (
    "Serving requests in flight (streams until their end) before the next gets a 429 with `Retry-After: "
    "retry_after_s`. Health, metrics and admin routes are never refused."
)
UPSTREAM_DOC = (
    "Upstream. A non-streamed request must finish within `request_timeout`; a stream may run longer but no single "
    "wait for the next chunk may exceed it. 1800 s as sglang-router."
)
HEALTH_DOC = (
    "Health checks: `GET <worker>/health`. A worker is marked unhealthy after `health_failure_threshold` failed "
    "checks in a row (at once when a connection is refused) and healthy again on the first good check."
)
CACHE_AWARE_DOC = (
    "cache_aware (defaults as sglang-router's): route to the worker that holds the longest cached prefix when at "
    "least `cache_threshold` of the prompt matches, unless the load is unbalanced: max - min > "
    "balance_abs_threshold and max > balance_rel_threshold * min."
)


@dataclass
class RouterConfig:
    """The router (`slimish router`, and the router inside `slimish serve`)."""

    worker_urls: list[str] = doc_factory(list, "engines to route to (more via POST /workers)")
    host: str = doc("127.0.0.1", "loopback unless told otherwise")
    port: int = 30000
    fd: int | None = doc(None, FD_DOC)
    policy: str = doc("least_inflight", "least_inflight | round_robin | cache_aware | session")
    log_level: str = "warning"
    processes: int = doc(
        1,
        "Router processes sharing `port` (SO_REUSEPORT): 1 is one process, one event loop. More scale throughput; with "
        "N > 1 `session` and `cache_aware` pick by rendezvous hashing so every process agrees, and in-flight counts "
        "are per process (slimish/router/scaleout.py).",
    )
    api_key: str | None = doc(None, KEYS_DOC)
    admin_api_key: str | None = doc(None, KEYS_DOC)
    max_body_bytes: int = doc(32 << 20, "a batch of long `input_ids` prompts is a few MiB")
    max_new_tokens_cap: int | None = doc(None, "None: the engines' own limits apply")
    max_prompt_tokens: int | None = doc(
        None,
        "`input_ids` prompts longer than this are refused (text prompts are counted by the engines: the router does "
        "not tokenize). None: the engines' own limits apply.",
    )
    max_concurrent_requests: int = doc(4096, CONCURRENCY_DOC)
    retry_after_s: int = doc(1, CONCURRENCY_DOC)
    request_timeout: float = doc(1800.0, UPSTREAM_DOC)
    connect_timeout: float = doc(5.0, UPSTREAM_DOC)
    max_retries: int = doc(2, "extra attempts, each on another worker where one is left")
    keepalive_timeout: float = doc(
        4.0,
        "Below uvicorn's 5 s keep-alive, so the router rarely reuses a socket the engine closed.",
    )
    health_check_interval: float = doc(5.0, HEALTH_DOC)
    health_check_timeout: float = doc(5.0, HEALTH_DOC)
    health_failure_threshold: int = doc(3, HEALTH_DOC)
    join_check_interval: float = doc(
        0.5,
        "A worker added to a running fleet takes traffic once its `/model_info` weight_version is the fleet's; "
        "checked this often until then (docs/elastic.md).",
    )
    cache_threshold: float = doc(0.3, CACHE_AWARE_DOC)
    balance_abs_threshold: int = doc(64, CACHE_AWARE_DOC)
    balance_rel_threshold: float = doc(1.5, CACHE_AWARE_DOC)
    cache_block_size: int = doc(16, "tokens per hashed block; text blocks are 4x as many chars")
    cache_max_blocks: int = doc(1 << 18, "LRU bound on remembered prefix blocks")
    max_sessions: int = doc(1 << 16, "LRU bound on remembered session pins")

    def __post_init__(self) -> None:
        one_of("policy", self.policy, POLICIES)
        for name in (
            "request_timeout",
            "connect_timeout",
            "health_check_interval",
            "health_check_timeout",
            "join_check_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        at_least(0, self, "", "max_retries")
        at_least(
            1,
            self,
            "",
            "max_new_tokens_cap",
            "max_prompt_tokens",
            "max_body_bytes",
            "max_concurrent_requests",
            "retry_after_s",
            "health_failure_threshold",
            "processes",
        )
        if self.fd is not None and self.processes > 1:
            raise ValueError(f"fd: one router process serves an inherited socket; processes={self.processes} bind port")
