"""A disk cache of what a GGUF file decodes to, so a (re)started engine skips the parse and dequant.

Reading the bundled SmolLM2 GGUF takes seconds: GGUFReader builds a numpy view per vocabulary string
(49152 tokens plus merges) and every quantized tensor is dequantized in numpy. On a busy host that was
15 s of a decode's restart. The result depends only on the file's bytes and on this code, so it is kept:

    $MOORAGE_MODEL_CACHE (default $XDG_CACHE_HOME/moorage/models or ~/.cache/moorage/models)
        <key>.json          config + tokenizer (tokenizers' JSON) + chat template: all the router needs
        <key>.safetensors   float32 weights under our names (rope rows already un-permuted)

<key> is a hash of the file's content, CACHE_VERSION and the gguf package's version, so a changed file,
a changed loader or a new dequantizer never reads an old entry. Entries are written to a temp file and
renamed, so concurrent writers (prefill and decode start together) and a crash mid-write leave either
a whole entry or none. `MOORAGE_MODEL_CACHE=off` turns it off; an unwritable directory only costs the
cache (logged once), never the load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from shared.engine.model_config import ModelConfig
from shared.logging import get_logger

if TYPE_CHECKING:
    import torch

    from shared.engine.tokenizer import BPETokenizer

CACHE_ENV = "MOORAGE_MODEL_CACHE"
CACHE_VERSION = 2  # bump when gguf_loader or BPETokenizer.from_gguf_reader changes what a file decodes to
log = get_logger("engine")


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is off."""
    env = os.environ.get(CACHE_ENV)
    if env == "off":
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moorage" / "models"


def _gguf_version() -> str:
    try:
        return version("gguf")
    except PackageNotFoundError:  # pragma: no cover - gguf is a core dependency
        return "unknown"


def file_key(path: Path) -> str:
    h = hashlib.blake2b(f"moorage-model-cache-v{CACHE_VERSION}\0gguf-{_gguf_version()}\0".encode(), digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    """One GGUF file's entry (its files may not exist yet)."""
    meta_path: Path
    weights_path: Path

    @classmethod
    def for_file(cls, path: str | Path) -> CacheEntry | None:
        root = cache_dir()
        if root is None:
            return None
        key = file_key(Path(path))
        return cls(root / f"{key}.json", root / f"{key}.safetensors")

    def load_meta(self, name: str) -> tuple[ModelConfig, BPETokenizer] | None:
        """Config (named `name`, as the loader names it) and tokenizer, or None on a miss."""
        from tokenizers import Tokenizer as HFTokenizer

        from shared.engine.tokenizer import BPETokenizer

        try:
            meta = json.loads(self.meta_path.read_text())
            c = meta["config"]
            config = ModelConfig(**{**c, "name": name, "eos_token_ids": tuple(c["eos_token_ids"])})
            tok = BPETokenizer(HFTokenizer.from_str(meta["tokenizer"]), config.eos_token_ids, meta["chat_template"],
                               meta.get("bos_token", ""))
        except FileNotFoundError:
            return None
        except Exception as e:  # a damaged entry (tokenizers raises plain Exception): decode the file instead
            log.warning("model cache entry unreadable: decoding the file again", path=str(self.meta_path),
                        error=str(e))
            return None
        return config, tok

    def load_weights(self) -> dict[str, torch.Tensor] | None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(self.weights_path))
        except FileNotFoundError:
            return None
        except (OSError, SafetensorError) as e:
            log.warning("model cache weights unreadable: decoding the file again", path=str(self.weights_path),
                        error=str(e))
            return None

    def save_meta(self, config: ModelConfig, tokenizer: BPETokenizer) -> None:
        meta = {"config": asdict(config), "tokenizer": tokenizer._tok.to_str(),
                "chat_template": tokenizer.__dict__.get("chat_template"),  # the file's own, if it has one
                "bos_token": tokenizer.bos_token}
        self._write(self.meta_path, lambda tmp: Path(tmp).write_text(json.dumps(meta)))

    def save_weights(self, weights: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        self._write(self.weights_path, lambda tmp: save_file({k: v.contiguous() for k, v in weights.items()}, tmp))

    def _write(self, path: Path, write) -> None:
        """Atomically (temp file + rename); a failure is logged and leaves no entry."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            try:
                write(tmp)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            log.warning("model cache not written (loads will decode the file each time)", path=str(path),
                        error=str(e))

