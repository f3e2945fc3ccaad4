"""The systems a replay runs against: topologies (`<pool mode>[-<routing>]`) as `moorage up` overrides,
device and decode KV sized from the traces, and a context manager that starts and stops one."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator, Sequence

from bench.agentic.trace import iter_requests


def up_supports(*names: str) -> bool:
    from infra.up import UpSettings

    have = {f.name for f in dataclasses.fields(UpSettings)}
    return all(n in have for n in names)


TOPOLOGY_HELP = "<none|split|shared>[-<cache-aware|sticky|p2c>]"


def topology_overrides(topology: str, groups: int = 1, device_blocks: int = 0, store_bytes: int = 0,
                       decode_blocks: int = 0, stores: int = 0, model: str = "tiny") -> tuple[list[str], list[str]]:
    """(UpConfig overrides, notes) for a topology `<pool mode>[-<routing>]` (none, split, shared,
    shared-p2c, shared-sticky, none-p2c, ...; routing defaults to cache-aware) on `groups` groups, serving
    `model` (tiny, smollm2-135m, ...)."""
    mode, _, routing = topology.partition("-")
    routing = routing or "cache-aware"
    if mode not in ("none", "split", "shared") or routing not in ("cache-aware", "sticky", "p2c"):
        raise ValueError(f"unknown topology {topology!r}: {TOPOLOGY_HELP}")
    notes: list[str] = []
    sets = [f"up.model={model}", f"up.pool={'false' if mode == 'none' else 'true'}",
            f"router.router.routing={routing}"]
    if up_supports("groups", "pool_mode"):
        sets.append(f"up.groups={groups}")
        if mode != "none":
            sets.append(f"up.pool_mode={mode}")
    else:
        if mode == "split":
            raise ValueError("this Launcher has no up.pool_mode: the split topology needs up.groups / up.pool_mode")
        if groups > 1:
            sets.append(f"up.prefills={groups}")
            notes.append(f"Launcher without up.groups: {groups} prefills behind one decode and one pool instead")
    if device_blocks:
        sets.append(f"prefill.engine.num_blocks={device_blocks}")
    if decode_blocks:
        sets.append(f"decode.engine.num_blocks={decode_blocks}")
    if mode != "none":
        if store_bytes:
            sets.append(f"up.store_bytes={store_bytes}")
        if stores:
            sets.append(f"up.stores={stores}")
    return sets, notes


@contextlib.contextmanager
def running_system(overrides: Sequence[str], run_dir: str | os.PathLike,
                   ready_timeout_s: float = 180.0) -> Iterator[str]:
    """Start moorage (infra.up.Launcher) with `overrides` on a free port; yield its URL; stop it."""
    from shared.config import load_config
    from infra.up import UpConfig, launched

    cfg = load_config(UpConfig, overrides=["up.port=0", f"up.run_dir={run_dir}",
                                           f"up.ready_timeout_s={ready_timeout_s}", *overrides])
    with launched(cfg) as (_, url):
        yield url


def add_system_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=1, help="groups of prefill + stores + decode (up.groups)")
    p.add_argument("--device-blocks", type=int, default=0,
                   help="device KV blocks (16 tokens) per prefill (prefill.engine.num_blocks); 0 = from the "
                        "traces, see --device-fraction")
    p.add_argument("--device-fraction", type=float, default=0.15,
                   help="with --device-blocks 0: device KV of all prefills together = this x the distinct "
                        "prompt tokens of the traces (at least the longest request), so device memory alone "
                        "holds well under the ceiling (default %(default)s)")
    p.add_argument("--device-min-prompts", type=float, default=1.0,
                   help="with --device-blocks 0: device KV per prefill holds at least this many of the longest "
                        "prompt (a pool restore needs free device blocks next to the prompts in flight; "
                        "default %(default)s)")
    p.add_argument("--decode-blocks", type=int, default=0, help="decode KV blocks (0 = from the traces)")
    p.add_argument("--chunk-tokens", type=int, default=64,
                   help="pool chunk size in tokens (prefill.engine.chunk_tokens; production default 256). The "
                        "bench corpus scales contexts ~50x down; a 256-token chunk would then leave a partial "
                        "chunk worth ~5%% of every prompt out of the pool, so the chunk shrinks to the trace "
                        "block size (default %(default)s)")
    p.add_argument("--stores", type=int, default=1, help="store services per group (up.stores)")
    p.add_argument("--store-bytes", type=int, default=256 << 20, help="DRAM per store service, bytes "
                                                                     "(up.store_bytes; default %(default)s)")
    p.add_argument("--run-dir", default=".moorage/bench", help="configs and logs of the systems started")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra UpConfig override for the systems started (repeatable)")


def auto_blocks(sessions: list, groups: int, fraction: float, concurrency: int,
                block_tokens: int = 16, min_prompts: float = 1.0) -> tuple[int, int]:
    """(device blocks per prefill, decode blocks), sized from the traces: device KV across all prefills
    holds `fraction` of the distinct prompt tokens (the perfect cache's working set) but never less than
    the longest request x max(`min_prompts`, the requests in flight per group); decode holds 4 x `concurrency` of the longest sequences (subagents
    run alongside)."""
    reqs = [r for s in sessions for _, r in iter_requests(s)]
    longest = max((r.in_tokens + r.out_tokens for r in reqs), default=1024) + 64  # + template and tag
    distinct_tokens = 0
    seen = set()
    for s in sessions:
        ns = "" if s.hash_id_scope == "global" else s.id
        for _, r in iter_requests(s):
            for h in r.hash_ids:
                if (ns, h) not in seen:
                    seen.add((ns, h))
                    distinct_tokens += s.block_size
    # a restore needs free blocks beside the prompts in flight on the same prefill: with too few, every
    # restore waits `restore_wait_s` and then computes anyway (seen with 2 in flight and room for 1)
    in_flight = max(min_prompts, math.ceil(concurrency / max(1, groups)))
    need = math.ceil(in_flight * longest / block_tokens) + 2
    device = max(need, math.ceil(fraction * distinct_tokens / block_tokens / max(1, groups)))
    decode = max(256, 4 * concurrency * math.ceil(longest / block_tokens))
    return device, decode


def system_overrides(args: argparse.Namespace, topology: str, sessions: list,
                     concurrency: int) -> tuple[list[str], list[str]]:
    device, decode = auto_blocks(sessions, args.groups, args.device_fraction, concurrency,
                                 min_prompts=args.device_min_prompts)
    sets, notes = topology_overrides(topology, args.groups, args.device_blocks or device, args.store_bytes,
                                     args.decode_blocks or decode, args.stores, getattr(args, "model", "tiny"))
    if not topology.startswith("none"):  # same bytes per batched read as 4 chunks of 256 tokens
        sets += [f"prefill.engine.chunk_tokens={args.chunk_tokens}",
                 f"prefill.pool.restore_batch_chunks={max(4, 1024 // args.chunk_tokens)}"]
    return sets + list(args.set), notes
