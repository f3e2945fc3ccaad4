"""shared/device_staging.py on a GPU: KV between CUDA pages and pinned host buffers through the device scratch on
the copy stream, byte for byte the reference's. The stream handling is what is checked: a copy sees the pages as
the engine's stream left them (work queued there before the call, not yet run), and a call's host bytes are final,
or no longer read, the moment it returns (nothing synchronizes in between here)."""

from __future__ import annotations

import pytest
import torch

from bench.attention_device import cuda_seconds
from kernels import reference as ref
from shared.device_staging import KVStaging, host_buffer
from shared.handoff_check import checksum
from shared.kv_layout import KVLayout, allocate_pages

pytestmark = pytest.mark.gpu


def _busy_default_stream() -> None:
    """Queue a few ms of work on the default stream, so what is queued after it has not run when the call starts."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        a = a @ a
        a /= a.norm()


def test_staged_copies_follow_the_engine_stream_and_finish_before_returning(report):
    layout = KVLayout(30, 3, 64, dtype=torch.bfloat16, stages=2)
    pages = allocate_pages(layout, 2048, "cuda")
    staging = KVStaging(pages)
    assert staging.foreign
    table = torch.randperm(2048)[:512].tolist()
    n = 8000
    _busy_default_stream()
    for p in pages:  # the engine's writes, still queued behind the busy work when the gather starts
        p.copy_(torch.randn(p.shape, device="cuda").to(p.dtype))
    out = host_buffer(n * layout.bytes_per_token, "cuda")
    assert out.is_pinned()
    staging.gather(pages, table, n, layout, out.view(layout.dtype))
    got = out.clone()  # a host copy at once: no synchronize before it
    want = ref.gather_for_ranks(pages, table, n, 1, layout)[0]
    assert torch.equal(got.view(layout.dtype).view(want.shape).cuda(), want)

    single = KVLayout(30, 3, 64, dtype=torch.bfloat16)
    landed = allocate_pages(single, 2048, "cuda")[0]
    decode = KVStaging([landed])
    _busy_default_stream()
    decode.scatter(out.view(layout.dtype), landed, table, n)
    out.zero_()  # the slot is reused at once: the scatter must have read it already
    expect = torch.zeros_like(landed)
    ref.scatter_from_rank(want, expect, table, n)
    assert torch.equal(landed, expect)

    ids = table[:16]
    payload = host_buffer(16 * layout.stage_block_bytes(1), "cuda")
    crc = staging.pack_crc(pages[1], ids, payload.view(layout.dtype))
    packed = payload.clone()
    assert crc == checksum(packed) and torch.equal(packed.view(layout.dtype).cuda(),
                                                   ref.pack_chunk(pages[1], ids).flatten())
    back = torch.zeros_like(pages[1])
    assert staging.unpack_crc(payload.view(layout.dtype), back, table[16:32]) == crc
    payload.zero_()
    assert torch.equal(back[table[16:32]], pages[1][ids])

    staged = cuda_seconds(lambda: staging.gather(pages, table, n, layout, out.view(layout.dtype)), reps=20, runs=1)
    src = torch.empty(out.numel(), dtype=torch.uint8, device="cuda")
    bare = cuda_seconds(lambda: out.copy_(src, non_blocking=True), reps=20, runs=1)
    gb = out.numel() / 1e9
    report(bytes_mb=round(gb * 1e3), staged_gather_gbs=round(gb / staged, 1), bare_d2h_gbs=round(gb / bare, 1),
           scratch_mb=staging._scratch.numel() >> 20, kernels=staging.kernels.name)
