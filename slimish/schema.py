"""What every config schema shares: each field's help, the range and choice checks.

A schema is a dataclass that OmegaConf validates (types, missing values); a field's help travels
with it as `dataclasses.field` metadata, so `--help`, `slimish train --help` and
docs/configuration.md read it from the schema itself:

    port: int = doc(30000, "SGLang's default; always pass one explicitly when several servers run")
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any


def doc(default: Any, help: str) -> Any:
    """A field with its default and its help (`MISSING`: required)."""
    return dataclasses.field(default=default, metadata={"help": help})


def doc_factory(factory: Callable[[], Any], help: str) -> Any:
    """A field whose default is made by `factory` (a list, a dict), with its help."""
    return dataclasses.field(default_factory=factory, metadata={"help": help})


def field_docs(schema: type) -> dict[str, str]:
    """Each documented field's help, by field name."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(schema) if f.metadata.get("help")}


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (MISSING when it is required)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def at_least(low: float, section: object, prefix: str, *names: str) -> None:
    """The one range check of the schemas: each named field (None: unset) is >= `low`."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value < low:
            raise ValueError(f"{prefix}{name} must be >= {low}, got {value}")


def one_of(name: str, value: Any, allowed: typing.Iterable[Any]) -> None:
    """The one choice check of the schemas, naming the field and every allowed value."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")
