"""Writes a config dataclass as TOML (the launcher hands each service its own config file)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def to_toml(cfg: Any) -> str:
    """Top-level scalars first, then one [section] per nested dataclass (one level, as our configs are)."""
    scalars, sections = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            body = [f"{g.name} = {_value(getattr(v, g.name))}" for g in dataclasses.fields(v)
                    if getattr(v, g.name) is not None]
            sections.append(f"[{f.name}]\n" + "\n".join(body))
        elif v is not None:
            scalars.append(f"{f.name} = {_value(v)}")
    return "\n".join(scalars) + "\n\n" + "\n\n".join(sections) + "\n"
