"""Fresh results on huge pages (``kvstore.madvise.fresh_tensor``)."""

import torch

from kvstore import madvise


def test_large_results_are_advised_onto_huge_pages_inside_their_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(madvise, "MADVISE", lambda addr, length, advice: calls.append(
        (addr, length, advice)) or 0)
    small = madvise.fresh_tensor((1024,), torch.bfloat16)
    assert calls == [] and small.shape == (1024,)
    big = madvise.fresh_tensor((2, 3 << 20), torch.bfloat16)  # 12 MiB
    assert big.shape == (2, 3 << 20) and big.dtype == torch.bfloat16
    (addr, length, advice), = calls
    assert advice == madvise.MADV_HUGEPAGE
    assert addr % madvise.HUGE_PAGE_BYTES == 0 and length % madvise.HUGE_PAGE_BYTES == 0
    assert big.data_ptr() <= addr and addr + length <= big.data_ptr() + (12 << 20)
    assert length >= (12 << 20) - 2 * madvise.HUGE_PAGE_BYTES
    big.fill_(1.5)  # the memory is the tensor's, whatever the kernel made of the advice
    assert bool((big == 1.5).all())
