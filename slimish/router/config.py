"""The router's settings and their defaults: the one place they live (the CLI reads them here)."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("least_inflight", "round_robin", "cache_aware", "session")


@dataclass
class RouterConfig:
    worker_urls: list[str] = field(default_factory=list)
    policy: str = "least_inflight"
    # Security. With no keys set nothing is checked (like SGLang). `admin_key` falls back to
    # `api_key`, so setting only `--api-key` does not leave worker management open.
    api_key: str | None = None
    admin_key: str | None = None
    max_body_bytes: int = 32 << 20  # a batch of long `input_ids` prompts is a few MiB
    max_new_tokens_cap: int | None = None  # None: the engines' own limits apply
    # Upstream. A non-streamed request must finish within `request_timeout`; a stream may run
    # longer but no single wait for the next chunk may exceed it. 1800 s as sglang-router.
    request_timeout: float = 1800.0
    connect_timeout: float = 5.0
    max_retries: int = 2  # extra attempts, each on another worker where one is left
    # Below uvicorn's 5 s keep-alive, so the router rarely reuses a socket the engine closed.
    keepalive_timeout: float = 4.0
    # Health checks: `GET <worker>/health`. A worker is marked unhealthy after
    # `health_failure_threshold` failed checks in a row (at once when a connection is refused)
    # and healthy again on the first good check.
    health_check_interval: float = 5.0
    health_check_timeout: float = 5.0
    health_failure_threshold: int = 3
    # cache_aware (defaults as sglang-router's): route to the worker that holds the longest
    # cached prefix when at least `cache_threshold` of the prompt matches, unless the load is
    # unbalanced: max - min > balance_abs_threshold and max > balance_rel_threshold * min.
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    cache_block_size: int = 16  # tokens per hashed block; text blocks are 4x as many chars
    cache_max_blocks: int = 1 << 18  # LRU bound on remembered prefix blocks
    max_sessions: int = 1 << 16  # LRU bound on remembered session pins

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("request_timeout", "connect_timeout", "health_check_interval", "health_check_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.max_new_tokens_cap is not None and self.max_new_tokens_cap < 1:
            raise ValueError(f"max_new_tokens_cap must be >= 1, got {self.max_new_tokens_cap}")
        if self.health_failure_threshold < 1:
            raise ValueError(f"health_failure_threshold must be >= 1, got {self.health_failure_threshold}")
