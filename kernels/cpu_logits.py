"""The output projection for a few rows on CPUs: a small C kernel (kernels/csrc/logits.c) compiled at first
use (kernels/cbuild.py), called through ctypes.

`logits(hidden, weight)` = F.linear(hidden, weight) for float32 [R, K] rows, 4 <= R <= 12: a decode step's
rows, or a prefill's sampled ones. torch's BLAS packs the weight for a GEMM of a few rows and reads it
several times; the kernel reads each weight row once. Measured here (2 cores, ms, torch / kernel):

    rows                       2          4          8          12         16
    Gemma 3, 262144 x 640      29 / 32    56 / 40    90 / 44    126 / 52   59 / 61
    SmolLM2, 49152 x 576       3.7 / 3.6  6.1 / 4.4  10 / 6.1   13 / 7.6   7.9 / 9.4
    Qwen 2.5, 151936 x 896     22 / 23    63 / 27    64 / 31    64 / 37    62 / 43

so other row counts stay with torch (one row: its matrix-vector path already streams the weight once).
Sums run in a fixed order, so results do not depend on the thread count; they differ from BLAS's in the
last bits, as BLAS's own do between row counts.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cbuild import BASE_FLAGS, CSRC, FLAG_SETS, CKernel

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
KERNEL = CKernel("logits", CSRC / "logits.c", "moorage_logits_f32", [_PTR, _PTR, _PTR, _I64, _I64, _I64, _INT],
                 list(FLAG_SETS), base_flags=list(BASE_FLAGS), what="CPU output projection kernel")
available = KERNEL.available
MIN_ROWS, MAX_ROWS, LANES = 4, 12, 8  # where the kernel beats torch here (the C source takes 1-64 rows)


def _operands_ok(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """float32 CPU [R, K] x contiguous [V, K]: what the C source may be handed at all."""
    return (hidden.dim() == 2 and weight.dim() == 2 and hidden.dtype == weight.dtype == torch.float32
            and hidden.device.type == weight.device.type == "cpu" and hidden.shape[1] == weight.shape[1]
            and weight.is_contiguous())


def supports(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes it runs: float32 CPU tensors, a contiguous weight, 4..12 rows, K a multiple of 8."""
    return (_operands_ok(hidden, weight) and MIN_ROWS <= hidden.shape[0] <= MAX_ROWS
            and hidden.shape[1] % LANES == 0 and available())


def kernel(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The C kernel itself, for any 1..64 rows (`logits` picks when to use it); ValueError for shapes it
    does not take."""
    if not _operands_ok(hidden, weight):
        raise ValueError(f"logits kernel: float32 CPU [R, K] x contiguous [V, K], got {hidden.dtype} "
                         f"{tuple(hidden.shape)} x {weight.dtype} {tuple(weight.shape)}")
    h = hidden.contiguous()
    out = torch.empty(h.shape[0], weight.shape[0], dtype=torch.float32)
    rc = KERNEL.load()(weight.data_ptr(), h.data_ptr(), out.data_ptr(), weight.shape[0], weight.shape[1],
                       h.shape[0], torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"logits kernel: {h.shape[0]} rows of {h.shape[1]} (1-64 rows, K a multiple of {LANES})")
    return out


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [R, K] x weight [V, K] -> [R, V] float32 (F.linear without bias), through the kernel when it
    runs these shapes, else torch."""
    if supports(hidden, weight):
        return kernel(hidden, weight)
    return torch.nn.functional.linear(hidden, weight).float()
