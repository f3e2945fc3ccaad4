"""KV copy kernels, every CPU backend (the torch reference and the C one, kernels/cpu_kv.py): exact round
trips over odd sizes, stages, ranks and dtypes, windows that start mid-block, the C backend byte for byte
equal to the reference, and the dispatch rules."""

from __future__ import annotations

import platform
import re

import pytest
import torch

import kernels
from kernels import cbuild, cpu_kv, cpu_prefault, get_kv_kernels
from kernels import reference as ref
from kernels.reference import rank_num_tokens
from shared.kv_layout import KVLayout, allocate_pages

DTYPES = [torch.float32, torch.bfloat16]
CPU_OK = cpu_kv.available()
needs_cpu = pytest.mark.skipif(not CPU_OK, reason="the CPU KV copy kernel did not build (no C compiler?)")
BACKENDS = [pytest.param(ref, id="reference"), pytest.param(cpu_kv, id="cpu", marks=needs_cpu)]


def test_kernels_resolves_to_moorages_own_package_from_any_directory(tmp_path):
    """Services start from any working directory: `import kernels` must find this repository's package there,
    not another distribution's of the same name (Hugging Face's `kernels`, which transformers >= 5.25
    requires, would shadow it from site-packages; pyproject.toml keeps it out)."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out).resolve() == Path(kernels.__file__).resolve(), out
    assert Path(out).resolve().parent.parent == Path(__file__).resolve().parent.parent


def _random_pages(layout: KVLayout, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(layout.dtype) for p in allocate_pages(layout, num_blocks)]


def _poison(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _token_kv(stage_pages, layout: KVLayout, table: list[int], t: int) -> torch.Tensor:
    """[L, 2, H, D] of token t, read one element path at a time (independent of the kernels)."""
    B = layout.block_size
    return torch.cat([p[table[t // B], :, :, t % B] for p in stage_pages], dim=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_blocks", [1, 3, 16])
@pytest.mark.parametrize("kv", BACKENDS)
def test_pack_unpack_round_trip_into_other_blocks(kv, dtype, n_blocks):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=dtype, stages=2)
    src = _random_pages(layout, 40)
    src_ids = torch.randperm(40)[:n_blocks]
    dst_ids = [(int(i) + 7) % 40 for i in src_ids]
    for s in range(layout.stages):
        buf = kv.pack_chunk(src[s], src_ids)
        assert buf.is_contiguous() and buf.shape == (n_blocks, *src[s].shape[1:])
        assert torch.equal(buf, src[s][src_ids])
        dst = _poison(src[s].shape, dtype)
        kv.unpack_chunk(buf.flatten(), dst, dst_ids)  # flat buffer, as landed from the store
        assert torch.equal(dst[dst_ids], src[s][src_ids])
        others = [b for b in range(40) if b not in dst_ids]
        assert dst[others].isnan().all()  # untouched


@pytest.mark.parametrize("kv", BACKENDS)
def test_pack_into_preallocated_flat_out(kv):
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)
    (pages,) = _random_pages(layout, 20)
    ids = list(range(3, 19))
    out = _poison((pages[0].numel() * len(ids),), torch.float32)
    assert kv.pack_chunk(pages, ids, out=out) is out
    assert torch.equal(out.view(len(ids), *pages.shape[1:]), pages[ids])
    with pytest.raises(ValueError, match="numel"):
        kv.pack_chunk(pages, ids, out=torch.empty(out.numel() - 1))
    with pytest.raises(ValueError, match="dtype"):  # floats convert (compact pool objects); nothing else does
        kv.pack_chunk(pages, ids, out=torch.empty(out.numel(), dtype=torch.int32))
    half = kv.pack_chunk(pages, ids, out=torch.empty(out.numel(), dtype=torch.bfloat16))
    assert torch.equal(half.view(len(ids), *pages.shape[1:]), pages[ids].to(torch.bfloat16))


LAYOUTS = [
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, stages=1),
    KVLayout(num_layers=5, num_kv_heads=1, head_dim=4, stages=2),  # uneven split 3 + 2
    KVLayout(num_layers=4, num_kv_heads=2, head_dim=2, stages=3),  # 2 + 1 + 1
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout_i", range(len(LAYOUTS)))
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 37, 255, 257])
@pytest.mark.parametrize("kv", BACKENDS)
def test_gather_scatter_round_trip(kv, dtype, layout_i, cp, num_tokens):
    base = LAYOUTS[layout_i]
    layout = KVLayout(base.num_layers, base.num_kv_heads, base.head_dim, dtype=dtype, stages=base.stages)
    B, L, H, D = layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_dim
    nb_prefill = -(-num_tokens // B) + 3
    prefill = _random_pages(layout, nb_prefill, seed=num_tokens)
    table = torch.randperm(nb_prefill)[: -(-num_tokens // B)].tolist()

    outs = [_poison((rank_num_tokens(num_tokens, cp, r) * L * 2 * H * D,), dtype) for r in range(cp)]
    bufs = kv.gather_for_ranks(prefill, table, num_tokens, cp, layout, outs=outs)
    assert all(b is o for b, o in zip(bufs, outs))
    assert sum(b.numel() for b in bufs) == num_tokens * L * 2 * H * D
    assert not any(b.isnan().any() for b in bufs)  # every element written

    decode_layout = KVLayout(L, H, D, dtype=dtype, stages=1)
    for r, flat in enumerate(bufs):
        T_r = rank_num_tokens(num_tokens, cp, r)
        buf = flat.view(T_r, L, 2, H, D)
        for i in range(T_r):  # buffer order: local i is global token r + i * cp
            assert torch.equal(buf[i], _token_kv(prefill, layout, table, r + i * cp))
        nb = -(-T_r // B) + 2
        (pages,) = allocate_pages(decode_layout, nb)
        pages.fill_(float("nan"))
        dtable = list(range(nb - 1, 1, -1))[: -(-T_r // B)]  # reversed, skipping blocks 0 and 1
        kv.scatter_from_rank(buf, pages, dtable, T_r)
        for i in range(T_r):
            assert torch.equal(_token_kv([pages], decode_layout, dtable, i),
                               _token_kv(prefill, layout, table, r + i * cp))
        assert pages[[0, 1]].isnan().all()  # blocks outside the table untouched
        written = torch.zeros(nb * B, dtype=torch.bool)
        for i in range(T_r):
            written[dtable[i // B] * B + i % B] = True
        slot_nan = pages.permute(0, 3, 1, 2, 4, 5).reshape(nb * B, -1).isnan()
        assert not slot_nan[written].any() and slot_nan[~written].all()  # partial tail untouched


@pytest.mark.parametrize("kv", BACKENDS)
def test_gather_fewer_tokens_than_ranks_and_empty(kv):
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, stages=2)
    pages = _random_pages(layout, 2)
    bufs = kv.gather_for_ranks(pages, [1], 2, 4, layout)
    assert [b.shape[0] for b in bufs] == [1, 1, 0, 0]
    assert torch.equal(bufs[1][0], _token_kv(pages, layout, [1], 1))
    assert [b.shape[0] for b in kv.gather_for_ranks(pages, [], 0, 2, layout)] == [0, 0]


@pytest.mark.parametrize("kv", BACKENDS)
def test_validation_errors(kv):
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=2, stages=2)
    pages = allocate_pages(layout, 4)
    with pytest.raises(ValueError, match="block table"):
        kv.gather_for_ranks(pages, [0, 1], 33, 2, layout)
    with pytest.raises(ValueError, match="out of range"):
        kv.gather_for_ranks(pages, [0, 4], 20, 2, layout)
    with pytest.raises(ValueError, match="cp"):
        kv.gather_for_ranks(pages, [0], 3, 0, layout)
    with pytest.raises(ValueError, match="stage pages"):
        kv.gather_for_ranks(pages[:1], [0], 3, 1, layout)
    with pytest.raises(ValueError, match="stage 1 pages"):
        kv.gather_for_ranks([pages[0], pages[0]], [0], 3, 1, layout)
    with pytest.raises(ValueError, match="outs"):
        kv.gather_for_ranks(pages, [0], 3, 1, layout, outs=[torch.empty(5)])
    with pytest.raises(ValueError, match="duplicate"):
        kv.unpack_chunk(kv.pack_chunk(pages[0], [0, 1]), pages[0], [2, 2])
    with pytest.raises(ValueError, match="numel"):
        kv.unpack_chunk(torch.empty(3), pages[0], [2])
    with pytest.raises(ValueError, match="expected pages"):
        kv.pack_chunk(torch.empty(4, 2, 2, 16), [0])
    (dpages,) = allocate_pages(KVLayout(3, 1, 2), 4)
    with pytest.raises(ValueError, match="numel"):
        kv.scatter_from_rank(torch.empty(5, 3, 2, 1, 2), dpages, [0], 6)
    with pytest.raises(ValueError, match="dtype"):
        kv.scatter_from_rank(torch.empty(5, 3, 2, 1, 2, dtype=torch.bfloat16), dpages, [0], 5)
    with pytest.raises(ValueError, match="block table"):
        kv.scatter_from_rank(torch.empty(17, 3, 2, 1, 2), dpages, [0], 17)
    with pytest.raises(ValueError, match="duplicate"):
        kv.scatter_from_rank(torch.empty(17, 3, 2, 1, 2), dpages, [0, 0], 17)


@pytest.mark.parametrize("kv", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cp", [1, 3])
@pytest.mark.parametrize("first,end", [(0, 0), (5, 5), (3, 17), (16, 33), (17, 100), (250, 257)])
def test_gather_and_scatter_a_window_that_starts_mid_block(kv, dtype, cp, first, end):
    """first > 0 (a handoff window cut at a byte offset): the same rows as the whole gather, and a
    window scattered alone writes exactly its tokens' slots."""
    layout = KVLayout(num_layers=5, num_kv_heads=1, head_dim=4, dtype=dtype, stages=2)
    pages = _random_pages(layout, 20, seed=first + end)
    table = torch.randperm(20)[:17].tolist()
    whole = ref.gather_for_ranks(pages, table, end, cp, layout)
    part = kv.gather_for_ranks(pages, table, end, cp, layout, first=first)
    for r in range(cp):
        keep = [i for i, t in enumerate(range(r, end, cp)) if t >= first]
        assert part[r].shape[0] == rank_num_tokens(end, cp, r, first) == len(keep)
        assert torch.equal(part[r], whole[r][keep])
    decode_layout = KVLayout(5, 1, 4, dtype=dtype)
    (dst,) = allocate_pages(decode_layout, 20)
    dst.fill_(float("nan"))
    dtable = list(range(19, 2, -1))
    rows = ref.gather_for_ranks(pages, table, end, 1, layout, first=first)[0]
    kv.scatter_from_rank(rows, dst, dtable, end - first, first)
    for t in range(end):
        got = _token_kv([dst], decode_layout, dtable, t)
        assert torch.equal(got, _token_kv(pages, layout, table, t)) if t >= first else got.isnan().all()


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_backend_equals_reference_at_model_sizes(dtype):
    """SmolLM2's layout (30 layers, 3 heads x 64), random tables, a partial last block: bit for bit."""
    layout = KVLayout(30, 3, 64, dtype=dtype)
    pages = _random_pages(layout, 24, seed=3)
    table = torch.randperm(24)[:21].tolist()
    n = 20 * 16 + 5
    a, b = ref.gather_for_ranks(pages, table, n, 1, layout)[0], cpu_kv.gather_for_ranks(pages, table, n, 1, layout)[0]
    assert torch.equal(a, b)
    pa, pb = _poison(pages[0].shape, dtype), _poison(pages[0].shape, dtype)
    ref.scatter_from_rank(a, pa, table, n)
    cpu_kv.scatter_from_rank(a, pb, table, n)
    assert torch.equal(pa.nan_to_num(0.5), pb.nan_to_num(0.5))
    ids = table[:16]
    assert torch.equal(ref.pack_chunk(pages[0], ids), cpu_kv.pack_chunk(pages[0], ids))


