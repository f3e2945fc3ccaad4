"""Listening sockets handed from a parent to the process it starts (shared/sockets.py), the way `moorage up`
gives the router its port."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import httpx
import pytest

from shared.sockets import inherited, listen, url_of

CHILD = textwrap.dedent("""
    import sys
    from shared.sockets import inherited
    sock = inherited(int(sys.argv[1]), "child")
    sock.setblocking(True)
    conn, _ = sock.accept()
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 5\\r\\nConnection: close\\r\\n\\r\\nchild")
    conn.close()
""")


def test_port_0_binds_a_free_port_and_the_url_names_it():
    with listen("127.0.0.1", 0, "test") as sock:
        port = sock.getsockname()[1]
        assert port > 0 and url_of(sock) == f"http://127.0.0.1:{port}"
        with pytest.raises(OSError, match=f"again cannot listen on 127.0.0.1:{port}"):
            listen("127.0.0.1", port, "again")


def test_a_child_serves_the_socket_its_parent_bound():
    with listen("127.0.0.1", 0, "test") as sock:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(sock.fileno())], pass_fds=(sock.fileno(),))
        try:
            assert httpx.get(url_of(sock), timeout=30).text == "child"
            assert child.wait(30) == 0
        finally:
            child.kill()
            child.wait()


def test_an_fd_that_is_not_a_listening_socket_is_refused():
    a, b = socket.socketpair()
    with a, b, pytest.raises(OSError, match="not a listening TCP socket"):
        inherited(a.fileno(), "router")
    with open(__file__) as f, pytest.raises(OSError, match="not an inherited socket"):
        inherited(f.fileno(), "router")
