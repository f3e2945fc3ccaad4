"""shared/device_staging.py on CPU: pages treated as foreign (`transfer.register_pages` false) go through the
scratch buffer, and every copy gives exactly the bytes (and the CRC) of the kernel called straight into the host
buffer; the scratch is reused across calls and grown only when a larger buffer comes; a host buffer whose bytes
changed after they were packed comes back from the unpack with another CRC than the packed one."""

from __future__ import annotations

import threading

import pytest
import torch

from kernels import get_kv_kernels
from shared.device_staging import SCRATCH_GRAIN, KVStaging, host_buffer, registrable
from shared.handoff_check import checksum
from shared.kv_layout import KVLayout

LAYOUT = KVLayout(num_layers=5, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, stages=2, block_size=16,
                  chunk_tokens=64)
NUM_BLOCKS = 24


def _pages(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYOUT.page_shape(s, NUM_BLOCKS), generator=g).to(LAYOUT.dtype) for s in range(LAYOUT.stages)]


def _table(seed: int) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()


def test_only_host_pages_with_register_pages_are_used_in_place():
    cpu = _pages(0)
    assert registrable(cpu, True) and not registrable(cpu, False)
    assert not registrable([torch.empty(1, device="meta")], True)
    assert KVStaging(cpu).foreign is False and KVStaging(cpu, register_pages=False).foreign is True
    buf = host_buffer(100, "cpu")
    assert buf.dtype == torch.uint8 and buf.numel() == 100 and not buf.is_pinned()


def test_foreign_copies_equal_the_kernels_straight_into_the_host_buffer():
    pages, table = _pages(1), _table(2)
    direct, foreign = KVStaging(pages), KVStaging(pages, register_pages=False)
    assert direct.kernels is foreign.kernels == get_kv_kernels("cpu")
    tb = LAYOUT.bytes_per_token
    n, first = 150, 37  # a window that starts and ends inside a block
    want, got = torch.zeros((n - first) * tb, dtype=torch.uint8), torch.ones((n - first) * tb, dtype=torch.uint8)
    direct.gather(pages, table, n, LAYOUT, want.view(LAYOUT.dtype), first=first)
    foreign.gather(pages, table, n, LAYOUT, got.view(LAYOUT.dtype), first=first)
    assert torch.equal(got, want)

    single = KVLayout(5, 2, 8, dtype=LAYOUT.dtype, block_size=16)  # decode's pages: one stage, every layer
    decode_a, decode_b = (torch.zeros(single.page_shape(0, NUM_BLOCKS), dtype=single.dtype) for _ in range(2))
    KVStaging([decode_a]).scatter(want.view(LAYOUT.dtype), decode_a, table, n - first, first)
    KVStaging([decode_b], register_pages=False).scatter(want.view(LAYOUT.dtype), decode_b, table, n - first, first)
    assert torch.equal(decode_a, decode_b) and decode_a.count_nonzero() > 0

    ids = table[:4]
    for s in range(LAYOUT.stages):
        packed_a = torch.zeros(LAYOUT.chunk_payload_bytes(s), dtype=torch.uint8)
        packed_b = torch.ones_like(packed_a)
        crc_a = direct.pack_crc(pages[s], ids, packed_a.view(LAYOUT.dtype))
        crc_b = foreign.pack_crc(pages[s], ids, packed_b.view(LAYOUT.dtype))
        assert torch.equal(packed_a, packed_b) and crc_a == crc_b == checksum(packed_a)
        into_a, into_b = torch.zeros_like(pages[s]), torch.zeros_like(pages[s])
        assert KVStaging([into_a]).unpack_crc(packed_a.view(LAYOUT.dtype), into_a, table[4:8]) == crc_a
        assert KVStaging([into_b], register_pages=False).unpack_crc(packed_b.view(LAYOUT.dtype), into_b,
                                                                    table[4:8]) == crc_a
        assert torch.equal(into_a, into_b) and torch.equal(into_b[table[4:8]], pages[s][ids])


def test_a_changed_byte_comes_back_as_another_crc():
    pages = _pages(3)
    foreign = KVStaging(pages, register_pages=False)
    packed = torch.empty(LAYOUT.chunk_payload_bytes(0), dtype=torch.uint8)
    crc = foreign.pack_crc(pages[0], [1, 2, 3, 4], packed.view(LAYOUT.dtype))
    packed[packed.numel() // 3] ^= 0x10  # after the checksum: between the put and the restore
    into = torch.zeros_like(pages[0])
    bad = foreign.unpack_crc(packed.view(LAYOUT.dtype), into, [5, 6, 7, 8])
    assert bad != crc and bad == checksum(packed)  # the caller refuses the blocks
    assert bad == get_kv_kernels("cpu").unpack_chunk_crc(packed.view(LAYOUT.dtype), torch.zeros_like(pages[0]),
                                                         [5, 6, 7, 8])


def test_the_scratch_is_reused_and_grows_only_for_a_larger_buffer():
    pages, table = _pages(4), _table(5)
    foreign = KVStaging(pages, register_pages=False)
    tb = LAYOUT.bytes_per_token
    big = 4 * SCRATCH_GRAIN // tb + 3  # tokens: a little over 4 MiB
    seen = []
    for n in (40, 100, 7, big, 100, big - 1):
        out = torch.empty(n * tb, dtype=torch.uint8)
        foreign.gather(pages, table * (big // NUM_BLOCKS // 16 + 1), n, LAYOUT, out.view(LAYOUT.dtype))
        seen.append((foreign._scratch.data_ptr(), foreign._scratch.numel()))
    assert len(set(seen[:3])) == 1 and seen[0][1] == SCRATCH_GRAIN  # small windows: one MiB, allocated once
    assert len(set(seen[3:])) == 1 and seen[3][1] == 5 * SCRATCH_GRAIN  # grown once, in whole MiB, kept


def test_concurrent_foreign_copies_take_turns_on_the_scratch():
    pages, table = _pages(6), _table(7)
    foreign, direct = KVStaging(pages, register_pages=False), KVStaging(pages)
    tb, errors = LAYOUT.bytes_per_token, []

    def worker(w: int) -> None:
        for i in range(30):
            n, first = 40 + (w * 31 + i * 7) % 300, (w + i) % 23
            got, want = (torch.empty((n - first) * tb, dtype=torch.uint8) for _ in range(2))
            foreign.gather(pages, table * 2, n, LAYOUT, got.view(LAYOUT.dtype), first=first)
            direct.gather(pages, table * 2, n, LAYOUT, want.view(LAYOUT.dtype), first=first)
            if not torch.equal(got, want):
                errors.append((w, i))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_host_buffer_must_be_contiguous_host_memory():
    pages = _pages(8)
    foreign = KVStaging(pages, register_pages=False)
    strided = torch.empty(2 * LAYOUT.chunk_payload_bytes(0) // LAYOUT.elem_bytes, dtype=LAYOUT.dtype)[::2]
    with pytest.raises(ValueError, match="contiguous host buffer"):
        foreign.pack_crc(pages[0], [1, 2, 3, 4], strided)
