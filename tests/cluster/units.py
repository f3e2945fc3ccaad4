"""What systemd would run for one rendered unit: the command line of `ExecStart` (with `%i` filled in from the
unit's instance), the environment from `Environment=` and every `EnvironmentFile=`, the working directory and
the readiness type. Pure parsing: `launch.py` runs what this returns.

Only what the rendered units use is understood; anything else in a directive we rely on (another `%`
specifier, an `ExecStart` prefix such as `-` or `+`) is refused by name rather than guessed.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


class UnitError(ValueError):
    """A unit or env file uses something this reader does not understand."""


@dataclass(frozen=True)
class ServiceSpec:
    unit: str                         # moorage-prefill@0.service
    argv: list[str]
    environment: dict[str, str]       # Environment= plus every EnvironmentFile=, in systemd's order
    working_directory: str | None
    notify: bool                      # Type=notify: ready when it sends READY=1
    env_files: list[str] = field(default_factory=list)

    @property
    def role(self) -> str:
        """moorage-prefill@0.service -> prefill; moorage-nats.service -> nats."""
        return self.unit.removeprefix("moorage-").split("@")[0].removesuffix(".service")

    @property
    def name(self) -> str:
        """The instance name a unit stands for: prefill-0, router, nats."""
        base = self.unit.removesuffix(".service").removeprefix("moorage-")
        return base.replace("@", "-")


def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value (a key may repeat, e.g. EnvironmentFile=)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        if section is None or "=" not in line:
            raise UnitError(f"{path}: cannot read line {raw!r}")
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def read_env_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile= format: KEY=VALUE lines, '#'/';' comments; a value that starts with a quote
    is quoted, any other is taken literally up to the end of the line (quotes inside stay), trimmed."""
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise UnitError(f"{path}: not KEY=VALUE: {raw!r}")
        value = value.strip()
        if value[:1] in ("'", '"'):
            if len(value) < 2 or value[-1] != value[0]:
                raise UnitError(f"{path}: unterminated quote in {key}")
            value = value[1:-1]
        elif "\\" in value:
            raise UnitError(f"{path}: backslash escapes in {key} are not handled here")
        env[key.strip()] = value
    return env


def _specifiers(text: str, instance: str, unit: str) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1) == "i":
            return instance
        if m.group(1) == "%":
            return "%"
        raise UnitError(f"{unit}: specifier %{m.group(1)} is not handled here")

    return re.sub(r"%(.)", sub, text)


def service_spec(systemd_dir: Path, unit: str, resolve=lambda p: Path(p)) -> ServiceSpec:
    """The service `unit` (e.g. moorage-prefill@0.service) as systemd would start it from `systemd_dir`.
    `resolve` maps a path on the host to where it lives here (EnvironmentFile= is read through it)."""
    stem, at, rest = unit.partition("@")
    instance = rest.removesuffix(".service") if at else ""
    template = f"{stem}@.service" if at else unit
    svc = read_unit(systemd_dir / template).get("Service", {})
    [exec_start] = svc.get("ExecStart", [None])
    if exec_start is None:
        raise UnitError(f"{unit}: no ExecStart")
    if exec_start[:1] in "-+!@:|":
        raise UnitError(f"{unit}: ExecStart prefix {exec_start[0]!r} is not handled here")
    argv = [_specifiers(a, instance, unit) for a in shlex.split(exec_start)]
    env: dict[str, str] = {}
    for assignment in svc.get("Environment", []):
        for word in shlex.split(assignment):
            key, _, value = word.partition("=")
            env[key] = _specifiers(value, instance, unit)
    files = []
    for entry in svc.get("EnvironmentFile", []):
        optional, path = entry.startswith("-"), _specifiers(entry.lstrip("-"), instance, unit)
        local = resolve(path)
        if not local.exists():
            if optional:
                continue
            raise UnitError(f"{unit}: EnvironmentFile {path} is missing")
        env.update(read_env_file(local))
        files.append(path)
    [kind] = svc.get("Type", ["simple"])
    workdir = svc.get("WorkingDirectory", [None])[-1]
    return ServiceSpec(unit, argv, env, workdir, kind == "notify", files)
