"""The decoded-model cache (shared/engine/model_cache.py): a hit gives exactly what decoding the GGUF
gives, a changed file misses, a damaged or unwritable cache falls back to decoding, and it can be off.
Also: KV pages are zero without being written up front (shared/kv_layout.allocate_pages)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from shared.engine import gguf_loader, model_cache
from shared.engine.models import load_model, load_tokenizer
from shared.kv_layout import KVLayout, allocate_pages
from tests.test_loaders import CONFIG, assert_same_weights, random_weights, write_gguf

TEXT = "abacus wörld <|im_start|>user\nhi<|im_end|>"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "models"
    monkeypatch.setenv(model_cache.CACHE_ENV, str(d))
    return d


@pytest.fixture
def gguf(tmp_path):
    return write_gguf(tmp_path / "m.gguf", CONFIG, random_weights(CONFIG), qtype=GGMLQuantizationType.Q8_0)


def _count_decodes(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = gguf_loader.load_gguf

    def counting(path, name=None):
        calls.append(str(path))
        return real(path, name)

    monkeypatch.setattr(gguf_loader, "load_gguf", counting)
    return calls


def _same(a, b) -> None:
    assert a.config == b.config and a.model_id == b.model_id
    assert_same_weights(a.weights, b.weights)
    assert a.tokenizer.encode(TEXT) == b.tokenizer.encode(TEXT)
    assert a.tokenizer.special_tokens == b.tokenizer.special_tokens
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert a.tokenizer.chat_token_ids(msgs) == b.tokenizer.chat_token_ids(msgs)


def test_hit_is_identical_to_decoding_and_skips_the_decode(cache, gguf, monkeypatch):
    calls = _count_decodes(monkeypatch)
    first = load_model(str(gguf))
    assert len(calls) == 1 and len(list(cache.glob("*.safetensors"))) == 1 and len(list(cache.glob("*.json"))) == 1
    second = load_model(str(gguf), max_context=64)
    assert len(calls) == 1  # served from the cache
    assert second.config.max_context == 64  # the clamp applies to a hit too
    _same(first, load_model(str(gguf)))
    assert len(calls) == 1
    monkeypatch.setenv(model_cache.CACHE_ENV, "off")
    _same(first, load_model(str(gguf)))  # the uncached path gives the same
    assert len(calls) == 2


def test_router_tokenizer_comes_from_the_entry_without_weights(cache, gguf, monkeypatch):
    tok, ctx = load_tokenizer(str(gguf))
    assert ctx == CONFIG.max_context
    assert list(cache.glob("*.json")) and not list(cache.glob("*.safetensors"))  # the router writes no weights
    calls = _count_decodes(monkeypatch)
    loaded = load_model(str(gguf))  # meta present, weights missing: decodes and completes the entry
    assert len(calls) == 1 and list(cache.glob("*.safetensors"))
    hit, _ = load_tokenizer(str(gguf))
    assert tok.encode(TEXT) == hit.encode(TEXT) == loaded.tokenizer.encode(TEXT)


def test_changed_file_misses(cache, gguf, tmp_path, monkeypatch):
    load_model(str(gguf))
    other = write_gguf(tmp_path / "m2.gguf", CONFIG, random_weights(CONFIG, seed=1), qtype=GGMLQuantizationType.Q8_0)
    os.replace(other, gguf)  # same path, new content
    calls = _count_decodes(monkeypatch)
    loaded = load_model(str(gguf))
    assert len(calls) == 1
    assert len(list(cache.glob("*.safetensors"))) == 2
    assert model_cache.CacheEntry.for_file(gguf).weights_path.exists()
    uncached = gguf_loader.load_gguf(gguf, name=str(gguf))[1]
    assert_same_weights(loaded.weights, uncached)


@pytest.mark.parametrize("damage", ["json", "safetensors"])
def test_damaged_entry_is_decoded_again(cache, gguf, monkeypatch, damage):
    first = load_model(str(gguf))
    (entry,) = cache.glob(f"*.{damage}")
    entry.write_bytes(entry.read_bytes()[:100])
    calls = _count_decodes(monkeypatch)
    _same(first, load_model(str(gguf)))
    assert len(calls) == 1
    _same(first, load_model(str(gguf)))  # rewritten whole
    assert len(calls) == 1


def test_unwritable_cache_still_loads(tmp_path, gguf, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv(model_cache.CACHE_ENV, str(blocker / "models"))
    calls = _count_decodes(monkeypatch)
    a, b = load_model(str(gguf)), load_model(str(gguf))
    assert len(calls) == 2
    _same(a, b)


def test_no_temp_files_left(cache, gguf):
    load_model(str(gguf))
    load_tokenizer(str(gguf))
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".safetensors"]


@pytest.mark.parametrize("num_blocks", [3, 4096])
def test_kv_pages_are_zero_contiguous_and_writable(num_blocks):
    layout = KVLayout(4, 2, 64, stages=2)
    pages = allocate_pages(layout, num_blocks)
    assert len(pages) == 2
    for s, p in enumerate(pages):
        assert p.shape == layout.page_shape(s, num_blocks) and p.dtype == layout.dtype and p.is_contiguous()
        assert not bool(p.any())
        p[num_blocks - 1, 0, 1, 3] = 1.5
        assert float(p.sum()) == 1.5 * p.shape[-2] * p.shape[-1]
    assert pages[0].data_ptr() != pages[1].data_ptr()


def test_kv_pages_bf16():
    (p,) = allocate_pages(KVLayout(2, 1, 8, dtype=torch.bfloat16), 5)
    assert p.dtype == torch.bfloat16 and not bool(p.any())
    p.fill_(2.0)
    assert np.all(p.float().numpy() == 2.0)
