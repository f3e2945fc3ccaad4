"""Paged decode attention for CPUs: a small C kernel (kernels/csrc/paged_attention.c) compiled at first use,
called through ctypes.

Reads K/V straight from the block-major pages through the block tables (no per-step copy of the
context): online softmax across blocks, batched over sequences, split-K over the context
(flash-decoding: work items = sequence x partition of blocks, combined at the end), GQA without
repeating K/V, float32 or bfloat16 pages, float32 math. OpenMP threads = torch.get_num_threads(); the
.so links libgomp.so.1, which resolves to the copy torch already loaded, so both share one runtime.

Build: the system C compiler ($CC, else cc/gcc/clang) with -O3 -march=native -fopenmp (then without
OpenMP, then without -march=native), cached by a hash of source + flags + compiler + CPU under
$MOORAGE_KERNEL_CACHE (default $XDG_CACHE_HOME/moorage/kernels or ~/.cache/moorage/kernels; a per-user
temp dir when that is not writable); built in a temp dir then renamed, so concurrent processes never
load a half-written .so. No compiler, or no build that loads: `available()` is False and
kernels.get_attention_kernels falls back to the torch reference (a warning is logged once).

Measured (SmolLM2-135M layout, 30 layers, fp32, 2 cores): all 30 layers' decode attention at 4.5K
context, batch 1, ~17 ms (2 threads) vs ~140 ms for the gather + SDPA reference; within ~1.5x of
streaming the same bytes once.

Prefill stays on the torch path (`paged_prefill` is the reference's): SDPA's CPU flash kernel is
GEMM-bound there and a hand-written one would not beat it.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import attention_reference as _ref
from kernels.cbuild import BASE_FLAGS, CACHE_ENV, CSRC, FLAG_SETS, CKernel  # noqa: F401 (CACHE_ENV: re-exported)

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _INT, _I64, _I64, _I64, _PTR, _I64, _PTR, _INT, _INT, _INT, _INT, _INT,
             _I64, ctypes.c_float, _INT, _INT, _PTR]
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_G, _MAX_D, _MAX_BS = 64, 256, 128  # as in the C source (and block_size % 8 == 0)

KERNEL = CKernel("paged_attention", CSRC / "paged_attention.c", "moorage_paged_decode", _ARGTYPES,
                 list(FLAG_SETS), base_flags=list(BASE_FLAGS), libs=["-lm"], what="CPU paged attention kernel")
_load, available = KERNEL.load, KERNEL.available


def supports(q: torch.Tensor, pages: torch.Tensor) -> bool:
    """Shapes and dtypes the C kernel handles; anything else goes to the torch reference."""
    if q.device.type != "cpu" or pages.device.type != "cpu" or pages.dtype not in _KV_DTYPES or pages.dim() != 6:
        return False
    _, _, _, bs, hkv, d = pages.shape
    hq = q.shape[1]
    return (hkv > 0 and hq % hkv == 0 and hq // hkv <= _MAX_G and 0 < d <= _MAX_D and d % 8 == 0
            and bs <= _MAX_BS and bs % 8 == 0 and pages.stride(-1) == 1 and pages.stride(-2) == d)


# Blocks per work item (split-K partition). Fixed, so results do not depend on the thread count;
# small enough that one sequence at 512 tokens already splits in 4, large enough that combining the
# partitions costs ~1% of the item.
PART_BLOCKS = 8


def paged_decode(q: torch.Tensor, pages: torch.Tensor, local_layer: int, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    if not supports(q, pages):
        return _ref.paged_decode(q, pages, local_layer, block_tables, ctx_lens, scale, window)
    fn = _load()
    qf = q.to(torch.float32).contiguous()
    bt = block_tables.to(torch.int64).contiguous()
    lens = ctx_lens.to(torch.int64).contiguous()
    B, Hq, D = qf.shape
    N, _, _, BS, Hkv, _ = pages.shape
    if bt.dim() != 2 or bt.shape[0] != B or lens.shape != (B,):
        raise ValueError(f"block tables {tuple(bt.shape)} / lengths {tuple(lens.shape)} do not match batch {B}")
    out = torch.empty_like(qf)
    st, es = pages.stride(), pages.element_size()
    k = pages.data_ptr() + local_layer * st[1] * es
    threads = torch.get_num_threads()
    starts = (lens - window).clamp_(min=0).contiguous() if window else None
    rc = fn(qf.data_ptr(), out.data_ptr(), k, k + st[2] * es, _KV_DTYPES[pages.dtype], st[0], st[3], st[4],
            bt.data_ptr(), bt.shape[1], lens.data_ptr(), B, Hq, Hkv, D, BS, N, float(scale), threads, PART_BLOCKS,
            None if starts is None else starts.data_ptr())
    if rc != 0:
        raise ValueError({-1: "unsupported shape", -2: "context length <= 0 or beyond the block table",
                          -3: "out of memory", -4: "block id out of range",
                          -5: "window start outside the context"}.get(rc, f"error {rc}"))
    return out if q.dtype == torch.float32 else out.to(q.dtype)


paged_prefill = _ref.paged_prefill