@needs_cpu
def test_cpu_backend_takes_the_reference_path_for_strided_pages():
    layout = KVLayout(2, 1, 4)
    big = _random_pages(KVLayout(4, 1, 4), 6)[0]
    pages = big[:, :2]  # a non-contiguous view: the C routine cannot address it
    assert not pages.is_contiguous()
    assert torch.equal(cpu_kv.pack_chunk(pages, [4, 1]), pages[[4, 1]])
    assert torch.equal(cpu_kv.gather_for_ranks([pages], [2, 0], 20, 1, layout)[0],
                       ref.gather_for_ranks([pages.contiguous()], [2, 0], 20, 1, layout)[0])


@pytest.mark.parametrize("kv", BACKENDS)
def test_window_validation(kv):
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2)
    pages = allocate_pages(layout, 4)
    with pytest.raises(ValueError, match="first token"):
        kv.gather_for_ranks(pages, [0, 1], 20, 1, layout, first=21)
    with pytest.raises(ValueError, match="first token"):
        kv.scatter_from_rank(torch.empty(1, 2, 2, 1, 2), pages[0], [0], 1, -1)
    with pytest.raises(ValueError, match="block table"):  # tokens [10, 20) need two table entries
        kv.scatter_from_rank(torch.empty(10, 2, 2, 1, 2), pages[0], [0], 10, 10)


