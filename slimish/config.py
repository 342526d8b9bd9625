"""Configuration schemas: every default of slimish lives here, and only here.

Each schema is a dataclass that OmegaConf validates (types, missing values). The command line is
generated from the schema (`--max-running-requests 8` for `max_running_requests`), so a flag and
its default cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

from omegaconf import MISSING, OmegaConf

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


def add_config_arguments(parser: argparse.ArgumentParser, schema: type, positional: tuple[str, ...] = ()) -> None:
    """One flag per schema field, default and type taken from the schema."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = _scalar(hints[f.name])
        if f.name in positional:
            parser.add_argument(f.name, type=kind)
            continue
        flag = "--" + f.name.replace("_", "-")
        required = f.default is MISSING
        default = None if required else f.default
        parser.add_argument(flag, type=kind, default=default, required=required, help=f"(default: {default})")


def config_from_args(schema: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Validate the parsed flags through OmegaConf; returns a schema instance."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(schema) if hasattr(args, f.name)}
    cfg = OmegaConf.merge(OmegaConf.structured(schema), values, overrides)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _scalar(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
