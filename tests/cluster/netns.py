"""K emulated hosts on one box: a network namespace per host, each with one veth to a bridge that lives in
a namespace of its own (the "switch"), so nothing is added to the root namespace: no interface, no address,
no route. Every address is in 10.66.0.0/24 and exists only inside namespaces this module created.

The switch namespace also holds the bridge's own address (.254): the test talks to the cluster from there,
as an operator's box on the same network would, through `in_netns` (a worker thread that entered it).

Names carry the pid, so parallel runs never clash; `Topology.close` removes every namespace it made (with them
go the veths and the bridge) and is safe to call twice. A run killed outright (SIGKILL: no finalizer runs)
leaves its namespaces and services behind; the next run reaps them (`reap_stale`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

SUBNET = "10.66.0"
PREFIX_LEN = 24
CLONE_NEWNET = 0x40000000
STALE = re.compile(r"^mr(\d+)-(sw|h\d+)$")


class NetnsRefused(RuntimeError):
    """The kernel (or our privileges) will not let us make namespaces: the caller skips with this reason."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


@dataclass(frozen=True)
class Host:
    name: str      # the host's name in the inventory (h1, h2, ...)
    netns: str     # its network namespace
    address: str   # its one address, on eth0

    def exec_prefix(self) -> list[str]:
        """Run a command inside this host (its own network namespace and mount namespace)."""
        return ["ip", "netns", "exec", self.netns]


@dataclass
class Topology:
    hosts: list[Host]
    switch: str                       # the bridge's namespace
    operator_address: str             # the bridge's own address, where the test stands
    made: list[str] = field(default_factory=list)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def host_of(self, address: str) -> Host | None:
        return next((h for h in self.hosts if h.address == address), None)

    def port_counters(self) -> dict[str, dict[str, int]]:
        """Bytes through each host's switch port (the bridge side of its veth): `rx` is what the host sent,
        `tx` what it received."""
        out = {}
        for h in self.hosts:
            stats = f"/sys/class/net/{h.name}/statistics"
            r = subprocess.run([*self.switch_prefix(), "cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"],
                               capture_output=True, text=True, timeout=30, check=True)
            rx, tx = (int(v) for v in r.stdout.split())
            out[h.name] = {"sent": rx, "received": tx}
        return out

    def switch_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.switch]

    def close(self) -> None:
        for ns in reversed(self.made):
            ip("netns", "del", ns, check=False)
        self.made.clear()


def reap_stale() -> list[str]:
    """Namespaces of runs that died without cleaning up (named mr<pid>-..., that pid gone): their processes
    are killed (by id, as `ip netns pids` lists them) and the namespaces deleted. A live run is never touched:
    its pid exists."""
    reaped = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        m = STALE.match(line.split()[0]) if line.strip() else None
        if m is None or (int(m.group(1)) != os.getpid() and os.path.exists(f"/proc/{m.group(1)}")):
            continue  # not ours, or its run is alive (our own pid's are a dead run's: we made none yet)
        for pid in ip("netns", "pids", m.group(0), check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "del", m.group(0), check=False)
        reaped.append(m.group(0))
    return reaped


def create(k: int, tag: str | None = None) -> Topology:
    """k hosts h1..hk at 10.66.0.1..k on one bridge. Raises NetnsRefused when namespaces cannot be made."""
    tag = tag or f"mr{os.getpid()}"
    top = Topology([Host(f"h{i}", f"{tag}-h{i}", f"{SUBNET}.{i}") for i in range(1, k + 1)], f"{tag}-sw",
                   f"{SUBNET}.254")
    reap_stale()
    r = ip("netns", "add", top.switch, check=False)
    if r.returncode != 0:
        raise NetnsRefused(f"cannot create a network namespace: {r.stderr.strip()}")
    top.made.append(top.switch)
    try:
        sw = ["-n", top.switch]
        ip(*sw, "link", "add", "br0", "type", "bridge")
        ip(*sw, "addr", "add", f"{top.operator_address}/{PREFIX_LEN}", "dev", "br0")
        ip(*sw, "link", "set", "br0", "up")
        ip(*sw, "link", "set", "lo", "up")
        for h in top.hosts:
            ip("netns", "add", h.netns)
            top.made.append(h.netns)
            # both ends are born in their namespaces: no interface ever appears in the root namespace
            ip("link", "add", "eth0", "netns", h.netns, "type", "veth", "peer", "name", h.name, "netns", top.switch)
            ip(*sw, "link", "set", h.name, "master", "br0")
            ip(*sw, "link", "set", h.name, "up")
            hn = ["-n", h.netns]
            ip(*hn, "addr", "add", f"{h.address}/{PREFIX_LEN}", "dev", "eth0")
            ip(*hn, "link", "set", "eth0", "up")
            ip(*hn, "link", "set", "lo", "up")
    except BaseException:
        top.close()
        raise
    return top


def _enter(netns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_netns(netns: str) -> Iterator[ThreadPoolExecutor]:
    """A one-thread executor whose thread lives in `netns` (setns moves only the calling thread): every
    socket opened by a function submitted to it is in that namespace."""
    pool = ThreadPoolExecutor(max_workers=1, initializer=_enter, initargs=(netns,),
                              thread_name_prefix=f"netns-{netns}")
    try:
        pool.submit(lambda: None).result()  # surfaces a failed setns here
        yield pool
    finally:
        pool.shutdown(wait=True)
