"""Plain data (a YAML file's, an override's, a checkpoint's config) into the schema's frozen
dataclasses, each value checked against its field's type, choices and range, an unknown key
named with the nearest valid one; and a config back into plain data. A field named `async_` is
the YAML key `async`."""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from types import UnionType
from typing import Any, Union

from dtrain.config.fields import number
from dtrain.config.schema import Config
from dtrain.core.errors import UserError


def _key(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {_key(f): f for f in dataclasses.fields(cls)}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {_key(f): hints[f.name] for f in dataclasses.fields(cls)}


def _is_section(tp: Any) -> typing.TypeGuard[type]:
    """Whether a field's annotation is a nested section (a dataclass) rather than a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, e.g. 'optim.lr'."""
    keys = []
    for key, tp in _field_types(cls).items():
        if _is_section(tp):
            keys.extend(all_keys(tp, prefix + key + "."))
        else:
            keys.append(prefix + key)
    return keys


def _all_names() -> list[str]:
    """Every dotted key and every section, e.g. 'optim.lr', 'optim', 'parallel.fsdp'."""
    names = set(all_keys())
    for key in list(names):
        parts = key.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(names)


def unknown_key(dotted: str) -> UserError:
    depth = dotted.count(".")
    same_depth = [n for n in _all_names() if n.count(".") == depth]
    close = difflib.get_close_matches(dotted, same_depth, n=1, cutoff=0.5)
    if not close:  # a misspelt leaf under a right section: compare the last part only
        leaf = dotted.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in all_keys()}
        close = [
            by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        ]
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return UserError(f"config error: unknown key '{dotted}'{hint}")


def _coerce(value: Any, tp: Any, dotted: str) -> Any:
    """Check `value` against the annotation `tp`; allow the conversions YAML users expect."""
    origin = typing.get_origin(tp)
    if origin in (Union, UnionType):  # Optional[X] and X | None alike
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, dotted)
            except UserError as e:
                errors.append(e)
        if len(errors) == 1:  # one type besides None: its own words (e.g. "must be finite")
            raise errors[0]
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise UserError(f"config error: {dotted}: expected {names}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        parsed = number(value)  # also "1e-3", which YAML 1.1 reads as a string
        if parsed is not None and not math.isfinite(parsed):
            # No key means "forever" or "without limit" by inf: a run would end in NaN at its
            # first step or in an overflow deep inside (a timeout, a clock); null says "none".
            raise UserError(f"config error: {dotted}: must be a finite number, got {value!r}")
        if parsed is not None:
            return parsed
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list or origin is list:
        if isinstance(value, list):
            return value
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
    raise UserError(f"config error: {dotted}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    return {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """An instance of the section `cls` (Config: the whole config) from `data`, every value
    checked; `prefix` is the dotted name of the section, for messages."""
    if not isinstance(data, dict):
        raise UserError(
            f"config error: {prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}"
        )
    fields = _fields(cls)
    types = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = prefix + str(key)
        if key not in fields:
            raise unknown_key(dotted)
        tp = types[key]
        if _is_section(tp):
            kwargs[fields[key].name] = build(tp, value if value is not None else {}, dotted + ".")
        else:
            value = _coerce(value, tp, dotted)
            parse = fields[key].metadata.get("parse")  # numbers inside a list or mapping
            kwargs[fields[key].name] = parse(value) if parse and value is not None else value
    obj = cls(**kwargs)
    _validate(obj, prefix)
    return obj


def _validate(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        dotted = prefix + _key(f)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(
                f"config error: {dotted}: '{value}' is not one of "
                f"{', '.join(map(str, choices))}{hint}"
            )
        check = f.metadata.get("check")
        if check and value is not None and not check[0](value):
            raise UserError(f"config error: {dotted}: {check[1]}, got {value!r}")


def to_dict(obj: Any) -> Any:
    """The config as plain data, with YAML key names (for config.yaml and checkpoints)."""
    if dataclasses.is_dataclass(obj):
        return {_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 0.1}} -> {'optim.lr': 0.1}"""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value and key != "args":
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
