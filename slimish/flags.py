"""The command line, generated from a schema: `--max-running-requests 8` for `max_running_requests`,
so a flag and its default cannot drift apart, and each flag's help is its field's (slimish/schema.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from typing import Any, TypeVar

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slimish.schema import default_of, field_docs

log = logging.getLogger(__name__)

T = TypeVar("T")

# A field -> SGLang's other flag names for it (sglang 0.5.23: python/sglang/srt/arg_groups/fields/model.py,
# parallel.py), accepted as well.
FLAG_ALIASES = {"model": ("model_path",), "tp_size": ("tensor_parallel_size",)}
# Old flag -> the field that took its place: read for a release, with a warning.
RENAMED_FLAGS = {"admin_key": "admin_api_key", "engine_start_timeout": "start_timeout", "workers": "processes"}


def add_config_arguments(parser: argparse.ArgumentParser, schema: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per schema field, default and type taken from the schema, its help as help;
    lists take N values; booleans are bare flags as SGLang's (`--enable-lora`), with a `--no-X`
    form to turn off one that defaults on. SGLang's other names for a field are accepted too
    (FLAG_ALIASES), so an SGLang launch line starts the built-in engine."""
    hints, docs = typing.get_type_hints(schema), field_docs(schema)
    for f in dataclasses.fields(schema):
        if f.name in skip:
            continue
        hint = hints[f.name]
        default = default_of(f)
        default = None if default is MISSING else default
        names = ["--" + name.replace("_", "-") for name in (f.name, *FLAG_ALIASES.get(f.name, ()))]
        if hint is bool:  # BooleanOptionalAction adds "(default: ...)" to the help itself
            parser.add_argument(
                *names, action=argparse.BooleanOptionalAction, default=default, help=docs.get(f.name) or None
            )
            continue
        is_list = typing.get_origin(hint) is list
        kind = typing.get_args(hint)[0] if is_list else _scalar(hint)
        parser.add_argument(
            *names,
            type=kind,
            default=default,
            required=f.default is MISSING,
            nargs="*" if is_list else None,
            help=f"{docs.get(f.name, '')} (default: {default})".lstrip(),
        )
    for old, new in RENAMED_FLAGS.items():
        if new in hints and new not in skip:
            parser.add_argument(
                "--" + old.replace("_", "-"),
                dest=new,
                type=_scalar(hints[new]),
                action=_RenamedFlag,
                help=argparse.SUPPRESS,
            )


class _RenamedFlag(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new = "--" + self.dest.replace("_", "-")
        log.warning("%s is now %s; the old name will stop working in the next release", option_string, new)
        setattr(namespace, self.dest, values)


def config_from_args(schema: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Validate the parsed flags through OmegaConf; returns a schema instance."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(schema) if hasattr(args, f.name)}
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), values, overrides)
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except (ValueError, OmegaConfBaseException) as exc:
        raise SystemExit(f"bad {schema.__name__}: {exc}") from None


def describe_config(schema: type, prefix: str = "") -> list[str]:
    """`key (default): help` for every field, nested sections flattened to dotted keys."""
    lines, docs = [], field_docs(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.default_factory):  # a section: its own keys, dotted
            lines += describe_config(f.default_factory, f"{prefix}{f.name}.")
            continue
        default = default_of(f)
        shown = "required" if default is MISSING else repr(default)
        lines.append(f"  {prefix}{f.name} ({shown})" + (f": {docs[f.name]}" if docs.get(f.name) else ""))
    return lines


def _scalar(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if args else hint
    return str if kind is bool else kind  # OmegaConf reads "true" / "false"; bool("false") is True
