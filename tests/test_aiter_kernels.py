"""kernels/aiter_attention.py against the torch reference: AITER's own Triton kernel source (the pinned
amd-aiter that infra/dev-env.sh installs), run on CPU tensors under Triton's interpreter, through moorage's
backend. What this proves: the backend hands AITER moorage's pages, block tables, query offsets, windows and
GQA groups the way AITER's kernel reads them. What it cannot: speed, or the kernel compiled for a ROCm GPU
(no such hardware here).

`import aiter` runs AITER's HIP JIT set-up, which needs ROCm, so the package is entered here without its
__init__, and the two device queries its Triton modules make on import or launch (the GPU architecture, the
number of compute units) are answered for the interpreter. Nothing else of AITER's is replaced. The
interpreter's bf16 dot products are wrong (tests/test_triton_kernels.py), so the cases run in fp32."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # tests/conftest.py sets it first (for collection's sake)
pytest.importorskip("triton")
if importlib.util.find_spec("aiter") is None:  # infra/dev-env.sh installs it, so this runs in make test
    pytest.skip("amd-aiter is not installed", allow_module_level=True)

from kernels import attention_reference as ref  # noqa: E402
from shared.engine.attention import PrefillSegment  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def aiter_ua():
    """AITER's unified-attention module, entered without aiter/__init__ on a host without ROCm; afterwards
    every aiter module (and the backend bound to them) leaves sys.modules again."""
    before = set(sys.modules)
    if INTERPRETED:
        spec = importlib.util.find_spec("aiter")
        pkg = types.ModuleType("aiter")
        pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["aiter"] = pkg
        arch = importlib.import_module("aiter.ops.triton.utils._triton.arch_info")
        arch.get_arch = lambda: "gfx942"  # asked at import (which fp8 types); no driver under the interpreter
    ua = importlib.import_module("aiter.ops.triton.unified_attention")
    yield ua
    for name in set(sys.modules) - before:
        if name == "aiter" or name.startswith("aiter.") or name == "kernels.aiter_attention":
            del sys.modules[name]


@pytest.fixture
def backend(aiter_ua, monkeypatch):
    """kernels.aiter_attention, with the compute-unit count AITER plans its launch by (`cus`, set per test:
    few programs' worth of units take its 2-D kernel, many its 3-D split-and-reduce one); records which ran."""
    ran = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            ran.append(self.name)
            return self.kernel[grid]

    for name in ("kernel_unified_attention_2d", "kernel_unified_attention_3d"):
        monkeypatch.setattr(aiter_ua, name, Spy(name[-2:], getattr(aiter_ua, name)))
    mod = importlib.import_module("kernels.aiter_attention")
    mod.ran = ran
    if INTERPRETED:
        monkeypatch.setattr(aiter_ua, "get_num_sms", lambda: mod.cus)
    mod.cus = 4
    return mod


def _pages(n, layers, hkv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, layers, 2, 16, hkv, d, generator=g).to(dtype)


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 1, 32), (8, 8, 16), (32, 8, 128)])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("cus", [1, 64], ids=["2d", "3d"])
def test_decode_attention_equals_reference(backend, hq, hkv, d, window, cus):
    """Contexts of one token, a full block, a partial one and long ones, through shuffled block tables padded
    past each context, on a later layer of the pages (a strided view, read in place)."""
    backend.cus = cus
    pages = _pages(80, 2, hkv, d)
    ctx = torch.tensor([1, 16, 17, 300, 611])
    g = torch.Generator().manual_seed(1)
    tables = torch.stack([torch.randperm(80, generator=g)[:39] for _ in ctx])
    q = torch.randn(len(ctx), hq, d, generator=g)
    want = ref.paged_decode(q, pages, 1, tables, ctx, d ** -0.5, window)
    got = backend.paged_decode(q, pages, 1, tables, ctx, d ** -0.5, window)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    # AITER takes its split kernel only for a full-context batch too small to fill the device
    assert backend.ran == (["3d"] if cus == 64 and not window else ["2d"])


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("hq, hkv", [(9, 3), (4, 4)])
def test_prefill_attention_equals_reference(backend, window, hq, hkv):
    """A batch of segments as the engine builds it: a fresh prompt, a turn behind a restored prefix (query rows
    at the end of a longer context), a one-token chunk and a long prefix with a short suffix."""
    d = 32
    pages = _pages(64, 3, hkv, d, seed=2)
    g = torch.Generator().manual_seed(3)
    shapes = [(37, 37), (20, 150), (1, 66), (70, 400)]  # (q_len, ctx_len)
    perm = torch.randperm(64, generator=g)
    segments, start, used = [], 0, 0
    for q_len, ctx_len in shapes:
        n = -(-ctx_len // 16)
        segments.append(PrefillSegment(start, q_len, ctx_len, perm[used:used + n]))
        start += q_len
        used += n
    q = torch.randn(start, hq, d, generator=g)
    want = ref.paged_prefill(q, pages, 2, segments, d ** -0.5, window)
    got = backend.paged_prefill(q, pages, 2, segments, d ** -0.5, window)
    torch.testing.assert_close(got, want, atol=3e-6, rtol=3e-6)
    assert "aiter" in segments[0].cache  # the batch's tensors, built once for every layer of the forward
    again = backend.paged_prefill(q, pages, 1, segments, d ** -0.5, window)
    torch.testing.assert_close(again, ref.paged_prefill(q, pages, 1, segments, d ** -0.5, window),
                               atol=3e-6, rtol=3e-6)


def test_mixed_dtypes_go_to_a_backend_that_converts(backend):
    """bf16 pages under fp32 queries (kv_dtype unlike dtype): AITER's kernel would multiply unlike types, so the
    call goes to triton_attention, which converts."""
    pages = _pages(20, 1, 2, 16, torch.bfloat16)
    tables = torch.randperm(20)[:8][None]
    q = torch.randn(1, 4, 16)
    got = backend.paged_decode(q, pages, 0, tables, torch.tensor([100]), 0.25)
    torch.testing.assert_close(got, ref.paged_decode(q, pages, 0, tables, torch.tensor([100]), 0.25),
                               atol=2e-6, rtol=2e-6)
    segments = [PrefillSegment(0, 30, 100, tables[0])]
    q = torch.randn(30, 4, 16)
    torch.testing.assert_close(backend.paged_prefill(q, pages, 0, segments, 0.25),
                               ref.paged_prefill(q, pages, 0, segments, 0.25), atol=2e-6, rtol=2e-6)
    assert backend.ran == []


def test_bad_shapes_and_untiled_segments_raise(backend):
    pages = _pages(8, 1, 2, 16)
    with pytest.raises(ValueError, match="does not fit"):
        backend.paged_decode(torch.randn(1, 3, 16), pages, 0, torch.zeros(1, 2, dtype=torch.long),
                             torch.tensor([5]), 0.25)
    with pytest.raises(ValueError, match="does not fit"):
        backend.paged_decode(torch.randn(1, 4, 8), pages, 0, torch.zeros(1, 2, dtype=torch.long),
                             torch.tensor([5]), 0.25)
    gap = [PrefillSegment(0, 3, 3, torch.tensor([0])), PrefillSegment(4, 2, 2, torch.tensor([1]))]
    with pytest.raises(ValueError, match="tile"):
        backend.paged_prefill(torch.randn(6, 4, 16), pages, 0, gap, 0.25)
    assert backend.ran == []


def test_registry_offers_aiter_only_on_a_rocm_torch(monkeypatch):
    """The registry never picks AITER on a CUDA build of torch or on CPU, and on a ROCm build takes it first."""
    import kernels

    monkeypatch.delenv(kernels.ATTN_ENV_VAR, raising=False)
    assert "aiter" not in kernels.available_attention_backends("cpu")
    monkeypatch.setattr(torch.version, "hip", None)
    assert "aiter" not in kernels.available_attention_backends("cuda")
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert kernels.available_attention_backends("cuda")[0] == "aiter"


def test_engine_greedy_tokens_identical_with_aiter_attention(backend, tiny):
    """The tiny model's engine with AITER's attention in every layer against the same engine on the reference:
    ragged prompts in chunked prefill (later chunks query behind their own earlier ones), a second round behind
    the first's cached prefix, then batched decode. Greedy tokens identical."""
    from kernels import AttentionKernels
    from tests.attention_rounds import greedy_two_rounds

    want, _ = greedy_two_rounds(tiny)
    got, cached = greedy_two_rounds(tiny, AttentionKernels("aiter", backend.paged_decode, backend.paged_prefill))
    assert got == want
    assert cached[1][2] >= 288  # the second round's long prompt queried behind its cached 300-token prefix
    assert {"2d", "3d"} & set(backend.ran)