def test_prefault_changes_no_byte():
    """cpu_prefault.prefault faults blocks in (decode, while a handoff is on the wire) and leaves every byte
    as it was: written blocks keep their data, fresh ones stay zero."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64)
    (pages,) = allocate_pages(layout, 64)
    pages[3].normal_()
    before = pages.clone()
    ok = cpu_prefault.prefault(pages, [3, 4, 5, 9, 40, 41])
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    if platform.system() == "Linux" and release >= (5, 14):  # MADV_POPULATE_WRITE exists
        assert ok
    assert torch.equal(pages, before)
    assert cpu_prefault.prefault(pages[:, :1], [1]) is False  # not contiguous: nothing done
    assert cpu_prefault.prefault(pages, []) is False


def test_prefault_populates_in_bounded_pieces(monkeypatch):
    """One madvise holds the process's mmap lock for its whole range (a saturated host froze prefill for
    seconds behind one 16 MiB call): prefault covers each run of blocks in calls of at most
    POPULATE_PIECE_BYTES, contiguous and complete."""
    layout = KVLayout(num_layers=4, num_kv_heads=3, head_dim=64)
    (pages,) = allocate_pages(layout, 64)
    block_bytes = pages[0].numel() * pages.element_size()
    calls = []

    class Libc:
        @staticmethod
        def madvise(addr, length, advice):
            calls.append((addr, length))
            return 0

    monkeypatch.setattr(cpu_prefault, "_libc", [Libc()])
    blocks = [*range(2, 2 + 3 * cpu_prefault.POPULATE_PIECE_BYTES // block_bytes + 3), 50]
    assert cpu_prefault.prefault(pages, blocks)
    assert max(n for _, n in calls) <= cpu_prefault.POPULATE_PIECE_BYTES
    assert len(calls) >= 5  # the long run in four or more pieces, block 50 in one
    base = pages.data_ptr()
    runs = [(base + 2 * block_bytes, base + (blocks[-2] + 1) * block_bytes), (base + 50 * block_bytes, base + 51 * block_bytes)]
    for lo, hi in runs:  # each run covered exactly, piece after piece (from its page-aligned start)
        mine = sorted(c for c in calls if lo - cpu_prefault._PAGE < c[0] < hi)
        assert mine[0][0] == lo - lo % cpu_prefault._PAGE and sum(n for _, n in mine) == hi - mine[0][0]
        assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))


def test_dispatch_default_on_cpu(monkeypatch):
    """The C backend when it builds, else the reference."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    k = get_kv_kernels("cpu")
    assert k.name == ("cpu" if CPU_OK else "reference")
    assert k.pack_chunk is (cpu_kv.pack_chunk if CPU_OK else ref.pack_chunk)
    assert get_kv_kernels(torch.device("cpu")) is k
    assert kernels.available_backends("cpu") == (["cpu", "reference"] if CPU_OK else ["reference"])


