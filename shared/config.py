"""Typed service configuration: dataclass sections, loaded from file + environment + CLI.

Precedence (later wins): dataclass defaults < TOML file < environment < `--set section.key=value`.
Environment keys are `MOORAGE__<SECTION>__<KEY>` (double underscores, case-insensitive), e.g.
`MOORAGE__BUS__URL=nats://10.0.0.5:4222`. Any unknown section or key is an error that lists the
known ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "MOORAGE__"
T = TypeVar("T")


class ConfigError(ValueError):
    pass


def _known(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Coerce a TOML value or an env/CLI string to the annotated type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _convert(value, args[0], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
        try:
            return tp(value) if not (tp is int and isinstance(value, float)) else _int_exact(value, where)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if origin in (list, tuple, dict):
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                parsed = None
            if origin is dict:
                if not isinstance(parsed, dict):
                    raise ConfigError(f"{where}: expected a JSON object, got {value!r}")
                value = parsed
            else:  # a JSON list, else comma-separated items ("12345" is one item, not a number)
                value = parsed if isinstance(parsed, list) else [v.strip() for v in value.split(",") if v.strip()]
        if origin is dict:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a table, got {value!r}")
            kt, vt = typing.get_args(tp) or (str, Any)
            return {str(k): (v if vt is Any else _convert(v, vt, f"{where}.{k}")) for k, v in value.items()}
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (et, *_) = typing.get_args(tp) or (Any,)
        items = [v if et is Any else _convert(v, et, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    return value


def _int_exact(value: float, where: str) -> int:
    if not float(value).is_integer():
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    return int(value)


def _apply(obj: Any, data: Mapping[str, Any], where: str) -> Any:
    """A copy of dataclass `obj` with `data` merged in (nested sections recurse)."""
    hints = typing.get_type_hints(type(obj))
    known = _known(type(obj))
    changes = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"unknown key {where + key!r}; known keys{' in [' + where.rstrip('.') + ']' if where else ''}: "
                              f"{', '.join(known)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where + key}: is a section; set its keys, e.g. {where + key}.{_known(type(current))[0]}")
            changes[key] = _apply(current, value, f"{where}{key}.")
        else:
            changes[key] = _convert(value, hints[key], where + key)
    return dataclasses.replace(obj, **changes)


def apply_dict(obj: Any, data: Mapping[str, Any], where: str = "") -> Any:
    """A copy of config `obj` with the nested keys of `data` set (validated as a file's would be)."""
    return _apply(obj, data, where)


def _nest(path: Sequence[str], value: Any) -> dict:
    out: dict = {}
    cur = out
    for p in path[:-1]:
        cur = cur.setdefault(p, {})
    cur[path[-1]] = value
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(items: Sequence[str]) -> dict:
    merged: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        merged = _deep_merge(merged, _nest(key.strip().split("."), value))
    return merged


def env_overrides(env: Mapping[str, str]) -> dict:
    merged: dict = {}
    for name, value in env.items():
        if name.upper().startswith(ENV_PREFIX):
            path = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
            if path:
                merged = _deep_merge(merged, _nest(path, value))
    return merged


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> T:
    """Defaults < file < environment < overrides. Raises ConfigError naming the bad key."""
    cfg = cls()
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        cfg = _apply(cfg, data, "")
    cfg = _apply(cfg, env_overrides(os.environ if env is None else env), "")
    return _apply(cfg, parse_overrides(overrides), "")


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(key, type, default) for every leaf key: used for docs and `--help`."""
    rows = []
    obj = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            rows += describe(type(value), f"{prefix}{f.name}.")
        else:
            rows.append((prefix + f.name, getattr(hints[f.name], "__name__", str(hints[f.name])), value))
    return rows
