"""KV copy kernels and the one place that picks a backend for a device.

Every backend is a module exposing four functions with the signatures of `kernels.reference`
(the oracle; always available, any device):
    pack_chunk(pages_s, block_ids, out=None) -> Tensor
    unpack_chunk(buf, pages_s, block_ids) -> None
    gather_for_ranks(stage_pages, block_table, num_tokens, cp, layout, outs=None) -> list[Tensor]
    scatter_from_rank(buf, pages, block_table, num_tokens_rank) -> None

Backends are registered by module path plus an availability predicate, and imported only when
selected, so e.g. triton/aiter are never imported on a CPU host. Auto-selection takes the first
available backend (registration order) serving the device type, falling back to reference.
`MOORAGE_KV_KERNELS=reference|triton|aiter` forces one; if it is unknown, unavailable or does not
serve the device, get_kv_kernels raises instead of silently running something else.

Plugging in a fast backend: add the module (e.g. kernels/triton_kv.py) with the four functions,
make tests compare it against kernels.reference on the device; the entry below already points there.
Until the module exists its predicate is false (find_spec), so nothing changes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV_VAR = "MOORAGE_KV_KERNELS"
_FUNCS = ("pack_chunk", "unpack_chunk", "gather_for_ranks", "scatter_from_rank")


@dataclass(frozen=True)
class KVKernels:
    name: str
    pack_chunk: Callable
    unpack_chunk: Callable
    gather_for_ranks: Callable
    scatter_from_rank: Callable


@dataclass(frozen=True)
class _Backend:
    name: str
    module: str
    device_types: frozenset[str] | None  # None: any device
    available: Callable[[], bool]


def _has(module: str) -> bool:
    """Importable without importing it (find_spec of a submodule only imports its parents)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_REGISTRY: dict[str, _Backend] = {}
_LOADED: dict[str, KVKernels] = {}


def register_backend(name: str, module: str, device_types: tuple[str, ...] | None,
                     available: Callable[[], bool]) -> None:
    """Register (or replace) a backend; earlier registrations win auto-selection."""
    _REGISTRY[name] = _Backend(name, module, None if device_types is None else frozenset(device_types),
                               available)
    _LOADED.pop(name, None)


# ROCm torch reports device type "cuda"; torch.version.hip tells the two apart.
register_backend("aiter", "kernels.aiter_kv", ("cuda",),
                 lambda: torch.version.hip is not None and _has("aiter") and _has("kernels.aiter_kv"))
register_backend("triton", "kernels.triton_kv", ("cuda",),
                 lambda: _has("triton") and _has("kernels.triton_kv"))
register_backend("reference", "kernels.reference", None, lambda: True)


def available_backends(device: torch.device | str) -> list[str]:
    dev_type = torch.device(device).type
    return [b.name for b in _REGISTRY.values() if _serves(b, dev_type) and b.available()]


def _serves(b: _Backend, dev_type: str) -> bool:
    return b.device_types is None or dev_type in b.device_types


def _load(b: _Backend) -> KVKernels:
    if b.name not in _LOADED:
        mod = importlib.import_module(b.module)
        missing = [f for f in _FUNCS if not callable(getattr(mod, f, None))]
        if missing:
            raise ImportError(f"KV kernel backend {b.name!r} ({b.module}) lacks {missing}")
        _LOADED[b.name] = KVKernels(b.name, *(getattr(mod, f) for f in _FUNCS))
    return _LOADED[b.name]


def get_kv_kernels(device: torch.device | str = "cpu") -> KVKernels:
    """The kernels to use for tensors on `device` (honours MOORAGE_KV_KERNELS)."""
    dev_type = torch.device(device).type
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        b = _REGISTRY.get(forced)
        if b is None:
            raise ValueError(f"{ENV_VAR}={forced!r}: unknown backend; known: {sorted(_REGISTRY)}")
        if not _serves(b, dev_type):
            raise ValueError(f"{ENV_VAR}={forced!r} does not serve device type {dev_type!r}")
        if not b.available():
            raise ValueError(f"{ENV_VAR}={forced!r} is not available here (module {b.module} or its "
                             f"dependency is missing)")
        return _load(b)
    for b in _REGISTRY.values():
        if _serves(b, dev_type) and b.available():
            return _load(b)
    return _load(_REGISTRY["reference"])


__all__ = ["ENV_VAR", "KVKernels", "available_backends", "get_kv_kernels", "register_backend"]
