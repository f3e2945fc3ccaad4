"""How `moorage up` shares one host's memory among the KV of its engines: the host's free memory, less the
pool's stores and every process's own, or, when the engines compute on an accelerator, that device's free
memory less each engine's weights and context. infra/up.py gives each engine whose KV is left to "auto" its
part of the split."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.config import ConfigError
from shared.engine.kv_sizing import format_bytes, host_available_bytes, parse_memory

if TYPE_CHECKING:  # infra/up.py imports this module
    from infra.up import UpConfig, UpSettings

# What one process takes besides its KV, set aside before the host is split (measured with SmolLM2 in
# fp32: an engine process is ~1.2 GiB RSS before KV, the others 0.2-0.4 GiB).
ENGINE_PROCESS_BYTES = 3 << 29  # 1.5 GiB
OTHER_PROCESS_BYTES = 1 << 29   # 0.5 GiB
# On an accelerator an engine's weights (fp32 copies of the bundled models: 0.5-1.1 GiB), its CUDA context
# and its activations come out of the device's memory instead: set aside per engine on the device.
ENGINE_DEVICE_BYTES = 3 << 30   # 3 GiB
MIN_KV_BYTES = 64 << 20


@dataclass(frozen=True)
class KVSplit:
    """How `moorage up` shares one host's memory among the KV of its engines."""
    available: int       # memory available at launch: the host's, or the engines' device's
    reserved: int        # host: stores' segments + every process's own memory; device: each engine's own
    decode_bytes: int    # KV per decode instance
    prefill_bytes: int   # KV per prefill instance

    def describe(self) -> str:
        return (f"KV per decode {format_bytes(self.decode_bytes)}, per prefill {format_bytes(self.prefill_bytes)} "
                f"({format_bytes(self.available)} available, {format_bytes(self.reserved)} set aside for the "
                f"pool's stores and the processes)")


def split_kv(up: UpSettings, available: int, device: str = "cpu") -> KVSplit:
    """Share `available` bytes among the engines' KV: host memory (device "cpu"), or one accelerator's
    memory that every engine of this host shares (the stores' segments stay in host memory then)."""
    decodes, prefills = up.groups, up.groups * up.prefills
    if device == "cpu":
        stores = up.groups * up.stores * up.store_bytes if up.pool else 0
        others = 3 + (up.groups * up.stores + (up.groups if up.pool_mode == "split" else 1) if up.pool else 0)
        reserved = stores + (decodes + prefills) * ENGINE_PROCESS_BYTES + others * OTHER_PROCESS_BYTES
    else:
        reserved = (decodes + prefills) * ENGINE_DEVICE_BYTES
    spec = parse_memory(up.kv_memory)
    # a busy host (little available beyond our allowance) still gets a working system, only a smaller one
    total = spec.resolve(max(available - reserved, available // 4))
    split = KVSplit(available, reserved, int(total * up.decode_kv_share) // decodes,
                    int(total * (1 - up.decode_kv_share)) // prefills)
    if min(split.decode_bytes, split.prefill_bytes) < MIN_KV_BYTES:
        raise ConfigError(f"too little memory for KV: {split.describe()}; lower up.store_bytes, or set "
                          f"up.kv_memory to a size, or prefill/decode.engine.num_blocks")
    return split


def engine_device(cfg: "UpConfig") -> str:
    """The one device every engine of `moorage up` computes on ("cpu", "cuda", "cuda:1")."""
    devices = {cfg.decode.engine.device, cfg.prefill.engine.device}
    if len(devices) != 1:
        raise ConfigError(f"prefill and decode engines on different devices ({sorted(devices)}): set "
                          "prefill/decode.engine.kv_memory to sizes, or num_blocks, instead of up.kv_memory")
    return devices.pop()


def device_free_bytes(device: str) -> int:
    """Free memory on an accelerator, asked in a child process: the launcher itself never holds a CUDA
    context (it would take device memory from the engines for as long as moorage runs)."""
    code = "import sys, torch; print(torch.cuda.mem_get_info(torch.device(sys.argv[1]))[0])"
    try:
        out = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True, timeout=120,
                             check=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"engine.device={device!r}: cannot read its free memory "
                          f"({(getattr(e, 'stderr', '') or str(e)).strip().splitlines()[-1:]})") from None
    return int(out.stdout.strip())


def measure_kv(cfg: "UpConfig") -> KVSplit:
    """The KV split of this host now: of its free host memory, or of the engines' device's free memory."""
    device = engine_device(cfg)
    if device == "cpu":
        return split_kv(cfg.up, host_available_bytes())
    return split_kv(cfg.up, device_free_bytes(device), device)
