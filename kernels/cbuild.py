"""A C function compiled at first use by the system compiler and loaded with ctypes: the build and cache
every CPU kernel here shares (kernels/cpu_attention.py, kernels/cpu_kv.py).

The C sources are files of their own, kernels/csrc/*.c (a C editor, compiler warnings and diffs see C, not
a Python string); a kernel reads its file when it builds. The shared object is cached under
`MOORAGE_KERNEL_CACHE` (default `~/.cache/moorage/kernels`, or a per-user temp dir when home is read-only),
keyed by the source's text, flags, compiler, its version and the CPU (-march=native code runs only on the
CPU it was built for), so an edited .c builds anew. Flag sets are tried in order until one builds and
loads; when none does (no compiler, or the .c missing from an install, say), `load()` raises RuntimeError
and the caller uses its torch reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "MOORAGE_KERNEL_CACHE"
CSRC = Path(__file__).resolve().parent / "csrc"  # the kernels' C sources
BASE_FLAGS = ["-O3", "-fno-math-errno", "-fPIC", "-shared"]
# tried in order: the first that compiles and loads wins (no -march=native: a compiler that lacks it; no
# -fopenmp: a compiler without OpenMP, one thread)
FLAG_SETS = (["-march=native", "-fopenmp"], ["-march=native", "-fopenmp-simd"], ["-fopenmp"], ["-fopenmp-simd"])


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moorage" / "kernels"


def compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def cpu_id() -> str:
    """-march=native code only runs on the CPU it was built for: the cache key names the CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


@dataclass
class CKernel:
    name: str                      # the .so file stem (and the built .c's)
    source: Path                   # the C source file, read at each build
    symbol: str                    # the C function to load
    argtypes: list
    flag_sets: list[list[str]]     # each appended to base_flags, tried in order
    base_flags: list[str] = field(default_factory=lambda: list(BASE_FLAGS))
    libs: list[str] = field(default_factory=list)  # e.g. ["-lm"], after the source
    what: str = "CPU kernel"       # for messages
    more: dict[str, list] = field(default_factory=dict)  # further symbols of the same library: name -> argtypes
    flags: str = ""                # the flags the loaded build used
    _fn: object = None
    _fns: dict = field(default_factory=dict)  # the `more` functions, once loaded
    _error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def build(self, cc: str, flags: list[str]) -> Path:
        text = self.source.read_text(encoding="utf-8")  # once: the text hashed is the text compiled
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([text, " ".join(flags), cc, version, cpu_id()]).encode()).hexdigest()[:16]
        out = cache_dir() / f"{self.name}-{key}.so"
        if out.exists():
            return out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(out.parent, os.W_OK):
                raise PermissionError(out.parent)
        except OSError:  # read-only home (containers): a per-user temp dir
            uid = os.getuid() if hasattr(os, "getuid") else 0
            out = Path(tempfile.gettempdir()) / f"moorage-kernels-{uid}" / out.name
            if out.exists():
                return out
            out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src = Path(tmp) / f"{self.name}.c"
            src.write_text(text, encoding="utf-8")
            so = Path(tmp) / out.name
            r = subprocess.run([cc, *flags, str(src), "-o", str(so), *self.libs], capture_output=True, text=True,
                               timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} {' '.join(flags)} failed: {r.stderr.strip()[-2000:]}")
            os.replace(so, out)
        return out

    def reset(self) -> None:
        """Forget the loaded function (or the failure): the next load() looks again (tests)."""
        with self._lock:
            self._fn, self._error, self.flags = None, None, ""
            self._fns = {}

    def available(self) -> bool:
        try:
            self.load()
            return True
        except RuntimeError:
            return False

    def load(self):
        """The ctypes function, building it if needed (once per process); RuntimeError when unavailable."""
        if self._fn is None and self._error is None:
            with self._lock:
                if self._fn is None and self._error is None:
                    self._try_builds()
        if self._fn is None:
            raise RuntimeError(f"{self.what} unavailable: {self._error}")
        return self._fn

    def symbol_fn(self, name: str):
        """One of the `more` functions (loading the library if needed); RuntimeError when unavailable."""
        fn = self._fns.get(name)
        if fn is None:
            self.load()
            fn = self._fns[name]
        return fn

    def _try_builds(self) -> None:
        errors, cc = [], compiler()
        if cc is None:
            errors.append("no C compiler (set CC or install gcc)")
        for extra in self.flag_sets if cc else ():
            flags = self.base_flags + extra
            try:
                lib = ctypes.CDLL(str(self.build(cc, flags)))
                fns = {}
                for name, argtypes in [(self.symbol, self.argtypes), *self.more.items()]:
                    fns[name] = getattr(lib, name)
                    fns[name].restype, fns[name].argtypes = ctypes.c_int, argtypes
                self._fns = {k: v for k, v in fns.items() if k != self.symbol}
                self._fn, self.flags = fns[self.symbol], " ".join(flags)
                return
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                errors.append(str(e))
        self._error = "; ".join(errors)
        log.warning("%s unavailable, using the torch reference: %s", self.what, self._error)
