"""CRC-32C of bytes in place, for CPUs: the read-only CRC routines of the KV copy library
(kernels/csrc/kv_copy.c, built and loaded by kernels/cpu_kv.py: one library, as the copies compute the same
CRC while they copy), called through ctypes.

Handoff and restore checks read a landing slot's or a pool object's bytes once more to checksum them
(`crc32c`), and a handoff of blocks that have not changed since the last one joins per-block registers
(`block_crcs` once per block, `join_crcs` per run: shared/block_crcs.py) instead of reading them again.
The C code folds 64 bytes per carry-less multiply pair where the CPU has AVX-512 VPCLMULQDQ (`crc_folds`),
about 3x the CRC instruction's rate on cached bytes; else three interleaved chains of the instruction.
`block_crcs` and `crc32c` answer None (`crc_folds` False) where this build cannot (no compiler, no CRC
instruction, a non-contiguous tensor): the caller falls back to the `crc32c` package. `kernels.cpu_kv.threads` caps the
threads of `block_crcs` as it does the copies'.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import cpu_kv
from kernels.reference import IndexLike


def block_crcs(pages: torch.Tensor, block_ids: IndexLike) -> list[int] | None:
    """Each block's raw CRC-32C register (from 0, no inversion; `join_crcs` turns runs of them into a CRC),
    read in place; None when this build cannot (no compiler or CRC instruction, odd pages). pages: a
    contiguous CPU tensor, one block per index of its first dimension. ValueError for an id out of range."""
    ids = cpu_kv._ids(block_ids)
    if ids is None or not pages.is_cpu or not pages.is_contiguous() or pages.dim() < 1 or not cpu_kv.available():
        return None
    raw = (ctypes.c_uint32 * ids[1])()
    block_bytes = pages[0].numel() * pages.element_size() if pages.shape[0] else 0
    rc = cpu_kv.KERNEL.symbol_fn("moorage_crc_blocks")(pages.data_ptr(), ids[0], ids[1], pages.shape[0], block_bytes,
                                                       raw, cpu_kv.MIN_SPLIT_BYTES, cpu_kv._nthreads())
    if rc == -2:
        raise ValueError(f"a block id is out of range 0..{pages.shape[0] - 1}")
    return list(raw) if rc == 0 else None


def crc32c(buf: torch.Tensor, value: int = 0) -> int | None:
    """CRC-32C of a contiguous CPU tensor's bytes, continuing `value` (the CRC of the bytes before), read in
    place on this thread; None when this build cannot. Folded with VPCLMULQDQ where the CPU has it
    (`crc_folds`), else three lanes of the CRC instruction. Measured on one core of the 2-core EPYC (Zen 4)
    dev box: 8 MiB in cache 0.19 ms folded against 0.55 ms in three lanes; 94 MiB from memory 5.5 against
    8.4 ms (the fold is memory-bound there)."""
    if not buf.is_cpu or not buf.is_contiguous() or not cpu_kv.available():
        return None
    crc = ctypes.c_uint32(value)
    fn = cpu_kv.KERNEL.symbol_fn("moorage_crc32c")
    rc = fn(buf.data_ptr(), buf.numel() * buf.element_size(), ctypes.byref(crc))
    return crc.value if rc == 0 else None


def crc_folds() -> bool:
    """Whether this build's CRC-32C folds with carry-less multiplication (AVX-512 VPCLMULQDQ)."""
    return cpu_kv.available() and bool(cpu_kv.KERNEL.symbol_fn("moorage_crc_folds")())


def join_crcs(raw: list[int], block_bytes: int) -> int:
    """The CRC-32C of blocks of block_bytes each, in this order, from their raw registers (block_crcs)."""
    regs, crc = (ctypes.c_uint32 * len(raw))(*raw), ctypes.c_uint32()
    if cpu_kv.KERNEL.symbol_fn("moorage_crc_join")(regs, len(raw), block_bytes, ctypes.byref(crc)) != 0:
        raise ValueError(f"bad sizes: {len(raw)} blocks of {block_bytes} bytes")
    return crc.value
