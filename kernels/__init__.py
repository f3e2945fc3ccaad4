"""KV copy and attention kernels, and the one place that picks a backend for a device.

Every backend is a module exposing six functions with the signatures of `kernels.reference`
(the oracle; always available, any device):
    pack_chunk(pages_s, block_ids, out=None) -> Tensor
    unpack_chunk(buf, pages_s, block_ids) -> None
    pack_chunk_crc(pages_s, block_ids, out) -> int       (pack_chunk, and the packed bytes' CRC-32C)
    unpack_chunk_crc(buf, pages_s, block_ids) -> int     (unpack_chunk, and buf's CRC-32C)
    gather_for_ranks(stage_pages, block_table, num_tokens, cp, layout, outs=None) -> list[Tensor]
    scatter_from_rank(buf, pages, block_table, num_tokens_rank) -> None

Backends are registered by module path plus an availability predicate, and imported only when
selected, so e.g. triton is never imported on a CPU host. Auto-selection takes the first
available backend (registration order) serving the device type, falling back to reference (the rules
of every family: kernels/registry.py, one Registry per family below).
`MOORAGE_KV_KERNELS=reference|cpu|triton` forces one; if it is unknown, unavailable or does not
serve the device, get_kv_kernels raises instead of silently running something else.

On CPU, `cpu` (kernels/cpu_kv.py: one strided-copy C routine compiled at first use, no index tensors)
is picked when it builds, else `reference`.

On CUDA (and ROCm, whose torch names its GPUs cuda), `triton` (kernels/triton_kv.py) is picked where triton
imports. Plugging in another backend: add the module with the six functions, register it below, and make
tests compare it against kernels.reference on the device.

Attention kernels are a second family with the same rules: `get_attention_kernels(device)`,
`MOORAGE_ATTN_KERNELS=reference|cpu|triton|aiter` forces one. Every backend exposes the two functions of
`kernels.attention_reference` (paged_decode, paged_prefill; see its docstring). On CPU, `cpu` (a C
kernel compiled at first use, kernels/cpu_attention.py) is picked when it builds, else `reference`.
On CUDA, `triton` (kernels/triton_attention.py), tested against the reference under Triton's interpreter in
make test and on a GPU in tests/gpu. On ROCm (a torch with torch.version.hip), `aiter`
(kernels/aiter_attention.py: AITER's Triton unified attention, reading moorage's pages in place) where AITER
is installed, else `triton`; AITER's kernel source is tested under the interpreter in make test, and has not
run on ROCm hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.registry import Registry
from kernels.registry import has_module as _has

ENV_VAR = "MOORAGE_KV_KERNELS"
ATTN_ENV_VAR = "MOORAGE_ATTN_KERNELS"


@dataclass(frozen=True)
class KVKernels:
    name: str
    pack_chunk: Callable
    unpack_chunk: Callable
    pack_chunk_crc: Callable
    unpack_chunk_crc: Callable
    gather_for_ranks: Callable
    scatter_from_rank: Callable


@dataclass(frozen=True)
class AttentionKernels:
    name: str
    paged_decode: Callable
    paged_prefill: Callable


_KV: Registry[KVKernels] = Registry(KVKernels, ENV_VAR, "KV kernel backend")
_ATTN: Registry[AttentionKernels] = Registry(AttentionKernels, ATTN_ENV_VAR, "attention backend")
# the registries' tables by their former names (tests register and drop a fake backend)
_REGISTRY, _LOADED = _KV.backends, _KV.loaded
_ATTN_REGISTRY, _ATTN_LOADED = _ATTN.backends, _ATTN.loaded


def register_backend(name: str, module: str, device_types: tuple[str, ...] | None,
                     available: Callable[[], bool]) -> None:
    """Register (or replace) a KV copy backend; earlier registrations win auto-selection."""
    _KV.register(name, module, device_types, available)


def register_attention_backend(name: str, module: str, device_types: tuple[str, ...] | None,
                               available: Callable[[], bool]) -> None:
    """Register (or replace) an attention backend; earlier registrations win auto-selection."""
    _ATTN.register(name, module, device_types, available)


def available_backends(device: torch.device | str) -> list[str]:
    return _KV.available(device)


def available_attention_backends(device: torch.device | str) -> list[str]:
    return _ATTN.available(device)


def get_kv_kernels(device: torch.device | str = "cpu") -> KVKernels:
    """The kernels to use for tensors on `device` (honours MOORAGE_KV_KERNELS)."""
    return _KV.get(device)


def get_attention_kernels(device: torch.device | str = "cpu") -> AttentionKernels:
    """The paged attention to use for tensors on `device` (honours MOORAGE_ATTN_KERNELS)."""
    return _ATTN.get(device)


def _cpu_kv_available() -> bool:
    from kernels import cpu_kv  # ctypes only; builds (or finds the cached .so) once per process

    return cpu_kv.available()


def _cpu_attention_available() -> bool:
    from kernels import cpu_attention  # ctypes only; builds (or finds the cached .so) once per process

    return cpu_attention.available()


def _rocm() -> bool:
    """A ROCm build of torch (it names its GPUs "cuda", like a CUDA build)."""
    return bool(getattr(torch.version, "hip", None))


# The registry names only modules that exist. On ROCm the KV copies take triton_kv (AITER has no kernel for
# moorage's chunk layout); attention takes AITER's unified attention first (kernels/aiter_attention.py).
register_backend("triton", "kernels.triton_kv", ("cuda",),
                 lambda: _has("triton") and _has("kernels.triton_kv"))
register_backend("cpu", "kernels.cpu_kv", ("cpu",), lambda: _cpu_kv_available())
register_backend("reference", "kernels.reference", None, lambda: True)

register_attention_backend("aiter", "kernels.aiter_attention", ("cuda",),
                           lambda: _rocm() and _has("aiter") and _has("triton") and _has("kernels.aiter_attention"))
register_attention_backend("triton", "kernels.triton_attention", ("cuda",),
                           lambda: _has("triton") and _has("kernels.triton_attention"))
register_attention_backend("cpu", "kernels.cpu_attention", ("cpu",), _cpu_attention_available)
register_attention_backend("reference", "kernels.attention_reference", None, lambda: True)


__all__ = ["ATTN_ENV_VAR", "ENV_VAR", "AttentionKernels", "KVKernels", "available_attention_backends",
           "available_backends", "get_attention_kernels", "get_kv_kernels", "register_attention_backend",
           "register_backend"]
