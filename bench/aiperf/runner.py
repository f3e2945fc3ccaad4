"""One `aiperf profile` run: its command line, its environment, and running it into an artifact directory."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.aiperf.tokenizer import REPO_ID, offline_env

EXPORT = "profile_export_aiperf.json"


@dataclass
class AiperfRun:
    url: str                          # the router (no /v1)
    traces: str                       # weka-format file or directory
    concurrency: int
    request_count: int                # always passed: AIPerf's default in concurrency mode is 10
    out_dir: str                      # --output-artifact-dir
    sessions: int | None = None       # --num-sessions: a lane that finished its conversation starts no
                                      # other once this many were started (else it replays one again)
    model: str = "smollm2-135m"
    tokenizer: str = REPO_ID          # a repo id in the fake HF cache, never a path (see tokenizer.py)
    seed: int = 0                     # --random-seed: also the synthesized prompt text of every hash id
    think_cap_s: float | None = None  # --inter-turn-delay-cap-seconds (None: the recorded delays)
    request_timeout_s: float = 900.0
    extra_args: list[str] = field(default_factory=list)


def command(exe: str | Path, r: AiperfRun) -> list[str]:
    """The `aiperf profile` command line: streaming chat over the weka traces at one concurrency, server
    token counts (which also asks for usage in the stream), ignore_eos so every request generates its
    recorded output, no UI, no server-metrics scraping or GPU telemetry (nothing to scrape here)."""
    cmd = [str(exe), "profile",
           "--model", r.model, "--tokenizer", r.tokenizer, "--url", r.url,
           "--endpoint-type", "chat", "--streaming",
           "--input-file", str(r.traces), "--custom-dataset-type", "weka_trace",
           "--concurrency", str(r.concurrency), "--request-count", str(r.request_count),
           *(["--num-sessions", str(r.sessions)] if r.sessions else []),
           "--use-server-token-count", "--extra-inputs", "ignore_eos:true",
           "--random-seed", str(r.seed), "--request-timeout-seconds", f"{r.request_timeout_s:g}",
           "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--output-artifact-dir", str(r.out_dir)]
    if r.think_cap_s is not None:
        cmd += ["--inter-turn-delay-cap-seconds", f"{r.think_cap_s:g}"]
    return cmd + list(r.extra_args)


def environment(hf_home: str | Path, base: dict | None = None) -> dict[str, str]:
    """Offline tokenizer cache, and X-Session-ID taken from AIPerf's X-Correlation-ID (one per conversation;
    moorage keys session affinity on X-Session-ID)."""
    env = dict(os.environ if base is None else base)
    env.update(offline_env(hf_home))
    env["AIPERF_HTTP_X_SESSION_ID_FROM_CORRELATION_ID"] = "true"
    env.pop("VIRTUAL_ENV", None)  # the project's venv is not AIPerf's
    return env


def run(exe: str | Path, r: AiperfRun, hf_home: str | Path, timeout_s: float | None = None) -> dict:
    """Run AIPerf; {"rc", "wall_s", "export" (the JSON's path or None), "log", "command"}. Its console
    output goes to <out_dir>/aiperf-console.log."""
    out = Path(r.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = command(exe, r)
    log = out / "aiperf-console.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        # its own process group: AIPerf starts ~7 processes, and a timeout or Ctrl-C ends them all
        proc = subprocess.Popen(cmd, env=environment(hf_home), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = "timeout"
        except BaseException:
            _stop_group(proc)
            raise
    export = out / EXPORT
    return {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "export": str(export) if export.exists() else None,
            "log": str(log), "command": cmd}


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: str | Path, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])
