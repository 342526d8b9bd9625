"""slime.utils.misc: `load_function` (a dotted `package.module.name`) and `SingletonMeta`."""

from __future__ import annotations

import importlib
from typing import Any


def load_function(path: str) -> Any:
    """The object `path` names: `package.module.name`."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class SingletonMeta(type):
    """One instance per class: later calls return it."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in SingletonMeta._instances:
            SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
        return SingletonMeta._instances[cls]


__all__ = ["SingletonMeta", "load_function"]
