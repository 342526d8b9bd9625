"""Adapters that run functions written for other RL frameworks unchanged (`slimish.compat.slime`).

`load_function` is the loader for whoever loads the run's user functions (`slimish train`'s
start-up, `slimish rollout`): slimish.plugins' checks, and a `slime:` spec adapted. What it returns
is a plain slimish function; the rollout side never needs to know where it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slimish import plugins
from slimish.compat.slime import load_slime_function


def load_function(spec: str, kind: str, flag: str | None = None) -> Callable[..., Any]:
    """`slimish.plugins.load_function`, with a `slime:` spec for a rollout, reward or filter
    function adapted from slime's signatures."""
    if spec.startswith(plugins.SLIME_PREFIX) and kind in plugins.SLIME_ADAPTS:
        return load_slime_function(spec, kind, flag or plugins.KINDS[kind].flag)
    return plugins.load_function(spec, kind, flag)
