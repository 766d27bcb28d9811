"""Copies shared between threads: every byte lands where one np.copyto would put it, whatever
the split (pages straddling shares, strided destinations, copies too small to split), and an
error in any share reaches the caller only after every share ended."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvstore import copies
from kvstore.copies import MAX_COPY_THREADS, copy_all, resolve_copy_threads
from kvstore.errors import InvalidArgument

MiB = 1 << 20


def _pages(num_pages: int, page_shape: tuple[int, ...], seed: int = 0):
    """A destination [L, 2, num_pages * T, H, D] and one source page per block, as a get's."""
    rng = np.random.default_rng(seed)
    layers, kv, tokens, heads, dim = page_shape
    dst = np.zeros((layers, kv, num_pages * tokens, heads, dim), dtype=np.uint16)
    srcs = [rng.integers(0, 65535, page_shape, dtype=np.uint16) for _ in range(num_pages)]
    pairs = [(dst[:, :, i * tokens : (i + 1) * tokens], src) for i, src in enumerate(srcs)]
    return dst, srcs, pairs


@pytest.mark.parametrize("num_pages,threads", [(16, 2), (16, 3), (3, 4), (1, 2), (5, 1)])
def test_shared_copies_land_where_one_copy_would(num_pages, threads):
    page_shape = (32, 2, 16, 8, 64)  # 1 MiB pages: 16 of them split, 1 of them not
    dst, srcs, pairs = _pages(num_pages, page_shape, seed=num_pages)
    copy_all(pairs, threads)
    assert np.array_equal(dst, np.concatenate(srcs, axis=2))


def test_a_copy_larger_than_a_share_is_split_along_its_first_axis():
    src = np.arange(6 * MiB // 4, dtype=np.uint32).reshape(6, -1)
    dst = np.zeros_like(src)
    shares = copies._shares([(dst, src)], 3)
    assert [sum(d.nbytes for d, _ in share) for share in shares] == [2 * MiB] * 3
    copy_all([(dst, src)], 3)
    assert np.array_equal(dst, src)


def test_many_small_copies_stay_whole_and_in_order():
    pairs = [(np.zeros(MiB, np.uint8), np.full(MiB, i, np.uint8)) for i in range(8)]
    shares = copies._shares(pairs, 2)
    assert [len(share) for share in shares] == [4, 4]
    assert all(d is pairs[i][0] for i, (d, _) in enumerate(shares[0] + shares[1]))
    copy_all(pairs, 2)
    assert all((dst == i).all() for i, (dst, _) in enumerate(pairs))


def test_an_error_in_a_pool_share_waits_for_the_others_then_raises():
    good = [(np.zeros(2 * MiB, np.uint8), np.ones(2 * MiB, np.uint8)) for _ in range(3)]
    bad = (np.zeros(2 * MiB, np.uint8), np.ones(MiB, np.uint8))  # shapes do not broadcast
    with pytest.raises(ValueError):
        copy_all([*good, bad], 2)
    assert all(dst.all() for dst, _ in good)  # the share before it still ran to the end


def test_copy_threads_are_checked():
    assert resolve_copy_threads(None) == copies.default_copy_threads() >= 1
    assert resolve_copy_threads(2) == 2
    for wrong in (0, MAX_COPY_THREADS + 1, 1.5, True, "2"):
        with pytest.raises(InvalidArgument, match="copy_threads must be an int from 1 to 4"):
            resolve_copy_threads(wrong)


def test_a_forked_child_copies_with_a_pool_of_its_own():
    """The parent's pool threads do not exist in a forked child: a split copy there must not
    wait forever on them."""
    pairs = [(np.zeros(2 * MiB, np.uint8), np.ones(2 * MiB, np.uint8)) for _ in range(4)]
    copy_all(pairs, 2)  # the parent's pool now exists
    pid = os.fork()
    if pid == 0:
        child = [(np.zeros(2 * MiB, np.uint8), np.full(2 * MiB, 3, np.uint8)) for _ in range(4)]
        copy_all(child, 2)
        os._exit(0 if all((dst == 3).all() for dst, _ in child) else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's copy never finished")


def test_a_share_that_shares_again_runs_it_itself():
    """Work on a pool thread that splits again must not wait on the pool it runs on."""
    inner = [(np.zeros(2 * MiB, np.uint8), np.full(2 * MiB, 5, np.uint8)) for _ in range(4)]

    def nested() -> None:
        copy_all(inner, MAX_COPY_THREADS)

    copies.run_shared([nested] * MAX_COPY_THREADS)  # every pool thread busy with a nested split
    assert all((dst == 5).all() for dst, _ in inner)


def test_the_last_share_takes_the_rest_whole():
    """Shares are cut at row bounds; the last takes what is left in one piece, however the
    rounding fell."""
    pairs = [(np.zeros((32, 1024), np.uint16), np.ones((32, 1024), np.uint16))
             for _ in range(16)]
    shares = copies._shares(pairs, 3)
    assert len(shares) == 3 and len(shares[-1]) <= 6
    assert sum(d.nbytes for share in shares for d, _ in share) == 16 * 32 * 1024 * 2
