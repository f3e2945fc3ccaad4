"""Write a Hugging Face tokenizer directory built from a GGUF file's metadata, torch-free.

A standalone script (stdlib + transformers + gguf only), run with whichever Python has transformers: the
AIPerf venv's, or the dev venv's in tests. Usage: python _gguf_tokenizer.py MODEL.gguf OUT_DIR

transformers' own GGUF converter builds the fast tokenizer (`convert_gguf_tokenizer`), the same one
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` would, minus the torch import that route needs. The chat
template goes beside it as chat_template.jinja (what `--apply-chat-template` and transformers 5.x read),
and `tokenizer_class` is PreTrainedTokenizerFast so transformers 4.x can load the directory too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _metadata_tokenizer(gguf_path: str) -> tuple[str, dict, dict]:
    """(architecture, tokenizer_dict, tokenizer_config) from the file's metadata, read with the gguf package
    (transformers' own reader imports torch) and renamed as transformers' get_gguf_tokenizer does."""
    from gguf import GGUFReader

    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING

    reader = GGUFReader(gguf_path)
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key == "general.architecture":
            value = field.contents()
            meta[key] = value.tolist() if hasattr(value, "tolist") else value
    arch = meta["general.architecture"]
    groups = {g: {name: meta[f"tokenizer.{k}"] for k, name in renames.items() if f"tokenizer.{k}" in meta}
              for g, renames in GGUF_TOKENIZER_MAPPING.items()}
    tok, cfg = groups["tokenizer"], groups["tokenizer_config"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        cfg[name] = tok["tokens"][token_id] if token_id is not None else None
    return arch, tok, cfg


def build(gguf_path: str, out_dir: str) -> dict:
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import convert_gguf_tokenizer
    from transformers import PreTrainedTokenizerFast

    arch, tok_dict, tok_cfg = _metadata_tokenizer(gguf_path)
    backend, extra = convert_gguf_tokenizer(arch, tok_dict)
    template = tok_cfg.pop("chat_template", None)
    kwargs = {k: v for k, v in {**tok_cfg, **extra}.items() if v is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    if template:
        (out / "chat_template.jinja").write_text(template)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # 5.x writes TokenizersBackend, unknown to 4.x
    cfg["model_max_length"] = 8192  # SmolLM2's context (the default is a 1e30 "no limit")
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return {"architecture": arch, "vocab": len(tok_dict.get("tokens", [])), "chat_template": bool(template),
            "files": sorted(p.name for p in out.iterdir())}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[-2])
    print(json.dumps(build(sys.argv[1], sys.argv[2])))
