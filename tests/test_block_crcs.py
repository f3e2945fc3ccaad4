"""Handoff CRCs from kept block registers: exactly the CRC-32C of the bytes, and never kept across a
block's next allocation."""

from __future__ import annotations

import ctypes
import random
from pathlib import Path

import crc32c
import pytest
import torch

from kernels import cbuild, cpu_crc, cpu_kv
from shared.block_crcs import BlockCRCs
from shared.engine.block_manager import BlockManager

pytestmark = pytest.mark.skipif(not cpu_kv.available(), reason="needs the C kernel (a C compiler)")


def _pages(n: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 2, 3, 4, 1000), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _crc(pages: torch.Tensor, ids: list[int]) -> int:
    return crc32c.crc32c(torch.cat([pages[i].reshape(-1) for i in ids]).numpy()) if ids else crc32c.crc32c(b"")


def test_block_registers_join_into_the_crc_of_any_sequence_of_blocks():
    pages = _pages()
    bb = pages[0].numel()
    rng = random.Random(1)
    for ids in ([0], [5, 6, 7], list(range(32)), [9, 2, 2, 31], []):
        assert cpu_crc.join_crcs(cpu_crc.block_crcs(pages, ids), bb) == _crc(pages, ids)
    for _ in range(20):
        ids = rng.sample(range(32), rng.randint(1, 32))
        assert cpu_crc.join_crcs(cpu_crc.block_crcs(pages, ids), bb) == _crc(pages, ids)
    small = torch.randint(0, 256, (4, 100), dtype=torch.uint8)  # under the three lanes' minimum
    assert cpu_crc.join_crcs(cpu_crc.block_crcs(small, [3, 1]), 100) == _crc(small, [3, 1])
    with pytest.raises(ValueError):
        cpu_crc.block_crcs(pages, [32])


def test_full_blocks_keep_their_registers_until_allocated_again():
    bm = BlockManager(32, block_size=16)
    pages = _pages()
    crcs = BlockCRCs([pages], bm.generation)
    table = bm.allocate(6)
    b0 = table[0]
    # a run of 4 blocks, the last one partly filled (full = 3)
    assert crcs.run_crc(0, b0, 4, 3) == (_crc(pages, [b0, b0 + 1, b0 + 2, b0 + 3]), 0)
    pages[b0 + 3, 0, 0, 0, :10] += 1  # the partly filled block is written on: never kept, read again
    assert crcs.run_crc(0, b0, 4, 3) == (_crc(pages, [b0, b0 + 1, b0 + 2, b0 + 3]), 3)
    # a bigger run reuses the three, reads the rest
    assert crcs.run_crc(0, b0, 6, 6) == (_crc(pages, list(range(b0, b0 + 6))), 3)
    assert crcs.run_crc(0, b0 + 1, 2, 2) == (_crc(pages, [b0 + 1, b0 + 2]), 2)
    # freed, then allocated to someone who writes new bytes: the kept register is not used
    bm.release(reversed(table))
    again = bm.allocate(32)
    assert b0 in again
    pages[b0].zero_()
    assert crcs.run_crc(0, b0, 1, 1) == (_crc(pages, [b0]), 0)
    assert crcs.reads == 4 + 1 + 3 + 0 + 1 and crcs.reuses == 0 + 3 + 3 + 2 + 0


def test_without_the_kernel_every_write_is_checksummed_whole(monkeypatch):
    monkeypatch.setattr(cpu_crc, "block_crcs", lambda pages, ids: None)
    bm, pages = BlockManager(8, block_size=16), _pages(8)
    crcs = BlockCRCs([pages], bm.generation)
    assert not crcs.enabled
    assert crcs.run_crc(0, 2, 3, 3) == (_crc(pages, [2, 3, 4]), 0)
    assert crcs.run_crc(0, 2, 3, 3) == (_crc(pages, [2, 3, 4]), 0)


def test_the_kernels_crc32c_is_the_crc32c_packages():
    rng = random.Random(2)
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    for n in (0, 1, 7, 8, 255, 256, 767, 768, 769, 4096 * 3 + 5, 3 << 20):
        assert cpu_crc.crc32c(data[:n]) == crc32c.crc32c(data[:n].numpy()), n
    for _ in range(10):  # continued over pieces
        cut = rng.randint(0, data.numel())
        assert cpu_crc.crc32c(data[cut:], cpu_crc.crc32c(data[:cut])) == crc32c.crc32c(data.numpy())
    floats = torch.randn(1001)
    assert cpu_crc.crc32c(floats) == crc32c.crc32c(floats.numpy().tobytes())
    assert cpu_crc.crc32c(data[::2]) is None  # not contiguous: the caller's fallback


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_folded_and_three_lane_crcs_both_equal_the_crc32c_packages():
    """The native build folds with VPCLMULQDQ exactly when the CPU has it (and AVX-512); a build with only
    SSE4.2 takes three lanes of the CRC instruction. Both give crc32c's value at every length around the
    fold's steps (256 and 64 bytes), from any start and any CRC before."""
    flags = _cpu_flags()
    if not {"sse4_2"} <= flags:
        pytest.fail(f"an x86 CPU with SSE4.2 is what this suite runs on; flags: {sorted(flags)[:20]}")
    assert cpu_crc.crc_folds() == ({"avx512f", "vpclmulqdq"} <= flags)
    lanes = cbuild.CKernel("kv_copy_sse42", cpu_kv.KERNEL.source, "moorage_kv_tokens", cpu_kv._TOKENS_ARGS,
                           [["-msse4.2", "-fopenmp-simd"]], base_flags=cbuild.BASE_FLAGS,
                           more={"moorage_crc32c": cpu_kv._CRC32C_ARGS, "moorage_crc_folds": []})
    assert lanes.available() and lanes.symbol_fn("moorage_crc_folds")() == 0

    def three_lanes(buf: torch.Tensor, value: int) -> int:
        crc = ctypes.c_uint32(value)
        assert lanes.symbol_fn("moorage_crc32c")(buf.data_ptr(), buf.numel(), ctypes.byref(crc)) == 0
        return crc.value

    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    rng = random.Random(3)
    lengths = [n + d for n in (64, 256, 512, 768, 1024, 4096) for d in (-1, 0, 1, 63, 64, 65, 255)]
    lengths += [rng.randrange(1 << 20 - 1) for _ in range(20)]
    for n in lengths:
        start = rng.randrange(64)
        piece = data[start:start + n]
        value = rng.choice([0, rng.randrange(1 << 32)])
        want = crc32c.crc32c(piece.numpy(), value=value)
        assert cpu_crc.crc32c(piece, value) == want, (n, start, value)
        assert three_lanes(piece, value) == want, (n, start, value)
