"""systemd's readiness protocol (sd_notify(3)): when `NOTIFY_SOCKET` is set (a `Type=notify` unit), a
service says `READY=1` once it serves and `STOPPING=1` when it starts to drain. Without the variable
this does nothing, so the same code runs under compose, `moorage up` and a terminal."""

from __future__ import annotations

import os
import socket


def notify(state: str, environ: dict | None = None) -> bool:
    """Send `state` (e.g. "READY=1" or "STATUS=loading model") to systemd; False when not under systemd."""
    address = (environ if environ is not None else os.environ).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError:
            return False
    return True
