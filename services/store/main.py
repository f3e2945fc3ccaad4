"""The store service: one Mooncake segment of host DRAM, contributed to the pool for as long as it runs.

It joins the pool as a Mooncake client with `global_segment_size = segment_bytes` and then only keeps
that client alive: clients put into and read from the segment directly (the master decides placement).
If the master restarts, the client remounts the segment by itself (objects are lost with the master's
metadata). Huge pages: Mooncake reads `MC_STORE_USE_HUGEPAGE` (its presence turns them on, and then a
failed allocation fails setup) and `MC_STORE_HUGEPAGE_SIZE` ("2MB" | "1GB") at setup, so this service
sets or clears them first. The LoadReport (role "store") carries the segment's name ("host:port", what
`PoolClient.put_from(preferred_segment=...)` takes) and size in `detail`.

With `store.disk_path` the store also keeps a disk tier (services/store/disk_serve.py): copies of its
segment's objects on local disk, put back into the pool when a prefill asks.

Shutdown unmounts the segment (~1 s). Stop stores before the master: with the master gone the unmount
RPC, and then the process exit, each wait ~5 s for Mooncake's reconnect attempts (~10-12 s in all).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from services.store.config import StoreSettings
from services.store.disk_serve import DiskService
from shared.messages import LoadReport
from shared.pool import PoolError, store_class, wait_for_master
from shared.service import ServiceContext

HUGEPAGE_SIZES = {2 << 20: "2MB", 1 << 30: "1GB"}  # the sizes Mooncake supports


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as numbers (kB for sizes, counts for HugePages_*); {} where it cannot be read."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if rest.split():
                    out[key] = int(rest.split()[0])
    except (OSError, ValueError):
        return {}
    return out


@dataclass
class HugepagePlan:
    use: bool
    page_bytes: int
    reason: str


def plan_hugepages(mode: str, segment_bytes: int, info: dict[str, int]) -> HugepagePlan:
    """Whether to back the segment with huge pages: "on" always (setup fails if none are reserved),
    "off" never, "auto" when the free, unreserved huge pages of a supported size cover the segment."""
    page = info.get("Hugepagesize", 0) * 1024
    if mode == "off":
        return HugepagePlan(False, page, "hugepages=off")
    if page not in HUGEPAGE_SIZES:
        if mode == "on":
            raise PoolError(f"huge page size {page} B is not one Mooncake supports (2MB, 1GB)")
        return HugepagePlan(False, page, f"huge page size {page} B not supported by Mooncake")
    available = (info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)) * page
    needed = -(-segment_bytes // page) * page
    if mode == "on":
        return HugepagePlan(True, page, "hugepages=on")
    if available >= needed:
        return HugepagePlan(True, page, f"{available} B of huge pages free")
    return HugepagePlan(False, page, f"only {max(available, 0)} B of huge pages free, {needed} B needed "
                                     f"(reserve them with vm.nr_hugepages; see infra/)")


class Segment:
    """One mounted Mooncake segment (blocking calls: run them in a thread)."""

    def __init__(self, s: StoreSettings, plan: HugepagePlan):
        self.settings, self.plan = s, plan
        self.segment_bytes = -(-s.segment_bytes // plan.page_bytes) * plan.page_bytes if plan.use else s.segment_bytes
        if plan.use:
            os.environ["MC_STORE_USE_HUGEPAGE"] = "1"
            os.environ["MC_STORE_HUGEPAGE_SIZE"] = HUGEPAGE_SIZES[plan.page_bytes]
        else:
            os.environ.pop("MC_STORE_USE_HUGEPAGE", None)  # its mere presence turns huge pages on
        store_cls = store_class()[0]
        self.store = store_cls()
        rc = self.store.setup(s.hostname, s.metadata_server, self.segment_bytes, 0, s.protocol,
                              s.device_name, s.master_addr)
        if rc != 0:
            hint = " (no huge pages reserved?)" if plan.use else ""
            raise PoolError(f"mounting a {self.segment_bytes} B segment at master {s.master_addr} failed{hint}", rc)
        self.name = self.store.get_hostname()  # "host:port": the segment's name in the pool

    def close(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.close()


async def _wait_for_master(ctx: ServiceContext, s: StoreSettings) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + s.connect_timeout_s
    while not ctx.stop.is_set():
        if await asyncio.to_thread(wait_for_master, s.master_addr, 0.5):
            return True
        if loop.time() >= deadline:
            raise PoolError(f"mooncake master {s.master_addr} unreachable for {s.connect_timeout_s} s", -900)
    return False


async def serve(ctx: ServiceContext) -> None:
    s: StoreSettings = ctx.config.store
    plan = plan_hugepages(s.hugepages, s.segment_bytes, meminfo())
    if s.hugepages == "auto" and not plan.use:
        ctx.log.info("continuing without huge pages", reason=plan.reason)
    if not await _wait_for_master(ctx, s):
        return  # stopped while waiting
    segment = await asyncio.to_thread(Segment, s, plan)
    ctx.log.info("segment mounted", segment=segment.name, segment_bytes=segment.segment_bytes,
                 hugepages=plan.use, master=s.master_addr)

    disk = DiskService(ctx, s, segment) if s.disk_path else None
    if disk is not None:
        await disk.start()

    def load_report() -> LoadReport:
        return LoadReport(instance=ctx.instance, role="store", ready=segment.store is not None,
                          capacity_tokens=0, endpoint=segment.name,
                          detail={"segment_bytes": segment.segment_bytes, "hugepages": plan.use,
                                  "segment": segment.name, "master_addr": s.master_addr,
                                  **({"disk": disk.stats()} if disk else {})})

    async def stop() -> None:
        if disk is not None:
            await disk.stop()
        await asyncio.to_thread(segment.close)

    ctx.load_report = load_report
    ctx.on_stop.append(stop)
