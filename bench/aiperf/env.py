"""AIPerf's own venv: created on first use with `python3 -m venv` + `pip install aiperf==0.13.* gguf`.

It is kept apart from the project's .venv: AIPerf brings transformers 5.x, its own pins and ~1.2 GB. A
marker file records what was installed, so a later run reuses the venv without asking pip again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

AIPERF_SPEC = "aiperf==0.13.*"
PACKAGES = (AIPERF_SPEC, "gguf")  # gguf: read the model's tokenizer metadata without torch
DEFAULT_VENV = ".venv-aiperf"
MARKER = ".moorage-aiperf"


def venv_python(venv: str | Path) -> Path:
    return Path(venv) / "bin" / "python"


def aiperf_exe(venv: str | Path) -> Path:
    return Path(venv) / "bin" / "aiperf"


def _marker_text() -> str:
    return " ".join(PACKAGES) + "\n"


def is_ready(venv: str | Path) -> bool:
    marker = Path(venv) / MARKER
    return aiperf_exe(venv).exists() and marker.exists() and marker.read_text() == _marker_text()


def installed_version(venv: str | Path) -> str:
    out = subprocess.run([str(venv_python(venv)), "-c",
                          "import importlib.metadata as m; print(m.version('aiperf'))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def ensure_venv(venv: str | Path = DEFAULT_VENV, python: str = "python3", log=print) -> Path:
    """The venv at `venv` with AIPerf 0.13 installed (created and installed if needed; ~2 minutes, 1.2 GB).
    Raises RuntimeError with the tail of pip's log if the install fails."""
    venv = Path(venv).absolute()
    if is_ready(venv):
        return venv
    if not venv_python(venv).exists():
        log(f"aiperf: creating {venv} ({python} -m venv)")
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    log(f"aiperf: pip install {' '.join(PACKAGES)} into {venv} (first use: ~2 minutes, ~1.2 GB)")
    pip_log = venv / "pip-install.log"
    with open(pip_log, "w") as f:
        r = subprocess.run([str(venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check",
                            *PACKAGES], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0 or not aiperf_exe(venv).exists():
        tail = [line for line in pip_log.read_text(errors="replace").splitlines()
                if "is ignored: it is neither" not in line][-15:]
        raise RuntimeError(f"installing {' '.join(PACKAGES)} into {venv} failed (exit {r.returncode}; "
                           f"{pip_log}):\n" + "\n".join(tail))
    version = installed_version(venv)
    if not version.startswith("0.13."):
        raise RuntimeError(f"{venv} has aiperf {version}, expected {AIPERF_SPEC}")
    (venv / MARKER).write_text(_marker_text())
    log(f"aiperf: {version} ready in {venv}")
    return venv


if __name__ == "__main__":  # python -m bench.aiperf.env [VENV]: just set up the venv
    print(ensure_venv(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_VENV))
