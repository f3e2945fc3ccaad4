"""One family of kernel backends (KV copies, attention, ...): which module serves which device, and which
one a device gets. kernels/__init__.py holds one Registry per family; the rules are the same for all.

A backend is a module path plus an availability predicate, imported only when selected (so triton/aiter
are never imported on a CPU host) and checked then for every function of its family (the fields of the
family's frozen dataclass past `name`). Auto-selection takes the first available backend, in
registration order, serving the device type, falling back to `reference`; one that fails to import
there (AITER's HIP set-up on a ROCm install it does not support, say) is logged as a warning and passed
over for good. The family's environment variable forces one; if it is unknown, unavailable, does not serve
the device or fails to import, `get` raises instead of silently running something else.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

log = logging.getLogger(__name__)
K = TypeVar("K")  # a family's frozen dataclass: name, then its functions


@dataclass(frozen=True)
class Backend:
    name: str
    module: str
    device_types: frozenset[str] | None  # None: any device
    available: Callable[[], bool]

    def serves(self, dev_type: str) -> bool:
        return self.device_types is None or dev_type in self.device_types


def has_module(module: str) -> bool:
    """Importable without importing it (find_spec of a submodule only imports its parents)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class Registry(Generic[K]):
    """The backends of one family, in registration order, and the ones loaded so far (once per process)."""

    def __init__(self, kernels: type[K], env_var: str, what: str):
        self.kernels, self.env_var, self.what = kernels, env_var, what  # what: "KV kernel backend", in errors
        self.funcs = tuple(f.name for f in dataclasses.fields(kernels) if f.name != "name")
        self.backends: dict[str, Backend] = {}
        self.loaded: dict[str, K] = {}
        self.broken: dict[str, str] = {}  # auto-selected backends whose import failed (name -> why): never retried

    def register(self, name: str, module: str, device_types: tuple[str, ...] | None,
                 available: Callable[[], bool]) -> None:
        """Register (or replace) a backend; earlier registrations win auto-selection."""
        self.backends[name] = Backend(name, module, None if device_types is None else frozenset(device_types),
                                      available)
        self.loaded.pop(name, None)
        self.broken.pop(name, None)

    def available(self, device: torch.device | str) -> list[str]:
        dev_type = torch.device(device).type
        return [b.name for b in self.backends.values()
                if b.serves(dev_type) and b.available() and b.name not in self.broken]

    def load(self, b: Backend) -> K:
        if b.name not in self.loaded:
            mod = importlib.import_module(b.module)
            missing = [f for f in self.funcs if not callable(getattr(mod, f, None))]
            if missing:
                raise ImportError(f"{self.what} {b.name!r} ({b.module}) lacks {missing}")
            self.loaded[b.name] = self.kernels(b.name, *(getattr(mod, f) for f in self.funcs))
        return self.loaded[b.name]

    def get(self, device: torch.device | str) -> K:
        """The backend for tensors on `device` (honours the family's environment variable)."""
        dev_type = torch.device(device).type
        forced = os.environ.get(self.env_var, "").strip().lower()
        if forced:
            b = self.backends.get(forced)
            if b is None:
                raise ValueError(f"{self.env_var}={forced!r}: unknown backend; known: {sorted(self.backends)}")
            if not b.serves(dev_type):
                raise ValueError(f"{self.env_var}={forced!r} does not serve device type {dev_type!r}")
            if not b.available():
                raise ValueError(f"{self.env_var}={forced!r} is not available here (module {b.module} or its "
                                 f"dependency is missing, or it did not build)")
            return self.load(b)
        for b in self.backends.values():
            if b.serves(dev_type) and b.available() and b.name not in self.broken:
                try:
                    return self.load(b)
                except Exception as e:  # noqa: BLE001 - e.g. AITER's HIP set-up failing on this ROCm install
                    if b.name == "reference":
                        raise
                    self.broken[b.name] = f"{type(e).__name__}: {e}"
                    log.warning("%s %r (%s) failed to import, so the next one serves %s: %s", self.what, b.name,
                                b.module, dev_type, self.broken[b.name])
        return self.load(self.backends["reference"])
