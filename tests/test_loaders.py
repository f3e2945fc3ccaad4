"""GGUF and HF-directory loaders: small files written here from random weights, read back exactly.

The RoPE row permutation is the easy thing to get wrong, so it is checked three ways: against a copy of
llama.cpp's converter code, against llama.cpp-style adjacent-pair RoPE, and end to end (a model loaded
without un-permuting gives different logits).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

from shared.engine import gguf_loader
from shared.engine.attention import AttentionBatch, PrefillSegment
from shared.engine.gguf_loader import load_gguf, permute_rope_rows, unpermute_rope_rows
from shared.engine.hf_loader import load_hf_dir, save_hf_dir
from shared.engine.model import LlamaModel
from shared.engine.rope import RotaryEmbedding
from shared.engine.model_config import ModelConfig
from shared.engine.models import BUNDLED_MODELS, load_model
from shared.engine.tokenizer import BPETokenizer, ByteTokenizer
from shared.kv_layout import KVLayout, allocate_pages

CONFIG = ModelConfig(
    name="small", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
    vocab_size=300, max_context=128, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=False,
    bos_token_id=1, eos_token_ids=(2,),
)
INPUT_IDS = [5, 17, 250, 3, 99, 42, 7, 280, 11, 64, 128, 0, 33, 77, 201, 150, 9, 4, 260, 31]


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim

    def mat(o, i):
        return torch.randn(o, i, generator=g) / i ** 0.5

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {"embed_tokens": torch.randn(config.vocab_size, h, generator=g), "norm": norm(h)}
    if not config.tie_embeddings:
        w["lm_head"] = torch.randn(config.vocab_size, h, generator=g) * 0.5
    for i in range(config.num_layers):
        p = f"layers.{i}."
        w[p + "input_layernorm"] = norm(h)
        w[p + "post_attention_layernorm"] = norm(h)
        w[p + "q_proj"] = mat(config.num_heads * d, h)
        w[p + "k_proj"] = mat(config.num_kv_heads * d, h)
        w[p + "v_proj"] = mat(config.num_kv_heads * d, h)
        w[p + "o_proj"] = mat(h, config.num_heads * d)
        w[p + "gate_proj"] = mat(f, h)
        w[p + "up_proj"] = mat(f, h)
        w[p + "down_proj"] = mat(h, f)
    return w


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim logic of llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


_GGUF_LAYER = {"input_layernorm": "attn_norm", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
               "o_proj": "attn_output", "post_attention_layernorm": "ffn_norm", "gate_proj": "ffn_gate",
               "up_proj": "ffn_up", "down_proj": "ffn_down", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
_GGUF_TOP = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}


def gpt2_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 style byte-level vocabulary: 256 byte symbols, 3 ChatML specials, merged fillers."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_syms = [chr(c) for _, c in sorted(zip(bs, cs))]
    tokens = list(byte_syms)
    types = [int(TokenType.NORMAL)] * 256
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens[0:0] = []
    tokens += specials
    types += [int(TokenType.CONTROL)] * 3
    merges = []
    letters = "abcdefghijklmnopqrstuvwxyz"
    for a in letters:
        for b in letters:
            if len(tokens) >= vocab_size:
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
            types.append(int(TokenType.NORMAL))
    return tokens, types, merges


def write_gguf(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], *,
               qtype: GGMLQuantizationType | None = None, permute: bool | None = None,
               with_vocab_size: bool = True, with_tokenizer: bool = True, arch: str = "llama",
               vocab: tuple[list[str], list[int], list[str]] | None = None, pre: str | None = None,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """Writes `weights` (our names, HF row order) the way llama.cpp's converter would: q/k rows permuted for
    llama only; Qwen 2's q/k/v biases and Qwen 3's q/k norms under their llama.cpp names. `vocab` (tokens,
    types, merges) and `pre` replace the default GPT-2 style vocabulary; `extra` tensors go in as they are."""
    permute = arch == "llama" if permute is None else permute
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", config.num_layers)
    w.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", config.num_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", config.num_kv_heads)
    w.add_uint32(f"{arch}.context_length", config.max_context)
    w.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_eps)
    if config.explicit_head_dim:
        w.add_uint32(f"{arch}.attention.key_length", config.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", config.head_dim)
    if with_vocab_size:
        w.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    if with_tokenizer:
        tokens, types, merges = vocab or gpt2_vocab(config.vocab_size)
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    if config.bos_token_id is not None:
        w.add_bos_token_id(config.bos_token_id)
    if config.eos_token_ids:
        w.add_eos_token_id(config.eos_token_ids[0])
    for name, t in weights.items():
        arr = t.numpy().astype(np.float32)
        parts = name.split(".")
        if parts[0] == "layers":
            base = parts[2]
            if permute and base == "q_proj":
                arr = llama_cpp_permute(arr, config.num_heads, config.num_heads)
            elif permute and base == "k_proj":
                arr = llama_cpp_permute(arr, config.num_heads, config.num_kv_heads)
            gname = f"blk.{parts[1]}.{_GGUF_LAYER[base]}.{parts[3] if len(parts) > 3 else 'weight'}"
        else:
            gname = f"{_GGUF_TOP[name]}.weight"
        if qtype is not None and arr.ndim == 2:  # norms stay F32, as in llama.cpp
            w.add_tensor(gname, quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    for gname, arr in (extra or {}).items():
        w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def prefill_logits(config: ModelConfig, weights: dict[str, torch.Tensor], ids=INPUT_IDS) -> torch.Tensor:
    """Runs the model over `ids` in one prefill; logits of every position [T, V]."""
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim)
    model = LlamaModel(config, weights, layout)
    B = layout.block_size
    nb = -(-len(ids) // B)
    pages = allocate_pages(layout, nb)
    pos = torch.arange(len(ids))
    batch = AttentionBatch(pos // B, pos % B, prefill=[PrefillSegment(0, len(ids), len(ids), torch.arange(nb))])
    return model.logits(model.forward(torch.tensor(ids), pos, batch, pages))


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == torch.float32, k
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def assert_config_round_trip(got: ModelConfig, want: ModelConfig) -> None:
    # rms_eps and rope_theta travel as float32 in GGUF
    assert got.rms_eps == pytest.approx(want.rms_eps, rel=1e-6)
    assert got.rope_theta == pytest.approx(want.rope_theta, rel=1e-6)
    assert replace(got, rms_eps=want.rms_eps, rope_theta=want.rope_theta) == want


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(CONFIG)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, weights) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", CONFIG, weights)


# ---- (a) the permutation ----------------------------------------------------------------------------

@pytest.mark.parametrize("n_heads,head_dim,cols", [(4, 16, 64), (2, 16, 64), (1, 8, 3), (3, 4, 1)])
def test_permute_unpermute_are_inverses(n_heads, head_dim, cols):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_heads * head_dim, cols)).astype(np.float32)
    p = permute_rope_rows(w, n_heads)
    assert not np.array_equal(p, w) or head_dim == 2
    assert np.array_equal(unpermute_rope_rows(p, n_heads), w)
    assert np.array_equal(permute_rope_rows(unpermute_rope_rows(w, n_heads), n_heads), w)
    # 1-D (a bias) works too
    b = rng.standard_normal(n_heads * head_dim).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(permute_rope_rows(b, n_heads), n_heads), b)


def test_permute_matches_llama_cpp_converter():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4 * 16, 64)).astype(np.float32)
    k = rng.standard_normal((2 * 16, 64)).astype(np.float32)
    assert np.array_equal(permute_rope_rows(q, 4), llama_cpp_permute(q, 4, 4))
    assert np.array_equal(permute_rope_rows(k, 2), llama_cpp_permute(k, 4, 2))


def test_permuted_rows_with_adjacent_pair_rope_equal_rotate_half_rope():
    """Why the permutation exists: llama.cpp's RoPE (rotate adjacent pairs) on permuted rows equals the
    HF rotate-half RoPE (what model.py does) on the original rows, up to the same row permutation."""
    n_heads, d, T = 3, 16, 7
    theta = 10000.0
    rng = np.random.default_rng(2)
    q = rng.standard_normal((T, n_heads * d)).astype(np.float64)  # [T, rows]: q = x @ W.T
    rope = RotaryEmbedding(d, theta, 64, "cpu", dtype=torch.float64)
    pos = torch.arange(T)
    hf = rope(torch.from_numpy(q).view(T, n_heads, d), pos).reshape(T, -1).numpy()

    qp = permute_rope_rows(q.T, n_heads).T.reshape(T, n_heads, d)  # rows permuted like the GGUF weights
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos.numpy()[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = qp[..., 0::2], qp[..., 1::2]
    out = np.empty_like(qp)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    back = unpermute_rope_rows(out.reshape(T, -1).T, n_heads).T
    np.testing.assert_allclose(back, hf, rtol=1e-12, atol=1e-12)


# ---- (b) GGUF -----------------------------------------------------------------------------------------

def test_gguf_f32_round_trip_exact(gguf_file, weights):
    config, got, reader = load_gguf(gguf_file, name="small")
    assert_config_round_trip(config, CONFIG)
    assert not config.tie_embeddings
    assert_same_weights(got, weights)
    assert reader.fields["general.architecture"].contents() == "llama"


def test_gguf_default_name_is_file_stem(gguf_file):
    config, _, _ = load_gguf(gguf_file)
    assert config.name == "small"


def test_gguf_vocab_size_from_token_list(tmp_path, weights):
    path = write_gguf(tmp_path / "novocab.gguf", CONFIG, weights, with_vocab_size=False)
    config, got, _ = load_gguf(path, name="small")
    assert config.vocab_size == CONFIG.vocab_size
    assert_same_weights(got, weights)


def test_gguf_q8_0_within_quantization_tolerance(tmp_path, weights):
    path = write_gguf(tmp_path / "q8.gguf", CONFIG, weights, qtype=GGMLQuantizationType.Q8_0)
    config, got, _ = load_gguf(path, name="small")
    assert_config_round_trip(config, CONFIG)
    assert set(got) == set(weights)
    for k, want in weights.items():
        assert got[k].shape == want.shape and got[k].dtype == torch.float32, k
        if want.ndim == 1:
            assert torch.equal(got[k], want), k
            continue
        # exactly what Q8_0 makes of the original rows (quantization is per row block, so the row
        # permutation commutes with it)...
        expect = dequantize(quantize(want.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        assert np.array_equal(got[k].numpy(), expect.reshape(want.shape)), k
        # ...which is within about half a step (absmax/127 per 32 values; the step itself is stored
        # as float16, which adds up to 127 * 2**-11 steps) of the original
        blocks = want.reshape(-1, 32).abs().amax(dim=1, keepdim=True)
        err = (got[k] - want).reshape(-1, 32).abs()
        assert bool((err <= blocks / 127 * (0.5 + 127 * 2.0 ** -11) + 1e-6).all()), k
        assert not torch.equal(got[k], want)
    # and the model built from it is close to the original
    ref, q = prefill_logits(CONFIG, weights), prefill_logits(config, got)
    assert (ref - q).abs().max() < 0.05 * ref.abs().max()


def test_gguf_tied_embeddings(tmp_path):
    tied = replace(CONFIG, tie_embeddings=True)
    w = random_weights(tied, seed=3)
    assert "lm_head" not in w
    path = write_gguf(tmp_path / "tied.gguf", tied, w)
    config, got, reader = load_gguf(path, name="small")
    assert "output.weight" not in {t.name for t in reader.tensors}
    assert config.tie_embeddings
    assert_config_round_trip(config, tied)
    assert_same_weights(got, w)
    logits = prefill_logits(config, got)
    assert torch.equal(logits, prefill_logits(tied, w))


def test_gguf_unsupported_architecture(tmp_path, weights):
    path = write_gguf(tmp_path / "gpt2.gguf", CONFIG, weights, arch="gpt2")
    with pytest.raises(ValueError, match="architecture"):
        load_gguf(path)


def _write_with_extra_tensor(path: Path, extra_name: str, extra: np.ndarray) -> Path:
    """A valid small GGUF plus one tensor our loader has no name for."""
    w = GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2), ("context_length", 128),
                       ("vocab_size", 300)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float32))
    w.add_tensor(extra_name, extra)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name,shape,named", [
    ("blk.0.attn_qkv.weight", (192, 64), "unexpected GGUF tensor"),
    ("rope_freqs.weight", (5,), "rope frequency factors: 5 for 8"),  # Llama 3.1's scaling, of the wrong size
    ("output.bias", (300,), "unexpected GGUF tensor")])
def test_gguf_unexpected_tensor(tmp_path, name, shape, named):
    path = _write_with_extra_tensor(tmp_path / "extra.gguf", name, np.ones(shape, dtype=np.float32))
    with pytest.raises(ValueError, match=named):
        load_gguf(path)


def test_gguf_layer_bias_is_rejected_not_taken_for_the_weight(tmp_path):
    path = _write_with_extra_tensor(tmp_path / "bias.gguf", "blk.0.attn_q.bias", np.ones(64, dtype=np.float32))
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        load_gguf(path)


# ---- (c) HF directory ------------------------------------------------------------------------------------

def test_hf_round_trip_exact(tmp_path, weights):
    save_hf_dir(tmp_path / "hf", CONFIG, weights)
    config, got = load_hf_dir(tmp_path / "hf", name="small")
    assert config == CONFIG
    assert_same_weights(got, weights)
    config2, _ = load_hf_dir(tmp_path / "hf")
    assert config2.name == "hf"


def test_hf_files_use_hugging_face_names(tmp_path, weights):
    from safetensors import safe_open

    save_hf_dir(tmp_path / "hf", CONFIG, weights)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
            "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
            "model.layers.1.mlp.down_proj.weight"} <= keys
    assert len(keys) == len(weights)


def test_hf_ignores_rotary_inv_freq_and_converts_dtype(tmp_path, weights):
    from safetensors.torch import save_file

    save_hf_dir(tmp_path / "hf", CONFIG, weights)
    save_file({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
               "model.layers.0.mlp.up_proj.weight": weights["layers.0.up_proj"].to(torch.bfloat16)},
              str(tmp_path / "hf" / "zz-extra.safetensors"))
    _, got = load_hf_dir(tmp_path / "hf")
    assert not any("inv_freq" in k or "rotary" in k for k in got)
    assert got["layers.0.up_proj"].dtype == torch.float32
    assert torch.equal(got["layers.0.up_proj"], weights["layers.0.up_proj"].to(torch.bfloat16).float())


def test_hf_tied_drops_lm_head(tmp_path, weights):
    tied = replace(CONFIG, tie_embeddings=True)
    save_hf_dir(tmp_path / "hf", tied, weights)  # lm_head saved, but the config says tied
    config, got = load_hf_dir(tmp_path / "hf", name="small")
    assert config.tie_embeddings and "lm_head" not in got


def test_hf_missing_safetensors(tmp_path, weights):
    save_hf_dir(tmp_path / "hf", CONFIG, weights)
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        load_hf_dir(tmp_path / "hf")


# ---- (d) same logits whatever the file --------------------------------------------------------------------

def test_gguf_and_hf_models_give_identical_logits(tmp_path, gguf_file, weights):
    gcfg, gw, _ = load_gguf(gguf_file, name="small")
    save_hf_dir(tmp_path / "hf", gcfg, gw)
    hcfg, hw = load_hf_dir(tmp_path / "hf", name="small")
    ref = prefill_logits(CONFIG, weights)
    assert ref.shape == (len(INPUT_IDS), CONFIG.vocab_size)
    assert torch.equal(prefill_logits(gcfg, gw), ref)
    assert torch.equal(prefill_logits(hcfg, hw), ref)


def test_loading_without_unpermute_changes_logits(monkeypatch, gguf_file, weights):
    ref = prefill_logits(CONFIG, weights)
    monkeypatch.setattr(gguf_loader, "unpermute_rope_rows", lambda w, n_heads: w)
    cfg, bad, _ = load_gguf(gguf_file, name="small")
    assert not torch.equal(bad["layers.0.q_proj"], weights["layers.0.q_proj"])
    logits = prefill_logits(cfg, bad)
    # position 0 is not rotated and q.k is invariant to permuting q and k rows alike: same logits there...
    torch.testing.assert_close(logits[0], ref[0], rtol=1e-4, atol=1e-4)
    # ...but every later position differs clearly
    diff = (logits[1:] - ref[1:]).abs().amax(dim=-1)
    assert bool((diff > 1e-2).all()), diff


def test_unpermuted_gguf_is_not_loaded_as_is(tmp_path, weights):
    """A GGUF written WITHOUT the converter's permutation loads as different (wrong) weights: the
    loader always un-permutes, so the test file writer above must permute for the exact checks."""
    path = write_gguf(tmp_path / "noperm.gguf", CONFIG, weights, permute=False)
    _, got, _ = load_gguf(path, name="small")
    assert not torch.equal(got["layers.0.q_proj"], weights["layers.0.q_proj"])
    assert torch.equal(got["layers.0.v_proj"], weights["layers.0.v_proj"])


# ---- load_model ---------------------------------------------------------------------------------------------

def test_load_model_unknown_name_lists_bundled():
    with pytest.raises(ValueError) as e:
        load_model("no-such-model")
    for name in BUNDLED_MODELS:
        assert name in str(e.value)


def test_load_model_gguf_path_with_bpe_tokenizer(gguf_file, weights):
    loaded = load_model(str(gguf_file), max_context=64)
    assert loaded.model_id == str(gguf_file)
    assert loaded.config.max_context == 64  # clamped
    assert_same_weights(loaded.weights, weights)
    tok = loaded.tokenizer
    assert isinstance(tok, BPETokenizer)
    assert tok.special_tokens == {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
    assert tok.eos_token_ids == (2,)
    ids = tok.encode("abacus wörld")
    assert any(i > 258 for i in ids)  # merges were applied
    assert tok.decode(ids) == "abacus wörld"
    assert tok.chat_token_ids([{"role": "user", "content": "hi"}])[0] == 257
    assert load_model(str(gguf_file), max_context=10_000).config.max_context == CONFIG.max_context


def test_load_model_hf_dir_without_tokenizer_uses_bytes(tmp_path, weights):
    save_hf_dir(tmp_path / "hf", CONFIG, weights)
    loaded = load_model(str(tmp_path / "hf"))
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.config == replace(CONFIG, name="hf")
    assert_same_weights(loaded.weights, weights)


def test_load_model_tiny_is_seeded():
    a, b = load_model("tiny", max_context=256), load_model("tiny", max_context=256)
    assert a.model_id == b.model_id and a.model_id.startswith("tiny")
    assert a.config.max_context == 256 and a.config.vocab_size == ByteTokenizer().vocab_size
    assert_same_weights(a.weights, b.weights)
    assert isinstance(a.tokenizer, ByteTokenizer)


@pytest.mark.parametrize("extra,named", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ({"rope_scaling": {"type": "su", "factor": 4.0}}, "rope_scaling type 'su'"),
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling type 'linear' without a factor"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"attention_bias": True}, "q/k/v/o biases"),
    ({"sliding_window": 4096}, "a sliding window"),
    ({"head_dim": 128}, "head_dim"),
])
def test_hf_features_the_engine_does_not_implement_are_refused_by_name(tmp_path, weights, extra, named):
    """Llama 3.1's llama3 RoPE scaling once loaded without a word and diverged from transformers at the first
    token (issue 28): what the engine does not implement is an error that names it, never a silent drop
    (llama3, linear and yarn are implemented now: tests/test_random_oracle.py)."""
    import json

    save_hf_dir(tmp_path / "hf", CONFIG, weights)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **extra}))
    with pytest.raises(ValueError, match=re.escape(named)):
        load_hf_dir(tmp_path / "hf")
    cfg["rope_scaling"] = None  # null: no scaling, served as before
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    load_hf_dir(tmp_path / "hf")


@pytest.mark.parametrize("window", [0, 8])
def test_the_last_layer_runs_only_the_rows_that_sample(window):
    """A prefill's hidden states for the rows that sample (each segment's last) are the full forward's rows,
    with the last layer run for those rows alone: two segments in one batch, a windowed model too."""
    config = replace(CONFIG, arch="mistral", sliding_window=window) if window else CONFIG
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim)
    model = LlamaModel(config, random_weights(config), layout)
    B = 16
    lens = [20, 13]
    ids = torch.tensor(INPUT_IDS[:lens[0]] + INPUT_IDS[3:3 + lens[1]])
    pos = torch.cat([torch.arange(n) for n in lens])
    tables = [torch.tensor([0, 1]), torch.tensor([2])]
    blocks = torch.cat([tables[0][torch.arange(lens[0]) // B], tables[1][torch.arange(lens[1]) // B]])

    def run(out_rows=None):
        pages = allocate_pages(model.layout, 3)
        batch = AttentionBatch(blocks, pos % B, prefill=[PrefillSegment(0, lens[0], lens[0], tables[0]),
                                                         PrefillSegment(lens[0], lens[1], lens[1], tables[1])])
        return model.forward(ids, pos, batch, pages, out_rows), pages

    full, full_pages = run()
    part, part_pages = run([lens[0] - 1, sum(lens) - 1])
    assert part.shape == (2, config.hidden_size)
    torch.testing.assert_close(part, full[[lens[0] - 1, sum(lens) - 1]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part_pages[0], full_pages[0])  # every row's K/V is still written, last layer too
    with pytest.raises(ValueError, match="not the last of its segment"):
        run([5])
