"""The machinery of the configuration dataclasses: a field with its help text and choices, and
the checks of values against annotations and choices (`vllm_rlt.config`, `serve_config`)."""

from __future__ import annotations

import numbers
import types
import typing
from collections.abc import Mapping
from dataclasses import field, fields
from typing import Any


class ConfigError(ValueError):
    """A setting or model file the engine cannot start with; the message names the setting or
    the file (and what would fix it)."""


def field_help(text: str, choices: tuple[str, ...] | None = None, **kw: Any) -> Any:
    metadata = {"help": text} if choices is None else {"help": text, "choices": choices}
    return field(metadata=metadata, **kw)


def check(ok: bool, name: str, value: Any, want: str) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {want}, got {value!r}")


def check_choices_and_types(config: Any) -> None:
    """The annotation of every field, then the `choices` of every enumerated one."""
    check_field_types(type(config), {f.name: getattr(config, f.name) for f in fields(config)})
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        check(choices is None or value in choices, f.name, value, f"one of {choices}")


def check_field_types(cls: type, values: Mapping[str, Any]) -> None:
    """ConfigError naming the first of `values` that does not match its annotation on the
    dataclass `cls` (any integral number is an int and any real one a float; a bool is
    neither)."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name in hints and not _matches(value, hints[name]):
            want = _type_name(hints[name])
            raise ConfigError(f"{name} must be {want}, got {value!r} ({type(value).__name__})")


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in args)
    if origin in (list, tuple):
        items = [a for a in args if a is not Ellipsis]
        return isinstance(value, origin) and all(_matches(v, items[0]) for v in value)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint in (int, float):
        kind = numbers.Integral if hint is int else numbers.Real
        return isinstance(value, kind) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arm) for arm in typing.get_args(hint))
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))
