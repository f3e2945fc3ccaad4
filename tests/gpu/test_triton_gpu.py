"""The Triton kernels compiled for the GPU against the torch reference on the same device, at serving sizes (KV
staged to pinned host buffers through them: tests/gpu/test_device_staging_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import attention_reference as ref_attn
from kernels import reference as ref
from kernels import triton_attention, triton_kv
from shared.kv_layout import KVLayout

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (32, 8, 128), (4, 1, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_on_device(hq, hkv, d, dtype, report):
    g = torch.Generator(device="cuda").manual_seed(0)
    n_blocks, batch, ctx_max = 32 * 520, 32, 8192
    pages = torch.randn(n_blocks, 1, 2, 16, hkv, d, device="cuda", generator=g).to(dtype)
    tables = torch.randperm(n_blocks, device="cuda", generator=g)[:batch * 512].view(batch, 512)
    ctx = torch.randint(1, ctx_max + 1, (batch,), device="cuda", generator=g)
    ctx[0], ctx[1] = 1, ctx_max
    q = torch.randn(batch, hq, d, device="cuda", generator=g).to(dtype)
    errs = {}
    for window in (0, 512):
        want = ref_attn.paged_decode(q, pages, 0, tables, ctx, d ** -0.5, window)
        got = triton_attention.paged_decode(q, pages, 0, tables, ctx, d ** -0.5, window)
        errs[window] = float((got.float() - want.float()).abs().max())
    report(shape=f"{hq}/{hkv}/{d}", dtype=str(dtype).split(".")[-1], max_err=f"{max(errs.values()):.1e}")
    assert max(errs.values()) < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 1, 256)])
def test_prefill_attention_on_device(hq, hkv, d, report):
    """A 4K-token chunk behind a 12K-token prefix and a fresh 2K prompt in one batch, bf16, full and windowed
    (Gemma's 512): the Triton kernel against the reference, and both timed (CUDA events, the median of 5)."""
    from shared.engine.attention import PrefillSegment

    g = torch.Generator(device="cuda").manual_seed(1)
    pages = torch.randn(1200, 1, 2, 16, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    perm = torch.randperm(1200, device="cuda", generator=g)
    segments = [PrefillSegment(0, 4096, 16384, perm[:1024]), PrefillSegment(4096, 2048, 2048, perm[1024:1152])]
    q = torch.randn(6144, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    errs, ms = {}, {}
    for window in (0, 512):
        want = ref_attn.paged_prefill(q, pages, 0, segments, d ** -0.5, window)
        got = triton_attention.paged_prefill(q, pages, 0, segments, d ** -0.5, window)
        errs[window] = float((got.float() - want.float()).abs().max())
    for name, fn in (("triton", triton_attention.paged_prefill), ("reference", ref_attn.paged_prefill)):
        times = []
        for _ in range(6):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(q, pages, 0, segments, d ** -0.5)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        ms[name] = sorted(times[1:])[2]
    report(shape=f"{hq}/{hkv}/{d}", max_err=f"{max(errs.values()):.1e}", ms_triton=round(ms["triton"], 2),
           ms_reference=round(ms["reference"], 2))
    assert max(errs.values()) < 3e-2


def test_kv_copies_on_device_are_the_reference_s_bytes(report):
    layout = KVLayout(30, 3, 64, dtype=torch.bfloat16, stages=2)
    pages = [torch.randn(layout.page_shape(s, 4096), device="cuda").to(torch.bfloat16) for s in range(2)]
    ids = torch.randperm(4096, device="cuda")[:64]
    assert torch.equal(triton_kv.pack_chunk(pages[0], ids), ref.pack_chunk(pages[0], ids))
    table = torch.randperm(4096, device="cuda")[:512]
    for cp, first in ((1, 0), (2, 100)):
        want = ref.gather_for_ranks(pages, table, 8000, cp, layout, first=first)
        got = triton_kv.gather_for_ranks(pages, table, 8000, cp, layout, first=first)
        assert all(torch.equal(w, x) for w, x in zip(want, got))
    single = torch.zeros(4096, 30, 2, 16, 3, 64, dtype=torch.bfloat16, device="cuda")
    other = single.clone()
    ref.scatter_from_rank(want[0], single, table, want[0].shape[0])
    triton_kv.scatter_from_rank(want[0], other, table, want[0].shape[0])
    assert torch.equal(single, other)
    report(checked="pack, gather cp1/cp2, scatter at 8K tokens bf16")
