"""Paged decode attention backends against the torch reference: random pages with fragmented block
tables, ragged lengths, GQA, batch sizes, kv dtypes; then whole engines must produce the same greedy
tokens with either backend."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import attention_reference, cpu_attention, get_attention_kernels
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams

CPU_OK = cpu_attention.available()
needs_cpu = pytest.mark.skipif(not CPU_OK, reason="the CPU attention kernel did not build (no C compiler?)")


def _case(batch, hq, hkv, d, lens, kv_dtype=torch.float32, layers=2, bs=16, seed=0):
    """Pages with more blocks than needed, each sequence's table a random (non-contiguous) pick,
    rows padded with block 0 as the runner does."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens)
    num_blocks = sum(-(-n // bs) for n in lens) + 7
    pages = torch.randn(num_blocks, layers, 2, bs, hkv, d, generator=g).to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[used:used + nb] + [0] * (width - nb))
        used += nb
    q = torch.randn(batch, hq, d, generator=g)
    return q, pages, torch.tensor(tables), torch.tensor(lens)


SHAPES = [  # (hq, hkv, d)
    (9, 3, 64),   # SmolLM2
    (4, 2, 64),   # tiny
    (8, 8, 128),  # MHA
    (8, 1, 32),   # MQA
    (6, 2, 24),   # head dim not a power of two
]
LENS = {1: [[1], [16], [17], [700]], 3: [[1, 33, 16], [300, 5, 129]], 8: [[64, 1, 17, 200, 15, 16, 31, 513]]}


@needs_cpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", sorted(LENS))
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_matches_reference(shape, batch, kv_dtype):
    hq, hkv, d = shape
    for i, lens in enumerate(LENS[batch]):
        q, pages, tables, ctx = _case(batch, hq, hkv, d, lens, kv_dtype, seed=i)
        for layer in range(pages.shape[1]):
            ref = attention_reference.paged_decode(q, pages, layer, tables, ctx, d ** -0.5)
            out = cpu_attention.paged_decode(q, pages, layer, tables, ctx, d ** -0.5)
            assert out.shape == ref.shape and out.dtype == ref.dtype
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_cpu
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_decode_split_over_threads_and_partitions(threads):
    """Long ragged contexts split into many partitions per sequence; the result must not depend on
    the thread count (partitions combine in a fixed order)."""
    q, pages, tables, ctx = _case(4, 9, 3, 64, [4500, 3, 1200, 2049], seed=5)
    ref = attention_reference.paged_decode(q, pages, 1, tables, ctx, 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = cpu_attention.paged_decode(q, pages, 1, tables, ctx, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out, cpu_attention.paged_decode(q, pages, 1, tables, ctx, 0.125))


@needs_cpu
def test_cpu_decode_reads_only_the_table_and_the_length():
    """Slots past each length and blocks outside the table are never read (NaN there changes nothing)."""
    q, pages, tables, ctx = _case(2, 4, 2, 64, [20, 37], seed=3)
    ref = cpu_attention.paged_decode(q, pages, 0, tables, ctx, 0.125)
    poisoned = pages.clone()
    keep = torch.zeros(pages.shape[0], pages.shape[3], dtype=torch.bool)
    for row, n in zip(tables.tolist(), ctx.tolist()):
        for t in range(n):
            keep[row[t // 16], t % 16] = True
    poisoned.permute(0, 3, 1, 2, 4, 5)[~keep] = float("nan")
    out = cpu_attention.paged_decode(q, poisoned, 0, tables, ctx, 0.125)
    assert torch.equal(out, ref)


@needs_cpu
def test_cpu_decode_other_dtypes_and_shapes_fall_back_to_reference():
    q, pages, tables, ctx = _case(2, 4, 2, 4, [5, 19], seed=1)  # head dim 4: not a multiple of 8
    torch.testing.assert_close(cpu_attention.paged_decode(q, pages, 0, tables, ctx, 0.5),
                               attention_reference.paged_decode(q, pages, 0, tables, ctx, 0.5))
    q, pages, tables, ctx = _case(2, 4, 2, 64, [5, 19], torch.float16, seed=1)
    torch.testing.assert_close(cpu_attention.paged_decode(q, pages, 0, tables, ctx, 0.125),
                               attention_reference.paged_decode(q, pages, 0, tables, ctx, 0.125))
    q16 = q.to(torch.bfloat16)  # a bf16 model: float32 math inside, bf16 out
    q, pages, tables, ctx = _case(2, 4, 2, 64, [5, 19], seed=1)
    out = cpu_attention.paged_decode(q16, pages, 0, tables, ctx, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, attention_reference.paged_decode(q16, pages, 0, tables, ctx, 0.125),
                               atol=2e-2, rtol=2e-2)


@needs_cpu
def test_cpu_decode_rejects_bad_tables():
    q, pages, tables, ctx = _case(1, 4, 2, 64, [20], seed=2)
    with pytest.raises(ValueError, match="out of range"):
        cpu_attention.paged_decode(q, pages, 0, torch.tensor([[0, pages.shape[0]]]), ctx, 0.125)
    with pytest.raises(ValueError, match="beyond the block table"):
        cpu_attention.paged_decode(q, pages, 0, tables, torch.tensor([33]), 0.125)
    with pytest.raises(ValueError, match="context length"):
        cpu_attention.paged_decode(q, pages, 0, tables, torch.tensor([0]), 0.125)


def _dense_prefill(q, pages, layer, seg, scale):
    """Float64 causal attention over the gathered context, written out by hand (GQA by expanding)."""
    bs, hkv = pages.shape[3], pages.shape[4]
    hq = q.shape[1]
    kv = [torch.cat([pages[b, layer, i] for b in seg.block_table.tolist()])[:seg.ctx_len].double()
          for i in (0, 1)]
    k, v = (x.repeat_interleave(hq // hkv, dim=1).transpose(0, 1) for x in kv)  # [Hq, ctx, D]
    qs = q[seg.q_start:seg.q_start + seg.q_len].double().transpose(0, 1)  # [Hq, q_len, D]
    scores = qs @ k.transpose(1, 2) * scale
    qpos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len)[:, None]
    scores = scores.masked_fill(torch.arange(seg.ctx_len)[None, :] > qpos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).float()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_prefill_matches_dense_attention(backend, monkeypatch):
    """Several segments in one batch: a whole prompt (causal), chunks continuing a cached context
    (mask aligned to the end), a one-token chunk; fragmented tables."""
    from shared.engine.attention import PrefillSegment

    if backend == "cpu" and not CPU_OK:
        pytest.skip("the CPU attention kernel did not build")
    monkeypatch.setenv(kernels.ATTN_ENV_VAR, backend)
    attn = get_attention_kernels("cpu")
    hq, hkv, d = 9, 3, 64
    shapes = [(40, 40), (100, 300), (1, 77), (16, 16)]  # (q_len, ctx_len)
    g = torch.Generator().manual_seed(11)
    num_blocks = sum(-(-c // 16) for _, c in shapes) + 5
    pages = torch.randn(num_blocks, 2, 2, 16, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    segs, q_start, used = [], 0, 0
    for q_len, ctx in shapes:
        nb = -(-ctx // 16)
        segs.append(PrefillSegment(q_start, q_len, ctx, torch.tensor(perm[used:used + nb])))
        q_start, used = q_start + q_len, used + nb
    q = torch.randn(q_start, hq, d, generator=g)
    out = attn.paged_prefill(q, pages, 1, segs, d ** -0.5)
    for seg in segs:
        torch.testing.assert_close(out[seg.q_start:seg.q_start + seg.q_len],
                                   _dense_prefill(q, pages, 1, seg, d ** -0.5), atol=1e-5, rtol=1e-5)


def test_build_is_cached_by_source_hash(tmp_path, monkeypatch):
    """First use compiles into the cache dir; a second process state finds the .so there. Without a
    compiler the backend is unavailable and auto-selection falls back to the reference."""
    kernel = cpu_attention.KERNEL
    try:
        monkeypatch.setenv(cpu_attention.CACHE_ENV, str(tmp_path))
        monkeypatch.delenv(kernels.ATTN_ENV_VAR, raising=False)
        kernel.reset()
        if CPU_OK:
            assert cpu_attention.available()
            [so] = tmp_path.glob("paged_attention-*.so")
            mtime = so.stat().st_mtime_ns
            kernel.reset()
            assert cpu_attention.available() and so.stat().st_mtime_ns == mtime  # loaded, not rebuilt
            assert not list(tmp_path.glob("tmp*"))  # temp build dirs cleaned up
        kernel.reset()
        monkeypatch.setenv("CC", "no-such-compiler")
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        monkeypatch.setenv(cpu_attention.CACHE_ENV, str(tmp_path / "other"))
        assert not cpu_attention.available()
        assert "cpu" not in kernels.available_attention_backends("cpu")
        assert get_attention_kernels("cpu").name == "reference"
        monkeypatch.setenv(kernels.ATTN_ENV_VAR, "cpu")
        with pytest.raises(ValueError, match="not available"):
            get_attention_kernels("cpu")
    finally:
        kernel.reset()  # the next use loads the default cache's build again


def test_attention_dispatch(monkeypatch):
    monkeypatch.delenv(kernels.ATTN_ENV_VAR, raising=False)
    auto = get_attention_kernels("cpu")
    assert auto.name == ("cpu" if CPU_OK else "reference")
    assert kernels.available_attention_backends("cpu") == (["cpu", "reference"] if CPU_OK else ["reference"])
    monkeypatch.setenv(kernels.ATTN_ENV_VAR, "reference")
    ref = get_attention_kernels("cpu")
    assert ref.paged_decode is attention_reference.paged_decode
    monkeypatch.setenv(kernels.ATTN_ENV_VAR, "triton")
    with pytest.raises(ValueError, match="does not serve"):
        get_attention_kernels("cpu")
    monkeypatch.setenv(kernels.ATTN_ENV_VAR, "nope")
    with pytest.raises(ValueError, match="unknown"):
        get_attention_kernels("cpu")


# --- engine level -------------------------------------------------------------------------------

def _greedy(loaded, backend, prompts, max_tokens, monkeypatch, **cfg):
    monkeypatch.setenv(kernels.ATTN_ENV_VAR, backend)
    engine = Engine(loaded, EngineConfig(enable_prefix_cache=False, **cfg))
    assert engine.model.attention.name == backend
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [s.output_ids for s in seqs]


def _prompts(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@needs_cpu
def test_engine_greedy_tokens_identical_tiny(tiny, monkeypatch):
    """Batched decode over ragged contexts (one past 1K tokens), in 2 pipeline stages."""
    prompts = _prompts(tiny.config.vocab_size, [5, 40, 300, 1100])
    kw = dict(num_blocks=256, stages=2, max_batched_tokens=512)
    ref = _greedy(tiny, "reference", prompts, 32, monkeypatch, **kw)
    assert _greedy(tiny, "cpu", prompts, 32, monkeypatch, **kw) == ref


@needs_cpu
@pytest.mark.slow
def test_engine_greedy_tokens_identical_smollm2(smollm2, monkeypatch):
    tok = smollm2.tokenizer
    chats = [tok.chat_token_ids([{"role": "user", "content": c}]) for c in (
        "What is the capital of France?",
        "Write a Python function that reverses a linked list, with a docstring and a test.",
    )]
    prompts = chats + _prompts(smollm2.config.vocab_size, [700], seed=1)
    ref = _greedy(smollm2, "reference", prompts, 24, monkeypatch, num_blocks=256)
    assert _greedy(smollm2, "cpu", prompts, 24, monkeypatch, num_blocks=256) == ref


# ---- sliding windows (Gemma 3's local layers, issue 28) ---------------------------------------------------
def _naive(q_rows, k, v, qpos, scale, window):
    """Attention written out: query at position p sees keys at positions (p - window, p] (all <= p if 0)."""
    out = []
    g = q_rows.shape[1] // k.shape[1]
    for row, p in zip(q_rows, qpos):
        lo = max(0, p - window + 1) if window else 0
        kk, vv = k[lo:p + 1].repeat_interleave(g, dim=1), v[lo:p + 1].repeat_interleave(g, dim=1)
        w = torch.softmax(torch.einsum("hd,shd->hs", row, kk) * scale, dim=-1)
        out.append(torch.einsum("hs,shd->hd", w, vv))
    return torch.stack(out)


@pytest.mark.parametrize("window", [1, 15, 16, 17, 100, 512])
def test_a_sliding_window_decode_reads_only_the_last_tokens(window):
    q, pages, tables, ctx = _case(3, 4, 1, 256, [700, 33, 512], seed=window)  # Gemma 3: 4 heads, 1 kv head, d 256
    ref = attention_reference.paged_decode(q, pages, 1, tables, ctx, 0.0625, window)
    for b, n in enumerate(ctx.tolist()):
        k = attention_reference.read_context(pages, 1, 0, tables[b])[:n]
        v = attention_reference.read_context(pages, 1, 1, tables[b])[:n]
        torch.testing.assert_close(ref[b], _naive(q[b:b + 1], k, v, [n - 1], 0.0625, window)[0], atol=1e-5, rtol=1e-5)
    if CPU_OK:
        torch.testing.assert_close(cpu_attention.paged_decode(q, pages, 1, tables, ctx, 0.0625, window), ref,
                                   atol=1e-5, rtol=1e-5)
        assert not torch.allclose(cpu_attention.paged_decode(q, pages, 1, tables, ctx, 0.0625), ref)  # it mattered


@pytest.mark.parametrize("q_len,ctx_len", [(40, 40), (40, 300), (300, 300), (1, 600), (65, 65), (97, 200), (200, 233),
                                           (256, 256), (257, 700)])
@pytest.mark.parametrize("window", [64, 8, 200])
def test_a_sliding_window_prefill_masks_by_distance(q_len, ctx_len, window):
    """Every shape of the query-chunked path (chunks of max(window / 2, 64) rows): a fresh prompt, a prompt
    behind a cached history, chunk edges on and off the window's, a window shorter than a chunk."""
    from shared.engine.attention import PrefillSegment

    d = 32
    g = torch.Generator().manual_seed(q_len + ctx_len)
    nb = -(-ctx_len // 16)
    pages = torch.randn(nb + 2, 1, 2, 16, 2, d, generator=g)
    table = torch.randperm(nb + 2, generator=g)[:nb]
    q = torch.randn(q_len, 4, d, generator=g)
    seg = PrefillSegment(0, q_len, ctx_len, table)
    out = attention_reference.paged_prefill(q, pages, 0, [seg], d ** -0.5, window)
    k = attention_reference.read_context(pages, 0, 0, table)[:ctx_len]
    v = attention_reference.read_context(pages, 0, 1, table)[:ctx_len]
    want = _naive(q, k, v, list(range(ctx_len - q_len, ctx_len)), d ** -0.5, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