def test_dispatch_env_override(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert get_kv_kernels("cpu").name == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="unknown"):
        get_kv_kernels("cpu")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="does not serve"):
        get_kv_kernels("cpu")


def test_dispatch_unavailable_backend_is_never_imported(monkeypatch):
    import sys
    # tests/test_triton_kernels.py imports triton itself; what counts is that selecting did not
    already = {m for m in ("triton", "aiter") if m in sys.modules}
    kernels.register_backend("fake", "kernels._no_such_backend", ("cpu",), lambda: False)
    try:
        monkeypatch.setenv(kernels.ENV_VAR, "fake")
        with pytest.raises(ValueError, match="not available"):
            get_kv_kernels("cpu")
        monkeypatch.delenv(kernels.ENV_VAR)
        assert get_kv_kernels("cpu").name == ("cpu" if CPU_OK else "reference")
        assert "kernels._no_such_backend" not in sys.modules
        assert {m for m in ("triton", "aiter") if m in sys.modules} == already
    finally:
        kernels._REGISTRY.pop("fake")


def test_an_auto_selected_backend_that_fails_to_import_is_passed_over_with_a_warning(monkeypatch, caplog):
    """A backend that is available (its package found) but raises on import, first in line: auto-selection
    logs why and takes the next, and never tries it again; forcing it raises its import error."""
    saved = dict(kernels._REGISTRY)
    kernels._REGISTRY.clear()
    kernels.register_backend("broken", "kernels._no_such_backend", ("cpu",), lambda: True)
    kernels._REGISTRY.update(saved)
    try:
        monkeypatch.delenv(kernels.ENV_VAR, raising=False)
        with caplog.at_level("WARNING", logger="kernels.registry"):
            assert get_kv_kernels("cpu").name == ("cpu" if CPU_OK else "reference")
        assert "'broken' (kernels._no_such_backend) failed to import" in caplog.text
        assert "ModuleNotFoundError" in kernels._KV.broken["broken"]
        assert "broken" not in kernels.available_backends("cpu")
        caplog.clear()
        assert get_kv_kernels("cpu").name == ("cpu" if CPU_OK else "reference")
        assert not caplog.text  # passed over for good: not imported, nor warned about, again
        monkeypatch.setenv(kernels.ENV_VAR, "broken")
        with pytest.raises(ImportError):
            get_kv_kernels("cpu")
    finally:
        kernels._REGISTRY.clear()
        kernels._REGISTRY.update(saved)
        kernels._KV.broken.pop("broken", None)


