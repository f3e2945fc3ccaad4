"""Prefill instance configuration (file + env + `--set`; see shared/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shared.config import ConfigError
from shared.engine.engine import EngineConfig
from shared.pool import PoolConfig
from shared.service import ServiceConfig
from shared.transfer import TransferConfig


POOL_DTYPES = {"": None, "bfloat16": "bf16", "float8_e4m3fn": "fp8"}  # pool.dtype -> its objects' namespace suffix


@dataclass
class PoolSettings(PoolConfig):
    enabled: bool = False                  # restore from and save to the shared KV pool (needs master + stores)
    min_restore_tokens: int = 0            # restore only when at least this many prompt tokens would come from the pool (and at least one chunk)
    restore_batch_chunks: int = 4          # chunks per batched read (sizes the registered restore buffer)
    restore_in_place: bool = True          # read restored chunks straight into their device blocks and verify them there (CPU pages; else through a registered buffer, then unpacked)
    restore_direct_reads: bool = True      # read restored objects from the stores' memory with prefill's own Transfer Engine, waited for without spinning (shared/pool_reads.py); false: through the store client, whose reads busy-poll a core
    restore_wait_s: float = 5.0            # wait this long for free device blocks for every hit chunk, then restore what fits
    prefetch: bool = True                  # a session paused for a tool (router.retention = session) gets the chunks of its history the device lost back from the pool halfway through the pause agents take, into free blocks, never evicting a session expected back sooner (services/prefill/prefetch.py)
    disk: bool = True                      # use the stores' disk tiers (store.disk_path): tell them what each save put, and have them put back the chunks the pool lacks before a restore (services/prefill/disk_loads.py)
    disk_load_timeout_s: float = 5.0       # how long a restore waits for a store to put its chunks back from disk (then they are computed)
    save: bool = True                      # save each new full prompt chunk after prefill (async)
    save_batch_chunks: int = 8             # chunks per batched put (one put per request up to this; sizes the registered save buffer)
    save_when_idle: bool = True            # defer saves until the engine is idle and no handoff is in flight (or blocks are short, or save_max_delay_s passed): saving never slows compute or a handoff
    save_max_delay_s: float = 10.0         # a deferred save waits at most this long for idle, then runs beside compute
    save_max_held_fraction: float = 0.25   # saves waiting for idle may pin at most this fraction of the device blocks; beyond it they run at once
    save_max_mbps: float = 0.0             # pace saves to at most this many MB/s to the pool (0: unlimited)
    dtype: str = ""                        # pool objects' element type: "" = the KV's own (lossless: restored turns are token-identical); "bfloat16": float32 KV stored at half the bytes, "float8_e4m3fn" at a quarter (saturating at +-448, unscaled), converted in the pack/unpack kernels (lossy: see README)

    def __post_init__(self) -> None:
        if self.restore_batch_chunks < 1:
            raise ConfigError(f"pool.restore_batch_chunks must be >= 1, got {self.restore_batch_chunks}")
        if self.save_batch_chunks < 1:
            raise ConfigError(f"pool.save_batch_chunks must be >= 1, got {self.save_batch_chunks}")
        if self.save_max_delay_s < 0:
            raise ConfigError(f"pool.save_max_delay_s must be >= 0, got {self.save_max_delay_s}")
        if not 0 < self.save_max_held_fraction <= 1:
            raise ConfigError(f"pool.save_max_held_fraction must be in (0, 1], got {self.save_max_held_fraction}")
        if self.dtype not in POOL_DTYPES:
            raise ConfigError(f"pool.dtype must be one of {sorted(POOL_DTYPES)}, got {self.dtype!r}")
        if self.disk_load_timeout_s <= 0:
            raise ConfigError(f"pool.disk_load_timeout_s must be positive, got {self.disk_load_timeout_s}")
        if self.save_max_mbps < 0:
            raise ConfigError(f"pool.save_max_mbps must be >= 0 (0: unlimited), got {self.save_max_mbps}")


@dataclass
class PrefillConfig(ServiceConfig):
    instance: str = "prefill-0"
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    pool: PoolSettings = field(default_factory=PoolSettings)
    assign_timeout_s: float = 45.0  # a request submitted before its admission (no decode yet) waits this long for its DecodeAssign, then fails (above router.admission_timeout_s)
    holdings_grace_s: float = 5.0   # a request its router's Holdings no longer list is ended once this old (its router was restarted)
    pp: int = 1                     # pipeline-parallel ranks: this instance runs as pp processes, one per contiguous layer span (stage), shared/engine/pipeline.py; CPU only so far

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ConfigError(f"prefill.pp must be >= 1, got {self.pp}")
        if self.engine.dcp > 1:
            raise ConfigError(f"prefill.engine.dcp = {self.engine.dcp}: context-parallel ranks are decode's (decode.dcp)")
        if self.pp > 1 or self.engine.pp > 1:
            if self.engine.pp not in (1, self.pp) or self.engine.stages not in (1, self.pp):
                raise ConfigError(f"prefill.pp ({self.pp}) sets engine.pp and engine.stages: leave them unset "
                                  f"(got {self.engine.pp} and {self.engine.stages})")
            try:
                self.engine = replace(self.engine, pp=self.pp, stages=self.pp)
            except ValueError as e:
                raise ConfigError(f"prefill.pp = {self.pp}: {e}") from None
        if self.assign_timeout_s <= 0:
            raise ConfigError(f"assign_timeout_s must be positive, got {self.assign_timeout_s}")
        if self.holdings_grace_s < 0:
            raise ConfigError(f"holdings_grace_s must be >= 0, got {self.holdings_grace_s}")
