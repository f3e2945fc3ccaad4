"""The run directory's state file (`up.json`) and cleaning up after a `moorage up` that did not stop.

`up.json` names the bus and the router, and every current process as pid and (pid, start ticks) so a
later reader can tell a process from another that reused its pid. It never holds the bus credential
(that is `nats-credential.json`, mode 0600). It is rewritten atomically on every spawn and exit.

A launcher killed with kill -9 leaves `up.json`, the credential and the nats work directory behind;
its children die by PR_SET_PDEATHSIG. `clean_stale` runs before the next start on the same run dir:
it refuses while the recorded launcher still runs, stops any recorded process that is still alive and
really ours (same start time, and its command line names this run dir), and removes the leftovers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from infra.natsd import CREDENTIAL_FILE
from infra.procs import ProcId, cmdline, terminate

STATE_FILE = "up.json"
NATS_DIR = "nats"  # the embedded nats-server's work directory (config with the credential, ports file)


class AlreadyRunning(RuntimeError):
    """Another `moorage up` is running from this run directory."""


def write_state(run_dir: Path, state: dict) -> None:
    tmp = run_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, run_dir / STATE_FILE)


def read_state(run_dir: Path) -> dict | None:
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def recorded_processes(state: dict) -> dict[str, ProcId]:
    """name -> process, from `procs` (pid and start ticks) or, in older files, `pids` (pid only: the
    start time is taken as it is now, so only the command line check below tells ours from another)."""
    out: dict[str, ProcId] = {}
    for name, value in (state.get("procs") or {}).items():
        if (p := ProcId.from_json(value)) is not None:
            out[name] = p
    for name, pid in (state.get("pids") or {}).items():
        if name not in out and isinstance(pid, int) and (p := ProcId.of(pid)) is not None:
            out[name] = p
    return out


def clean_stale(run_dir: Path) -> list[str]:
    """Make run_dir ready for a new start; returns what was cleaned, one line each. Raises
    AlreadyRunning if the launcher recorded there is alive."""
    run_dir = run_dir.resolve()
    cleaned: list[str] = []
    state = read_state(run_dir) if (run_dir / STATE_FILE).exists() else None
    if state is not None:
        launcher = ProcId.from_json(state.get("launcher"))
        if launcher is not None and launcher.alive():
            raise AlreadyRunning(f"a moorage up (pid {launcher.pid}) is running from {run_dir}; stop it first "
                                 f"(or use another up.run_dir)")
        ours = {name: p for name, p in recorded_processes(state).items()
                if p.alive() and str(run_dir) in cmdline(p.pid)}
        if ours:
            left = terminate(list(ours.values()))
            cleaned.append("stopped leftover processes of the last run: "
                           + ", ".join(f"{n} (pid {p.pid})" for n, p in ours.items())
                           + (f"; still alive: {', '.join(str(p.pid) for p in left)}" if left else ""))
        old_tmp = state.get("nats_workdir", "")
        if old_tmp and Path(old_tmp).name.startswith("moorage-nats-") and Path(old_tmp).is_dir():
            shutil.rmtree(old_tmp, ignore_errors=True)  # where older launchers kept it
            cleaned.append(f"removed {old_tmp}")
    if state is not None or (run_dir / STATE_FILE).exists():
        (run_dir / STATE_FILE).unlink(missing_ok=True)
        cleaned.append(f"removed a stale {STATE_FILE}")
    if (run_dir / NATS_DIR).exists():
        shutil.rmtree(run_dir / NATS_DIR, ignore_errors=True)
        cleaned.append(f"removed a stale {NATS_DIR}/ work directory")
    (run_dir / CREDENTIAL_FILE).unlink(missing_ok=True)
    return cleaned