# --- the C backend's own paths: merged runs, thread split, id forms, checks before writing ---

# (MIN_SPLIT_BYTES, STREAM_BYTES): all threads, streaming stores / all threads, plain stores / one thread, streaming
KNOBS = [(0, 0), (0, 1 << 62), (1 << 62, 0)]


def _knobs(monkeypatch, knobs: tuple[int, int]) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # several threads on any host
    monkeypatch.setattr(cpu_kv, "MIN_SPLIT_BYTES", knobs[0])
    monkeypatch.setattr(cpu_kv, "STREAM_BYTES", knobs[1])


@needs_cpu
@pytest.mark.parametrize("knobs", KNOBS, ids=["stream", "threads", "one-thread"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids", [[5, 6, 7, 8, 9], [3, 4, 9, 10, 11, 0, 1, 20], [7], [2, 1, 0], [4, 5, 5, 6]],
                         ids=["one-run", "runs", "single", "descending", "repeat"])
def test_cpu_pack_unpack_runs_and_threads_equal_reference(monkeypatch, knobs, dtype, ids):
    """Runs of consecutive ids are one copy, threads split the bytes anywhere (mid-block, mid-run):
    byte for byte the reference, and unpack leaves other blocks alone."""
    _knobs(monkeypatch, knobs)
    layout = KVLayout(num_layers=3, num_kv_heads=3, head_dim=5, dtype=dtype)  # odd sizes: splits fall mid-row
    (pages,) = _random_pages(layout, 24, seed=len(ids))
    got = cpu_kv.pack_chunk(pages, torch.tensor(ids))
    assert torch.equal(got, ref.pack_chunk(pages, ids))
    if len(set(ids)) == len(ids):
        a, b = _poison(pages.shape, dtype), _poison(pages.shape, dtype)
        ref.unpack_chunk(got, a, ids)
        cpu_kv.unpack_chunk(got.flatten(), b, ids)
        assert torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))


@needs_cpu
@pytest.mark.parametrize("knobs", KNOBS, ids=["stream", "threads", "one-thread"])
@pytest.mark.parametrize("cp,first,end", [(1, 0, 100), (3, 17, 100), (4, 5, 64), (2, 31, 33)])
def test_cpu_gather_scatter_threads_equal_reference(monkeypatch, knobs, cp, first, end):
    """Every rank in one call, threads over blocks or not, streaming stores or not (rows of 288 bytes: a
    streamed middle and a plain tail): the reference's bytes, and a scatter writes exactly its slots."""
    _knobs(monkeypatch, knobs)
    layout = KVLayout(num_layers=5, num_kv_heads=2, head_dim=36, stages=2)
    pages = _random_pages(layout, 12, seed=end)
    table = torch.randperm(12)[:7]
    want = ref.gather_for_ranks(pages, table, end, cp, layout, first=first)
    got = cpu_kv.gather_for_ranks(pages, table, end, cp, layout, first=first)
    assert len(got) == cp and all(torch.equal(a, b) for a, b in zip(want, got))
    (a,) = allocate_pages(KVLayout(5, 2, 36), 12)
    a.fill_(float("nan"))
    b = a.clone()
    ref.scatter_from_rank(want[0], a, table, want[0].shape[0], first)
    cpu_kv.scatter_from_rank(want[0], b, table, want[0].shape[0], first)
    assert torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))


@needs_cpu
@pytest.mark.parametrize("form", ["list", "int32", "strided", "tuple", "range", "numpy-ints"])
def test_cpu_block_id_forms(form):
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
    (pages,) = _random_pages(layout, 30)
    base = [4, 9, 10, 11, 2]
    ids = {"list": base, "int32": torch.tensor(base, dtype=torch.int32), "tuple": tuple(base),
           "strided": torch.tensor([x for b in base for x in (b, -1)])[::2], "range": range(3, 8),
           "numpy-ints": [__import__("numpy").int64(b) for b in base]}[form]
    want = pages[torch.tensor(list(ids), dtype=torch.long)]
    assert torch.equal(cpu_kv.pack_chunk(pages, ids), want)
    (dst,) = allocate_pages(layout, 30)
    cpu_kv.unpack_chunk(want, dst, ids)
    assert torch.equal(dst[torch.tensor(list(ids), dtype=torch.long)], want)
    table = ids
    n = 16 * len(base) - 3
    assert torch.equal(cpu_kv.gather_for_ranks([pages], table, n, 1, layout)[0],
                       ref.gather_for_ranks([pages], list(ids), n, 1, layout)[0])


