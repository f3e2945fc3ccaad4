"""Listening sockets: bind one (a port in use is a clear error, port 0 picks one), take one over from the
process that started this one, or ask for a port that is free now.

`moorage up` binds the router's port itself and hands the socket down (`router.listen_fd`): port 0 then
works without a race between choosing the port and binding it, a port in use fails the start before
anything runs, and a restarted router keeps its port (connections wait in the backlog meanwhile).
"""

from __future__ import annotations

import socket


def listen(host: str, port: int, what: str, backlog: int = 256) -> socket.socket:
    """A non-blocking socket listening on host:port (SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"{what} cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def inherited(fd: int, what: str) -> socket.socket:
    """The listening TCP socket open as `fd` in this process (passed down by its parent), non-blocking."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise OSError(f"{what}: fd {fd} is not an inherited socket: {e.strerror or e}") from None
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise OSError(f"{what}: fd {fd} is not a listening TCP socket")
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket, scheme: str = "http") -> str:
    """scheme://host:port of a bound socket ([host] for IPv6)."""
    host, port = sock.getsockname()[:2]
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago. Only for programs that take a port number and
    bind it themselves (mooncake_master): anything of ours binds port 0 or takes a socket instead."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
