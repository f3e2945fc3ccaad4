"""Which TCP sockets a set of processes listens on, and on which address: `ss -ltnp` for our own processes,
read from /proc (no `ss` needed, no root needed for processes of the same user).

/proc/net/tcp and tcp6 list every socket with its inode; /proc/PID/fd links name the inodes a process
holds. A listener on 0.0.0.0 or :: (`wildcard`) takes connections on every interface of the host.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str       # the process's name as the caller gave it (e.g. the instance), else its comm
    address: str    # "127.0.0.1", "0.0.0.0", "::", ...
    port: int

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        return ip.is_loopback or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None
                                  and ip.ipv4_mapped.is_loopback)

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.name} (pid {self.pid}) listens on {host}:{self.port}"


def _decode(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # IPv6: four 32-bit words, each in host (little-endian) order
    return str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))


def listening_inodes() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in this network namespace."""
    out: dict[int, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == LISTEN:
                addr, port = cols[1].rsplit(":", 1)
                out[int(cols[9])] = (_decode(addr), int(port, 16))
    return out


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def descendants(pid: int) -> list[int]:
    """Every process below pid (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
                ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def listeners(processes: dict[str, int] | Iterable[int]) -> list[Listener]:
    """Every listening socket held by the given processes ({name: pid} or pids), sorted by name and port.
    A socket shared by several processes is listed once per process."""
    named = processes if isinstance(processes, dict) else {f"{comm(p)}[{p}]": p for p in processes}
    table = listening_inodes()
    out = [Listener(pid, name, *table[inode]) for name, pid in named.items()
           for inode in socket_inodes(pid) if inode in table]
    return sorted(out, key=lambda x: (x.name, x.port))
