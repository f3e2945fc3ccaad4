"""Generates the README's configuration reference from the config dataclasses themselves (each key's
trailing `# comment` is its description), so the docs cannot drift from the code:

    python -m infra.configdoc --write README.md     # rewrite the section between the markers
    python -m infra.configdoc --check README.md     # exit 1 if it is stale (a test runs this)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _comments(cls) -> dict[str, str]:
    out = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # subclasses override
        for line in inspect.getsource(klass).splitlines():
            m = re.match(r"\s+(\w+)\s*:[^=]+=.*?#\s*(.+)$", line)
            if m:
                out[m.group(1)] = m.group(2).strip()
    return out


def _table(cls, prefix: str) -> list[str]:
    obj, notes = cls(), _comments(cls)
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            continue
        shown = repr(value).replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | `{shown}` | {notes.get(f.name, '')} |")
    return rows


def reference() -> str:
    from services.gate.config import GateSettings
    from services.decode.config import DecodeConfig
    from services.master.config import MasterSettings
    from services.store.config import StoreSettings
    from services.prefill.config import PoolSettings, PrefillConfig
    from services.router.config import RouterSettings
    from shared.bus import BusConfig
    from shared.engine.engine import EngineConfig
    from shared.ops_http import HttpSettings
    from shared.service import LogConfig
    from shared.tracing import TracingConfig
    from shared.transfer import TransferConfig
    from infra.up import UpSettings

    parts = [
        "Every service reads one TOML file (`--config`), then environment variables "
        "`MOORAGE__<SECTION>__<KEY>`, then `--set section.key=value`; unknown keys are rejected with the "
        "list of known ones. `moorage serve <service> --print-config` prints them all. Top-level keys of "
        "every service: `instance` (its name on the bus) and `load_interval_s` (how often it reports load).",
    ]
    sections = [
        ("Common to every service: `[bus]`", BusConfig, "bus."),
        ("Common: `[http]` (the service's `GET /health` and `GET /metrics`)", HttpSettings, "http."),
        ("Common: `[tracing]`", TracingConfig, "tracing."),
        ("Common: `[log]`", LogConfig, "log."),
        ("Router: `[router]`", RouterSettings, "router."),
        ("Gate: `[gate]`", GateSettings, "gate."),
        ("Prefill and decode: `[engine]`", EngineConfig, "engine."),
        ("Prefill and decode: `[transfer]`", TransferConfig, "transfer."),
        ("Prefill: top-level keys", PrefillConfig, ""),
        ("Prefill: `[pool]` (the shared KV pool connector)", PoolSettings, "pool."),
        ("Decode: top-level keys", DecodeConfig, ""),
        ("Master: `[master]` (supervises `mooncake_master`)", MasterSettings, "master."),
        ("Store: `[store]` (a DRAM segment of the pool)", StoreSettings, "store."),
        ("`moorage up`: `[up]` (each service's keys go under its name, e.g. `prefill.engine.num_blocks`)",
         UpSettings, "up."),
    ]
    for title, cls, prefix in sections:
        parts.append(f"#### {title}\n\n" + "\n".join(_table(cls, prefix)))
    return "\n\n".join(parts)


def render(readme: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README lacks the {BEGIN} / {END} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{reference()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="README")
    g.add_argument("--check", metavar="README")
    args = p.parse_args(argv)
    path = Path(args.write or args.check)
    text = path.read_text()
    new = render(text)
    if args.write:
        path.write_text(new)
        return 0
    if new != text:
        print(f"{path}: configuration reference is stale; run python -m infra.configdoc --write {path}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
