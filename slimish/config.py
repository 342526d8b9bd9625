"""Configuration schemas: every default of slimish lives here, and only here.

Each schema is a dataclass that OmegaConf validates (types, missing values). The command line is
generated from the schema (`--max-running-requests 8` for `max_running_requests`), so a flag and
its default cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


@dataclass
class EngineConfig:
    """The built-in engine (`slimish engine`)."""

    model: str = MISSING  # HF model directory (config, weights, tokenizer)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 30000  # SGLang's default; always pass one explicitly when several servers run
    max_running_requests: int = 32  # rows in the running batch
    max_prefill_tokens: int = 4096  # prompt tokens prefilled per scheduler step (decode is never starved)
    context_length: int | None = None  # default: the model's max_position_embeddings
    dtype: str = "float32"  # fp32 on CPU: bf16 is 12-18x slower there (notes/cpu-runtime.md)
    served_model_name: str | None = None  # default: the model path
    api_key: str | None = None  # Bearer key for every route except health and metrics
    admin_api_key: str | None = None  # Bearer key for weight and control routes (default: api_key)
    weight_sync_timeout_s: int = 600  # a trainer gone mid-broadcast frees the engine after this
    stream_interval: int = 1  # decode steps between streamed chunks
    seed: int = 0  # torch seed for requests without `sampling_seed`
    log_level: str = "warning"


POLICIES = ("least_inflight", "round_robin", "cache_aware", "session")


@dataclass
class RouterConfig:
    """The router (`slimish router`, and the router inside `slimish serve`)."""

    worker_urls: list[str] = field(default_factory=list)  # engines to route to (more via POST /workers)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 30000
    policy: str = "least_inflight"  # least_inflight | round_robin | cache_aware | session
    log_level: str = "warning"
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


@dataclass
class ServeConfig:
    """`slimish serve`: built-in engines plus a router on this machine (router flags: RouterConfig)."""

    model: str = MISSING  # HF model directory the engines serve
    engines: int = 1
    engine_flag: list[str] = field(default_factory=list)  # NAME=VALUE, passed to every engine as --NAME VALUE
    log_dir: str | None = None  # engine logs; default: a new temporary directory
    engine_start_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")


def add_config_arguments(parser: argparse.ArgumentParser, schema: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per schema field, default and type taken from the schema; lists take N values."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name in skip:
            continue
        hint = hints[f.name]
        is_list = typing.get_origin(hint) is list
        kind = typing.get_args(hint)[0] if is_list else _scalar(hint)
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None if f.default is MISSING else f.default
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=kind, default=default, required=f.default is MISSING,
            nargs="*" if is_list else None, help=f"(default: {default})",
        )  # fmt: skip


def config_from_args(schema: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Validate the parsed flags through OmegaConf; returns a schema instance."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(schema) if hasattr(args, f.name)}
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), values, overrides)
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except (ValueError, OmegaConfBaseException) as exc:
        raise SystemExit(f"bad {schema.__name__}: {exc}") from None


def _scalar(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
