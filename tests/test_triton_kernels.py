"""kernels/triton_attention.py (its prefill: kernels/triton_prefill.py) and kernels/triton_kv.py against the
torch reference, on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is
imported; the registry never picks them on CPU). The same kernels run compiled on a GPU in
tests/gpu/test_triton_gpu.py. The interpreter's bf16 dot products are wrong, so there every attention dot runs
in fp32 (kernels/triton_attention.py): bf16 cases here check the loads, masks and merge; the GPU check covers
the bf16 dots."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # tests/conftest.py sets it first (for collection's sake)

triton = pytest.importorskip("triton")  # a dev dependency: installed by infra/dev-env.sh, so this runs in make test

from kernels import attention_reference as ref_attn  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels import triton_attention, triton_kv  # noqa: E402
from shared.kv_layout import KVLayout  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _pages(n, layers, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, layers, 2, 16, hkv, d, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 1, 32), (8, 8, 16), (32, 8, 128)])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_reference(hq, hkv, d, window, dtype):
    pages = _pages(80, 2, hkv, d, dtype)
    ctx = torch.tensor([1, 16, 17, 300, 611], device=DEVICE)  # one token, a full block, a partial one, long ones
    g = torch.Generator().manual_seed(1)
    tables = torch.stack([torch.randperm(80, generator=g)[:39] for _ in ctx]).to(DEVICE)
    q = torch.randn(len(ctx), hq, d, generator=g).to(dtype).to(DEVICE)
    want = ref_attn.paged_decode(q, pages, 1, tables, ctx, d ** -0.5, window)
    got = triton_attention.paged_decode(q, pages, 1, tables, ctx, d ** -0.5, window)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_decode_splits_cover_long_contexts_and_are_merged():
    """Contexts long enough for several splits: every split's share is merged (a lost split moves the output)."""
    splits, per = triton_attention.num_splits(1, 1, 2048, torch.device(DEVICE))
    assert splits > 1 and splits * per >= 2048
    pages = _pages(140, 1, 1, 32, torch.float32)
    tables = torch.randperm(140)[:128][None].to(DEVICE)
    q = torch.randn(1, 2, 32).to(DEVICE)
    for n in (2048, 1500, 257):
        ctx = torch.tensor([n], device=DEVICE)
        torch.testing.assert_close(triton_attention.paged_decode(q, pages, 0, tables, ctx, 0.2),
                                   ref_attn.paged_decode(q, pages, 0, tables, ctx, 0.2), atol=2e-6, rtol=2e-6)


