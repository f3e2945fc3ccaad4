"""How much KV an engine holds: a fixed block count, or a share of the memory free once the model is
loaded (vLLM's `gpu_memory_utilization`, SGLang's `mem_fraction_static`).

`engine.num_blocks > 0` wins. Otherwise `engine.kv_memory` says how much: "40%" of the memory available
after the model loaded (host MemAvailable on cpu, free device memory on an accelerator), a size
("6GiB", "512MiB", "1.5GB", or plain bytes), or "auto" (AUTO_SHARE of what is available: a host runs
more than one engine; `moorage up` replaces "auto" with its own split of the host). Pure arithmetic
apart from `available_bytes`, which reads the machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AUTO_SHARE = 0.4
_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class MemorySpec:
    """Either a share of the available memory or a number of bytes (exactly one is set)."""
    share: float | None = None
    bytes: int | None = None

    def resolve(self, available: int) -> int:
        return int(available * self.share) if self.share is not None else int(self.bytes)

    def __str__(self) -> str:
        return f"{self.share * 100:g}%" if self.share is not None else format_bytes(self.bytes)


def parse_memory(spec: str | int | float) -> MemorySpec:
    """"40%" -> share 0.4; "6GiB" / "1.5GB" / 4096 -> bytes; "auto" -> AUTO_SHARE. ValueError otherwise."""
    if isinstance(spec, bool):
        raise ValueError(f"memory size must be a percentage or a size, got {spec!r}")
    if isinstance(spec, (int, float)):
        if spec <= 0:
            raise ValueError(f"memory size must be positive, got {spec!r}")
        return MemorySpec(bytes=int(spec))
    text = spec.strip().lower()
    if text == "auto":
        return MemorySpec(share=AUTO_SHARE)
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            raise ValueError(f"bad percentage {spec!r}") from None
        if not 0 < share <= 1:
            raise ValueError(f"a memory share must be in (0%, 100%], got {spec!r}")
        return MemorySpec(share=share)
    m = _SIZE.match(text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"memory size {spec!r} is neither a percentage (\"40%\") nor a size (\"6GiB\", \"512MB\")")
    n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"memory size must be positive, got {spec!r}")
    return MemorySpec(bytes=n)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def available_bytes(device: str) -> int:
    """Memory free for KV on `device` right now."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":  # ROCm builds answer here too
        return int(torch.cuda.mem_get_info(dev)[0])
    return host_available_bytes()


@dataclass(frozen=True)
class KVSizing:
    num_blocks: int
    bytes: int           # num_blocks * block bytes
    how: str             # for the startup log: where the number came from

    def tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size


def size_kv(num_blocks: int, kv_memory: str, block_bytes: int, device: str,
            available: int | None = None) -> KVSizing:
    """The engine's KV block count. `available` is read from the machine when not given."""
    if num_blocks > 0:
        return KVSizing(num_blocks, num_blocks * block_bytes, f"engine.num_blocks={num_blocks}")
    if num_blocks < 0:
        raise ValueError(f"engine.num_blocks must be >= 0, got {num_blocks}")
    spec = parse_memory(kv_memory)
    if spec.share is not None:
        available = available_bytes(device) if available is None else available
        budget = spec.resolve(available)
        how = f"engine.kv_memory={kv_memory!r}: {spec} of {format_bytes(available)} available on {device}"
    else:
        budget = spec.resolve(0)
        how = f"engine.kv_memory={kv_memory!r}"
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(f"{how} is {format_bytes(budget)}, less than one KV block ({format_bytes(block_bytes)})")
    return KVSizing(blocks, blocks * block_bytes, how)
