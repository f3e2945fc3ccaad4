"""The compose network seen from loopback: every (service, container port) gets a free local port, every
port a service opens is a listener, and every `service:port` a service names is a reference that must
meet a listener (tests/compose_native.py builds the plan on these)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.config import ENV_PREFIX

LOOPBACK = "127.0.0.1"
SELF_HOSTS = ("127.0.0.1", "localhost")  # inside a container: the container itself


class ComposeError(AssertionError):
    """The compose file would not work as written (a test failure, with the reason)."""


@dataclass
class PortMap:
    """(service, container port) -> a free loopback port; who listens and who refers to what."""
    alloc: Callable[[], int]
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    listeners: set[tuple[str, int]] = field(default_factory=set)
    references: list[tuple[str, str, int]] = field(default_factory=list)  # (where, service, port)

    def port(self, service: str, container_port: int) -> int:
        key = (service, container_port)
        if key not in self.ports:
            self.ports[key] = self.alloc()
        return self.ports[key]

    def listen(self, service: str, container_port: int) -> int:
        self.listeners.add((service, container_port))
        return self.port(service, container_port)

    def refer(self, where: str, service: str, container_port: int) -> int:
        self.references.append((where, service, container_port))
        return self.port(service, container_port)

    def check(self) -> None:
        bad = [f"{where} refers to {svc}:{port}, where nothing listens (it opens "
               f"{sorted(p for s, p in self.listeners if s == svc) or 'no port'})"
               for where, svc, port in self.references if (svc, port) not in self.listeners]
        if bad:
            raise ComposeError("; ".join(bad))


class Rewriter:
    """Maps one service's view of the compose network onto loopback."""

    def __init__(self, services: list[str], ports: PortMap):
        self.services, self.ports = services, ports
        names = "|".join(re.escape(n) for n in sorted([*services, *SELF_HOSTS], key=len, reverse=True))
        self._ref = re.compile(rf"(?<![\w.-])({names}):(\d+)(?!\w)")

    def text(self, value: str, who: str, where: str) -> str:
        def sub(m: re.Match) -> str:
            target = who if m.group(1) in SELF_HOSTS else m.group(1)
            return f"{LOOPBACK}:{self.ports.refer(where, target, int(m.group(2)))}"
        out = self._ref.sub(sub, value)
        return LOOPBACK if out == "0.0.0.0" else out

    def toml(self, data: dict, who: str, path: tuple[str, ...] = ()) -> dict[str, str]:
        """MOORAGE__SECTION__KEY overrides for every value that differs on loopback."""
        env: dict[str, str] = {}
        for key, value in data.items():
            where, dotted = f"{who} [{'.'.join(path)}] {key}", (*path, key)
            new: Any = value
            if isinstance(value, dict):
                env.update(self.toml(value, who, dotted))
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and \
                    (key == "port" or key.endswith("_port")):
                new = self.ports.listen(who, value)
            elif isinstance(value, str) and key.endswith(("host", "hostname")):
                if value in self.services and value != who:
                    raise ComposeError(f"{where} = {value!r}: names another service, not {who}")
                new = LOOPBACK if value in (who, "0.0.0.0") else self.text(value, who, where)
            elif isinstance(value, str):
                new = self.text(value, who, where)
            if new != value:
                env[ENV_PREFIX + "__".join(p.upper() for p in dotted)] = str(new)
        return env
