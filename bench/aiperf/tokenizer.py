"""The Hugging Face tokenizer AIPerf needs, built offline from the bundled GGUF, and the fake HF cache
entry that lets AIPerf load it.

The trap: AIPerf cannot load a tokenizer by path for trace datasets. Its parallel-decode workers force
HF_HUB_OFFLINE=1 and call `snapshot_download(name)`, which rejects a path (HFValidationError, then
BrokenProcessPool). A name that resolves in the local cache works everywhere, so the directory is
registered as `$HF_HOME/hub/models--local--smollm2-135m/snapshots/<40 zeros>/` plus `refs/main` holding the
40 zeros, and AIPerf runs with `HF_HOME=... HF_HUB_OFFLINE=1 --tokenizer local/smollm2-135m`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ID = "local/smollm2-135m"
SNAPSHOT = "0" * 40
CONVERT_SCRIPT = Path(__file__).with_name("_gguf_tokenizer.py")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
STAMP = "moorage-source.json"  # what the snapshot was built from (reused while the GGUF is unchanged)


def repo_cache_dir(hf_home: str | Path, repo_id: str = REPO_ID) -> Path:
    """$HF_HOME/hub/models--<org>--<name>: where huggingface_hub looks a repo up."""
    return Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))


def snapshot_dir(hf_home: str | Path, repo_id: str = REPO_ID) -> Path:
    return repo_cache_dir(hf_home, repo_id) / "snapshots" / SNAPSHOT


def register_fake_hf_cache(tok_dir: str | Path, hf_home: str | Path, repo_id: str = REPO_ID,
                           stamp: dict | None = None) -> Path:
    """Copy the tokenizer files of `tok_dir` into a cache entry for `repo_id` under `hf_home` (replacing any
    earlier one) and point refs/main at it; the snapshot directory."""
    src = Path(tok_dir)
    if not (src / "tokenizer.json").exists():
        raise FileNotFoundError(f"{src}/tokenizer.json missing: not a tokenizer directory")
    snap = snapshot_dir(hf_home, repo_id)
    if snap.exists():
        shutil.rmtree(snap)
    snap.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, snap / name)
    refs = repo_cache_dir(hf_home, repo_id) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(SNAPSHOT)  # no newline, as huggingface_hub writes it
    if stamp is not None:
        (snap / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    return snap


def build_tokenizer_dir(gguf: str | Path, out: str | Path, python: str | Path = sys.executable) -> dict:
    """Run the converter (`_gguf_tokenizer.py`) with `python` (it needs transformers + gguf, not torch);
    what it reports: architecture, vocab size, files."""
    r = subprocess.run([str(python), str(CONVERT_SCRIPT), str(gguf), str(out)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"building the tokenizer from {gguf} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _source_stamp(gguf: Path) -> dict:
    st = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def ensure_tokenizer(hf_home: str | Path, gguf: str | Path, python: str | Path = sys.executable,
                     repo_id: str = REPO_ID, log=print) -> Path:
    """The fake cache entry for `gguf`'s tokenizer under `hf_home`, built once (and again if the GGUF changed)."""
    gguf = Path(gguf)
    stamp = {**_source_stamp(gguf), "repo_id": repo_id}
    snap = snapshot_dir(hf_home, repo_id)
    try:
        if json.loads((snap / STAMP).read_text()) == stamp and (snap / "tokenizer.json").exists():
            return snap
    except (OSError, ValueError):
        pass
    build = Path(hf_home) / "build" / repo_id.replace("/", "--")
    if build.exists():
        shutil.rmtree(build)
    info = build_tokenizer_dir(gguf, build, python)
    log(f"aiperf: tokenizer built from {gguf.name} ({info['architecture']}, {info['vocab']} tokens) as {repo_id}")
    return register_fake_hf_cache(build, hf_home, repo_id, stamp)


def offline_env(hf_home: str | Path) -> dict[str, str]:
    """Environment for anything that loads the tokenizer by its repo id: the cache above, nothing downloaded."""
    return {"HF_HOME": str(Path(hf_home).absolute()), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