@needs_cpu
def test_cpu_bad_ids_raise_the_reference_error_before_writing():
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
    (pages,) = _random_pages(layout, 8)
    before = pages.clone()
    buf = torch.ones(3 * pages[0].numel())
    for bad, match in (([1, 2, 8], "out of range"), ([3, -1, 4], "out of range"), ([1, 5, 1], "duplicate")):
        with pytest.raises(ValueError, match=match):
            cpu_kv.unpack_chunk(buf, pages, bad)
        with pytest.raises(ValueError, match=match):
            cpu_kv.scatter_from_rank(buf, pages, bad, 48)  # 48 tokens: three table entries
        with pytest.raises(ValueError, match=match):
            cpu_kv.unpack_chunk_crc(buf, pages, bad)
    assert torch.equal(pages, before)
    with pytest.raises(ValueError, match="out of range"):
        cpu_kv.pack_chunk_crc(pages, [0, 9, 1], buf)
    with pytest.raises(ValueError, match="integer"):
        cpu_kv.pack_chunk(pages, torch.tensor([True, False]))
    with pytest.raises(ValueError, match="out of range"):
        cpu_kv.gather_for_ranks([pages], [0, 9], 20, 2, layout)
    assert torch.equal(cpu_kv.pack_chunk(pages, [1.0, 2.0]), pages[[1, 2]])  # as the reference: truncated


@needs_cpu
def test_the_c_sources_are_files_and_an_edited_one_builds_anew(tmp_path, monkeypatch):
    """The kernels' C lives in kernels/csrc/*.c, read when a kernel builds; the cache key is the file's text,
    so an edit builds a new .so (never the stale one) and the unedited text finds its build again."""
    assert cpu_kv.KERNEL.source == cbuild.CSRC / "kv_copy.c" and cpu_kv.KERNEL.source.is_file()
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path / "cache"))
    src = tmp_path / "answer.c"
    src.write_text("int moorage_answer(void) { return 41; }\n")
    kernel = cbuild.CKernel("answer", src, "moorage_answer", [], [[]])
    assert kernel.load()() == 41
    src.write_text("int moorage_answer(void) { return 42; }\n")
    kernel.reset()
    assert kernel.load()() == 42
    assert len(list((tmp_path / "cache").glob("answer-*.so"))) == 2


@needs_cpu
def test_cpu_functions_reload_after_reset_and_fall_back_without_a_compiler(tmp_path, monkeypatch):
    """Both C entry points come from one library (cbuild's `more` symbols): after a reset they load
    again; with no compiler and an empty cache the module's functions still answer, through the reference."""
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
    (pages,) = _random_pages(layout, 6)
    try:
        cpu_kv.KERNEL.reset()
        assert torch.equal(cpu_kv.pack_chunk(pages, [4, 1]), pages[[4, 1]])  # moorage_kv_blocks, reloaded
        cpu_kv.KERNEL.reset()
        monkeypatch.setenv("CC", "no-such-compiler")
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
        assert not cpu_kv.available()
        assert torch.equal(cpu_kv.pack_chunk(pages, [4, 1]), pages[[4, 1]])
        (dst,) = allocate_pages(layout, 6)
        cpu_kv.scatter_from_rank(ref.gather_for_ranks([pages], [2, 0], 20, 1, layout)[0], dst, [2, 0], 20)
        assert torch.equal(dst[2], pages[2]) and torch.equal(dst[0, :, :, :4], pages[0, :, :, :4])
    finally:
        monkeypatch.undo()
        cpu_kv.KERNEL.reset()  # the next use loads the default cache's build again
    assert cpu_kv.available()


def test_threads_caps_this_threads_copies_only():
    """kernels.cpu_kv.threads(n): copies made by the calling thread use at most n threads, restored after;
    other threads keep torch's count."""
    import threading

    full = torch.get_num_threads()
    seen = {}
    with cpu_kv.threads(1):
        seen["inside"] = cpu_kv._nthreads()
        with cpu_kv.threads(5):
            seen["nested"] = cpu_kv._nthreads()
        seen["after nested"] = cpu_kv._nthreads()
        other = threading.Thread(target=lambda: seen.__setitem__("other thread", cpu_kv._nthreads()))
        other.start()
        other.join()
    seen["after"] = cpu_kv._nthreads()
    assert seen == {"inside": 1, "nested": min(5, full), "after nested": 1, "other thread": full, "after": full}