def _segments(shapes, n_blocks, seed):
    """PrefillSegments tiling the batch in order, (q_len, ctx_len) each, over shuffled distinct blocks."""
    from shared.engine.attention import PrefillSegment

    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    segments, start, used = [], 0, 0
    for q_len, ctx_len in shapes:
        n = -(-ctx_len // 16)
        segments.append(PrefillSegment(start, q_len, ctx_len, perm[used:used + n]))
        start, used = start + q_len, used + n
    return segments, start


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 1, 32), (8, 8, 16), (4, 1, 256)])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_equals_reference(hq, hkv, d, window, dtype):
    """A batch as the engine builds it: a fresh prompt, a turn behind a restored prefix (its rows at the end of a
    longer context), a one-token chunk, a long prefix with a short suffix; tiles that end mid-segment."""
    pages = _pages(64, 3, hkv, d, dtype, seed=2)
    segments, total = _segments([(37, 37), (20, 150), (1, 66), (70, 400)], 64, seed=3)
    q = torch.randn(total, hq, d, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    want = ref_attn.paged_prefill(q, pages, 2, segments, d ** -0.5, window)
    got = triton_attention.paged_prefill(q, pages, 2, segments, d ** -0.5, window)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_prefill_reads_kv_in_the_q_dtype_and_the_plan_once_per_forward():
    """fp32 queries over bf16 pages (kv_dtype unlike dtype) as the reference does (K/V widened), and the tile plan
    built once for every layer of a forward."""
    pages = _pages(30, 2, 2, 32, torch.bfloat16, seed=5)
    segments, total = _segments([(50, 50), (9, 200)], 30, seed=6)
    q = torch.randn(total, 4, 32, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for layer in (0, 1):
        torch.testing.assert_close(triton_attention.paged_prefill(q, pages, layer, segments, 0.2),
                                   ref_attn.paged_prefill(q, pages, layer, segments, 0.2), atol=2e-6, rtol=2e-6)
    assert [k[0] for k in segments[0].cache if isinstance(k, tuple)].count("triton_prefill") == 1


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU's engine check is tests/gpu/test_engine_gpu.py")
def test_engine_greedy_tokens_identical_with_triton_attention(tiny):
    """The tiny model's engine with both Triton kernels in every layer against the same engine on the reference:
    ragged prompts in chunked prefill, a second round behind the first's cached prefix, batched decode."""
    from kernels import AttentionKernels
    from tests.attention_rounds import greedy_two_rounds

    want, _ = greedy_two_rounds(tiny)
    attn = AttentionKernels("triton", triton_attention.paged_decode, triton_attention.paged_prefill)
    got, cached = greedy_two_rounds(tiny, attn)
    assert got == want
    assert cached[1][2] >= 288  # the second round's long prompt queried behind its cached 300-token prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_are_the_reference_s_bytes(dtype):
    pages = _pages(20, 3, 2, 8, dtype)
    for ids in ([3, 7, 1], [0], [19, 0, 19]):
        assert torch.equal(triton_kv.pack_chunk(pages, ids), ref.pack_chunk(pages, ids))
        out = torch.empty(len(ids) * pages[0].numel(), dtype=dtype, device=DEVICE)
        assert triton_kv.pack_chunk_crc(pages, ids, out) == ref.pack_chunk_crc(pages, ids, out.clone())
    buf = _pages(2, 3, 2, 8, dtype, seed=5)
    a, b = pages.clone(), pages.clone()
    ref.unpack_chunk(buf, a, [4, 9])
    assert triton_kv.unpack_chunk_crc(buf.reshape(-1), b, [4, 9]) == ref._crc(buf)
    assert torch.equal(a, b)


@pytest.mark.parametrize("cp, first, n", [(1, 0, 83), (2, 0, 83), (3, 5, 83), (1, 17, 40), (2, 16, 16), (4, 0, 3)])
@pytest.mark.parametrize("stages", [1, 2])
def test_gather_and_scatter_are_the_reference_s_bytes(cp, first, n, stages):
    layout = KVLayout(5, 2, 8, dtype=torch.bfloat16, stages=stages)
    pages = [_pages(20, len(layout.stage_layers(s)), 2, 8, torch.bfloat16, seed=s) for s in range(stages)]
    table = torch.randperm(20)[:6].to(DEVICE)
    want = ref.gather_for_ranks(pages, table, n, cp, layout, first=first)
    got = triton_kv.gather_for_ranks(pages, table, n, cp, layout, first=first)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    dst_ref, dst = [torch.zeros(20, 5, 2, 16, 2, 8, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    ref.scatter_from_rank(want[0], dst_ref, table, want[0].shape[0], first=first // cp)
    triton_kv.scatter_from_rank(want[0].reshape(-1), dst, table, want[0].shape[0], first=first // cp)
    assert torch.equal(dst, dst_ref)


def test_bad_arguments_raise_before_any_byte_moves():
    pages = _pages(20, 2, 2, 8, torch.float32)
    before = pages.clone()
    layout = KVLayout(2, 2, 8)
    with pytest.raises(ValueError, match="out of range"):
        triton_kv.pack_chunk(pages, [25])
    with pytest.raises(ValueError, match="duplicate"):
        triton_kv.unpack_chunk(torch.zeros(2 * pages[0].numel(), device=DEVICE), pages, [1, 1])
    with pytest.raises(ValueError, match="dtype"):
        triton_kv.unpack_chunk(torch.zeros(pages[0].numel(), dtype=torch.float16, device=DEVICE), pages, [1])
    with pytest.raises(ValueError, match="numel"):
        triton_kv.scatter_from_rank(torch.zeros(7, device=DEVICE), pages, [0, 1], 3)
    with pytest.raises(ValueError, match="block table"):
        triton_kv.gather_for_ranks([pages], [0], 40, 1, layout)
    assert torch.equal(pages, before)
