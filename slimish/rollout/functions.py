"""The user's functions a rollout runs, loaded and checked once, at start-up, before any server
starts: `slimish train` and `slimish rollout` load them (a bad spec fails there, naming the key)
and hand the loaded objects to the manager, so what runs is what was checked.

The loader is handed down by the caller (slimish.plugins imports and checks each function; its
docstring lists every kind's shape). The run's start-up passes slimish.compat.load_function, which
also adapts `slime:` specs: the rollout side only ever sees plain slimish functions, and never
imports the floor above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slimish.plugins import Loader
    from slimish.rollout.config import RolloutConfig


@dataclass(frozen=True)
class RolloutFunctions:
    """`rollout.rollout_fn`, `reward_fn`, `filter_fn`, `sample_hook` and `reward_post_fn`, loaded
    (None where not set)."""

    rollout_fn: Callable[..., Any]
    reward_fn: Callable[..., Any] | None = None
    filter_fn: Callable[..., Any] | None = None
    sample_hook: Callable[..., Any] | None = None
    reward_post: Callable[..., Any] | None = None

    @classmethod
    def load(cls, cfg: RolloutConfig, load_function: Loader) -> RolloutFunctions:
        """Every function `cfg` names, loaded by `load_function` (the run's start-up passes
        slimish.compat's, which also adapts `slime:` specs); its `LoadError` names the config key
        and the fix."""

        def optional(key: str, kind: str) -> Callable[..., Any] | None:
            spec = getattr(cfg, key)
            return load_function(spec, kind) if spec else None

        return cls(
            load_function(cfg.rollout_fn, "rollout"),
            optional("reward_fn", "reward"),
            optional("filter_fn", "filter"),
            optional("sample_hook", "sample_hook"),
            optional("reward_post_fn", "reward_post"),
        )
