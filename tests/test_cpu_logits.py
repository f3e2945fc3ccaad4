"""The output projection kernel for a few rows (kernels/cpu_logits.py): F.linear's values for every row count
it takes, whatever the thread count, and torch's own path for the shapes it does not run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_logits

pytestmark = pytest.mark.skipif(not cpu_logits.available(), reason="no C compiler: the torch path serves")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 12, 13, 33, 64])
@pytest.mark.parametrize("vocab,width", [(1003, 64), (4096, 72), (7, 576)])
def test_the_kernel_computes_what_f_linear_does(rows, vocab, width):
    g = torch.Generator().manual_seed(rows * vocab)
    w, h = torch.randn(vocab, width, generator=g), torch.randn(rows, width, generator=g)
    got = cpu_logits.kernel(h, w)
    assert got.shape == (rows, vocab)
    torch.testing.assert_close(got, h.double() @ w.double().T, rtol=1e-5, atol=1e-4, check_dtype=False)


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(1)
    w, h = torch.randn(5000, 128, generator=g), torch.randn(8, 128, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_logits.kernel(h, w)
        torch.set_num_threads(max(2, threads))
        many = cpu_logits.kernel(h, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_logits_takes_the_kernel_only_where_it_beats_torch():
    w = torch.randn(300, 64)
    assert cpu_logits.supports(torch.randn(8, 64), w)
    for h, why in [(torch.randn(1, 64), "one row"), (torch.randn(13, 64), "more rows"),
                   (torch.randn(8, 64).bfloat16(), "bfloat16"), (torch.randn(8, 60), "width not a multiple of 8")]:
        ww = w.to(h.dtype)[:, :h.shape[1]].contiguous()
        assert not cpu_logits.supports(h, ww), why
        torch.testing.assert_close(cpu_logits.logits(h, ww), F.linear(h, ww).float())
    assert not cpu_logits.supports(torch.randn(8, 64), torch.randn(64, 300).T)  # a strided weight
    h = torch.randn(8, 64)
    assert torch.equal(cpu_logits.logits(h, w), cpu_logits.kernel(h, w))  # 8 rows: the kernel's own sums


def test_shapes_the_kernel_does_not_take_are_refused():
    with pytest.raises(ValueError, match="1-64 rows"):
        cpu_logits.kernel(torch.randn(65, 64), torch.randn(10, 64))
    with pytest.raises(ValueError, match="1-64 rows"):
        cpu_logits.kernel(torch.randn(4, 60), torch.randn(10, 60))
    with pytest.raises(ValueError, match="float32 CPU"):
        cpu_logits.kernel(torch.randn(4, 64).bfloat16(), torch.randn(10, 64))