@needs_cpu
def test_one_thread_gather_equals_reference():
    layout = KVLayout(num_layers=5, num_kv_heads=2, head_dim=36)
    pages = _random_pages(layout, 40, seed=3)
    table = torch.randperm(40)[:30]
    with cpu_kv.threads(1):
        got = cpu_kv.gather_for_ranks(pages, table, 470, 1, layout, first=3)
    assert torch.equal(got[0], ref.gather_for_ranks(pages, table, 470, 1, layout, first=3)[0])


# pack/unpack with the packed bytes' CRC-32C (a pool object's payload checksum), computed while copying
CRC_LAYOUTS = [KVLayout(num_layers=3, num_kv_heads=3, head_dim=5),            # odd rows: splits mid-row
               KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16),  # 32 KiB blocks
               KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)]          # SmolLM2's: 720 KiB blocks


def _crc32c(t: torch.Tensor) -> int:
    import crc32c

    return crc32c.crc32c(t.reshape(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("layout_i", range(len(CRC_LAYOUTS)))
@pytest.mark.parametrize("ids", [[5, 6, 7, 8, 9], [3, 4, 9, 10, 11, 0, 1, 20], [7], []],
                         ids=["one-run", "runs", "single", "empty"])
@pytest.mark.parametrize("kv", BACKENDS)
def test_pack_and_unpack_crc_equal_crc32c_of_the_packed_bytes(kv, layout_i, ids):
    """The long runs take three interleaved CRC chains, combined; short ones one chain: either way the
    crc32c package's CRC of the packed bytes, and the same bytes copied as pack_chunk/unpack_chunk."""
    layout = CRC_LAYOUTS[layout_i]
    (pages,) = _random_pages(layout, 24, seed=layout_i)
    out = torch.empty((len(ids), *pages.shape[1:]), dtype=layout.dtype)
    crc = kv.pack_chunk_crc(pages, ids, out)
    assert torch.equal(out, ref.pack_chunk(pages, ids)) and crc == _crc32c(out)
    dst = _poison(pages.shape, layout.dtype)
    assert kv.unpack_chunk_crc(out.flatten(), dst, [(i + 1) % 24 for i in ids]) == crc
    want = _poison(pages.shape, layout.dtype)
    ref.unpack_chunk(out, want, [(i + 1) % 24 for i in ids])
    assert torch.equal(dst.nan_to_num(0.5), want.nan_to_num(0.5))
    if ids:
        out.view(torch.uint8).reshape(-1)[-1] ^= 1  # one bit of the last byte: another CRC
        assert kv.unpack_chunk_crc(out, dst, ids) != crc


@needs_cpu
@pytest.mark.parametrize("knobs", KNOBS, ids=["stream", "threads", "one-thread"])
def test_cpu_crc_split_over_threads_anywhere_equals_crc32c(monkeypatch, knobs):
    """Three threads split the bytes mid-block and mid-run; their CRCs combine to the whole's."""
    _knobs(monkeypatch, knobs)
    layout = CRC_LAYOUTS[1]
    (pages,) = _random_pages(layout, 24, seed=3)
    ids = [2, 3, 4, 5, 11, 12, 0]
    out = torch.empty((len(ids), *pages.shape[1:]), dtype=layout.dtype)
    assert cpu_kv.pack_chunk_crc(pages, ids, out) == _crc32c(ref.pack_chunk(pages, ids))
    assert cpu_kv.unpack_chunk_crc(out, pages.clone(), list(range(7))) == _crc32c(out)


@needs_cpu
def test_a_build_without_the_crc_instruction_refuses_a_crc_before_copying():
    """Without -march=native there is no CRC-32C instruction: the C routine answers -5 and moves no
    byte, so cpu_kv's crc functions take the reference's path (still the right CRC)."""
    plain = cbuild.CKernel("kv_copy_nocrc", cpu_kv.KERNEL.source, "moorage_kv_tokens", cpu_kv._TOKENS_ARGS,
                           [["-fopenmp"], ["-fopenmp-simd"]], base_flags=cbuild.BASE_FLAGS,
                           more={"moorage_kv_blocks": cpu_kv._BLOCKS_ARGS})
    assert plain.available()
    fn = plain.symbol_fn("moorage_kv_blocks")
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
    (pages,) = _random_pages(layout, 4)
    out = torch.zeros(2 * pages[0].numel())
    ids = torch.tensor([1, 2])
    import ctypes

    crc = ctypes.c_uint32(7)
    assert fn(pages.data_ptr(), out.data_ptr(), ids.data_ptr(), 2, 4, pages[0].numel() * 4, 0, 0, 1 << 62, 1,
              ctypes.byref(crc)) == -5
    assert crc.value == 7 and not out.any()
    assert fn(pages.data_ptr(), out.data_ptr(), ids.data_ptr(), 2, 4, pages[0].numel() * 4, 0, 0, 1 << 62, 1,
              None) == 0
    assert torch.equal(out, pages[[1, 2]].flatten())


def test_the_registries_name_only_modules_that_exist():
    import importlib.util

    for registry in (kernels._REGISTRY, kernels._ATTN_REGISTRY):
        for backend in registry.values():
            assert importlib.util.find_spec(backend.module) is not None, backend


NARROW = [torch.bfloat16, torch.float8_e4m3fn]
_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


@pytest.mark.parametrize("ids", [[5, 6, 7, 8, 9], [3, 4, 9, 10, 11, 0, 1, 20], [7], []],
                         ids=["one-run", "runs", "single", "empty"])
@pytest.mark.parametrize("narrow", NARROW, ids=str)
@pytest.mark.parametrize("kv", BACKENDS)
def test_compact_pack_rounds_like_torch_and_unpack_widens_exactly(kv, narrow, ids):
    """Compact pool objects (pool.dtype bfloat16 or float8_e4m3fn on float32 KV): pack converts in its copy,
    bit for bit torch's cast (round to nearest even; e4m3fn saturates at +-448, infinities included), C
    kernel and reference alike, with the CRC of the bytes it wrote; unpack widens exactly, checking the CRC
    of the bytes it read. The C kernel threads over blocks. Edge values and random bit patterns (NaNs of
    both signs, subnormals of both types, the rounding ties) are in the pages."""
    layout = CRC_LAYOUTS[2]  # SmolLM2's blocks
    (pages,) = _random_pages(layout, 24, seed=3)
    pages[4, 0, 0, 0, 0, :4] = torch.tensor([1e-40, -0.0, float("inf"), 3.0e38])  # subnormal, signed zero, big
    pages[4, 0, 0, 1, 0, :12] = torch.tensor([448.0, 464.0, 480.0, -1e6, float("-inf"), 0.0009765625, 0.0029296875,
                                              0.0146484375, 2.0 ** -9, 2.0 ** -6, -2.0 ** -7 * 1.0625, 447.9])
    pages[7].view(-1)[:4096] = torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), generator=torch.Generator().manual_seed(5),
                                             dtype=torch.int64).to(torch.int32).view(torch.float32)
    out = torch.empty(len(ids) * pages[0].numel(), dtype=narrow)
    crc = kv.pack_chunk_crc(pages, ids, out)
    want = pages[ids].to(narrow).reshape(-1)
    nan = want.float().isnan()  # a NaN's payload and sign: torch's own casts differ (scalar vs vector paths)
    assert torch.equal(out.float().isnan(), nan) and crc == _crc32c(out)
    assert torch.equal(out.view(_BITS[narrow])[~nan], want.view(_BITS[narrow])[~nan])
    dst = _poison(pages.shape, layout.dtype)
    back = [(i + 1) % 24 for i in ids]
    assert kv.unpack_chunk_crc(out, dst, back) == crc
    assert torch.equal(dst[back].reshape(-1).nan_to_num(7.0), want.float().nan_to_num(7.0))
    if ids:
        out.view(torch.uint8)[-1] ^= 1
        assert kv.unpack_chunk_crc(out, dst, back) != crc


@needs_cpu
def test_compact_pack_goes_through_the_c_kernel():
    """Not the reference's convert-then-copy: the C routine takes float32 -> bfloat16 or e4m3fn (and back) itself."""
    layout = CRC_LAYOUTS[2]
    (pages,) = _random_pages(layout, 8, seed=1)
    out = torch.empty(3 * pages[0].numel(), dtype=torch.bfloat16)
    assert cpu_kv._convert_crc(pages, out, [1, 5, 2], 0) == _crc32c(out)
    assert cpu_kv._convert_crc(pages, out, [1, 5, 2], 1) == _crc32c(out)
    fp8 = torch.empty(3 * pages[0].numel(), dtype=torch.float8_e4m3fn)
    assert cpu_kv._convert_crc(pages, fp8, [1, 5, 2], 0) == _crc32c(fp8)
    assert torch.equal(fp8.view(torch.uint8), pages[[1, 5, 2]].to(torch.float8_e4m3fn).view(-1).view(torch.uint8))
    assert cpu_kv._convert_crc(pages, out.view(torch.float16), [1, 5, 2], 0) is None  # other pairs: the reference's
    with pytest.raises(ValueError, match="out of range"):
        cpu_kv.pack_chunk_crc(pages, [0, 9, 1], out)
