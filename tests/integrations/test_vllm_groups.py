"""The vLLM connector's hybrid-allocator groups (``vllm_groups``) against a real daemon, on
caches laid out as vLLM 0.32's CPU backend lays them out and shared between groups as its
hybrid allocator shares them (layer i of every group is one tensor, block ids from one pool):
what each group saves and loads, and that a sliding group's null block is never read, written
or stored."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvstore.client import Client
from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup, CacheSpec
from kvstore.integrations.vllm_groups import NULL_BLOCK_ID, GroupedTransfers, blocks_to_move
from kvstore.keys import Namespace
from tests.server.helpers import DaemonThread, short_tmpdir, small_config

BT, HEADS, HEAD_DIM, WINDOW = 32, 2, 32, 64
WINDOW_GROUP = CacheGroup.attention(2, HEADS, HEAD_DIM, "float32", window_tokens=WINDOW,
                                    name="sliding")
FULL_GROUP = CacheGroup.attention(2, HEADS, HEAD_DIM, "float32", name="full")
NS = Namespace(model_id="hybrid", spec=CacheSpec((WINDOW_GROUP, FULL_GROUP), BT), revision="r1")
TOKENS = np.arange(3, 3 + 6 * BT, dtype=np.uint32)  # 6 blocks


@pytest.fixture
def client():
    root = short_tmpdir()
    try:
        with DaemonThread(small_config(root, dram_bytes=32 << 20)) as daemon, \
                Client(daemon.unix_address) as kv:
            yield kv
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cache(seed: int | None) -> list[torch.Tensor]:
    """Two layers of vLLM's CPU cache, ``[num_blocks, H, block_size, 2 * head_dim]``; random
    with ``seed``, else zeros."""
    shape = (24, HEADS, BT, 2 * HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(2)]


def transfers(client: Client, layers: list[torch.Tensor]) -> GroupedTransfers:
    return GroupedTransfers(client, NS, [layers, layers])  # both groups share each layer


def save(client: Client, moved: GroupedTransfers, ids: list[list[int]], first: int = 0) -> None:
    for _, gather in moved.gathers("r", NS, TOKENS, ids, first):
        job = gather()
        client.put(job.ns, job.token_ids, job.kv, first_block=job.first_block)


def test_blocks_to_move_keep_a_window_and_skip_the_null_block():
    full = [5, 6, 7, 8, 9, 10]
    sliding = [0, 0, 0, 0, 3, 4]  # vLLM's table once blocks 0-3 left the window
    assert blocks_to_move(FULL_GROUP, 6, 0, BT, full) == [0, 1, 2, 3, 4, 5]
    assert blocks_to_move(WINDOW_GROUP, 6, 0, BT, sliding) == [4, 5]
    assert blocks_to_move(WINDOW_GROUP, 6, 5, BT, sliding) == [5]
    assert blocks_to_move(WINDOW_GROUP, 6, 0, BT, [0, 0, 0, 0, 0, 4]) == [5]
    state = CacheGroup.state(1, {"ssm": ((4, 4), "float32")})
    assert blocks_to_move(state, 6, 0, BT, full) == [5]


def test_a_window_group_stores_only_its_window_and_loads_back_exactly(client):
    """The full group's 6 blocks and the window group's last 2 are stored (8 pages, none for
    the blocks that left the window); loaded into other blocks of a fresh cache they are the
    same bytes, and the null block is neither read nor written."""
    src = cache(0)
    for t in src:
        t[NULL_BLOCK_ID].fill_(7.0)  # vLLM's null block: never stored
    save(client, transfers(client, src), [[0, 0, 0, 0, 11, 12], [1, 2, 3, 4, 5, 6]])
    assert client.stats().tiers["dram"].num_blocks == 8
    assert client.lookup(NS, TOKENS).matched_tokens == 6 * BT

    dst = cache(None)
    window_ids, full_ids = [0, 0, 0, 0, 20, 21], [13, 14, 15, 16, 17, 18]
    assert transfers(client, dst).load(NS, TOKENS, [window_ids, full_ids], 0)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[20, 21]], s[[11, 12]])
        assert torch.equal(d[full_ids], s[[1, 2, 3, 4, 5, 6]])
        assert not d[NULL_BLOCK_ID].any()  # never written


def test_a_load_from_a_later_block_moves_only_what_the_engine_lacks(client):
    src = cache(1)
    save(client, transfers(client, src), [[0, 0, 0, 0, 11, 12], [1, 2, 3, 4, 5, 6]])
    dst = cache(None)
    assert transfers(client, dst).load(NS, TOKENS, [[0, 0, 0, 0, 20, 21],
                                                    [13, 14, 15, 16, 17, 18]], 5)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[21], s[12]) and torch.equal(d[18], s[6])
        assert not d[[20, 13, 14, 15, 16, 17]].any()


def test_a_missing_window_page_fails_the_load_and_the_lookup():
    """Only the full group stored (a window page evicted since): the grouped lookup finds no
    whole prefix, and a load planned before that reports failure (vLLM recomputes) rather than
    leave the window's blocks unwritten."""
    root = short_tmpdir()
    try:
        with DaemonThread(small_config(root)) as daemon, Client(daemon.unix_address) as kv:
            src = cache(2)
            save(kv, transfers(kv, src), [[0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
            assert kv.stats().tiers["dram"].num_blocks == 6  # the full group only
            assert kv.lookup(NS, TOKENS).matched_tokens == 0
            dst = cache(None)
            assert not transfers(kv, dst).load(NS, TOKENS, [[0, 0, 0, 0, 20, 21],
                                                            [13, 14, 15, 16, 17, 18]], 0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_cpu_groups_vllm_cannot_lay_out_there_are_refused_by_name(client):
    state = Namespace(model_id="m", spec=CacheSpec(
        (FULL_GROUP, CacheGroup.state(2, {"ssm": ((4, 4), "float32")}, name="mamba")), BT))
    with pytest.raises(InvalidArgument, match="state group 'mamba'"):
        GroupedTransfers(client, state, [cache(None), cache(None)])
    wrong = [torch.zeros(24, HEADS, BT, HEAD_DIM) for _ in range(2)]
    with pytest.raises(InvalidArgument, match="window group 'sliding' layer 0"):
        GroupedTransfers(client, NS, [wrong, wrong])


GPU_DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"


def gpu_cache(seed: int | None) -> list[torch.Tensor]:
    """Two layers as vLLM 0.26 registers them on CUDA: logical ``[B, H, N, 2D]`` over NHD
    memory ``[B, N, H, 2D]``, bf16 (CPU tensors through Triton's interpreter without CUDA)."""
    memory = (24, BT, HEADS, 2 * HEAD_DIM)
    layers = []
    for i in range(2):
        if seed is None:
            t = torch.zeros(memory, dtype=torch.bfloat16, device=GPU_DEVICE)
        else:
            g = torch.Generator().manual_seed(seed + i)
            t = torch.randn(memory, generator=g).to(torch.bfloat16).to(GPU_DEVICE)
        layers.append(t.permute(0, 2, 1, 3))
    return layers


def test_the_gpu_path_moves_a_window_group_by_block_subsets(client):
    """The same hybrid cache through kvstore's kernels (``KernelTransfers`` per group, each
    with its group's namespace): the window's blocks move one page each, the full group's as
    a prefix, and the null block is never written."""
    from kvstore.codecs.triton.common import kernels_runnable
    from kvstore.integrations.vllm_kernels import KernelTransfers

    if not kernels_runnable(torch.device(GPU_DEVICE)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    bf16 = Namespace(model_id="hybrid-gpu", revision="r1", extra_salt="vllm/cuda", spec=CacheSpec((
        CacheGroup.attention(2, HEADS, HEAD_DIM, "bfloat16", window_tokens=WINDOW,
                             name="sliding"),
        CacheGroup.attention(2, HEADS, HEAD_DIM, "bfloat16", name="full")), BT))

    def kernels(group, gns, tensors):
        return KernelTransfers(client, gns, tensors)

    src = gpu_cache(0)
    moved = GroupedTransfers(client, bf16, [src, src], kernels)
    for _, gather in moved.gathers("r", bf16, TOKENS, [[0, 0, 0, 0, 11, 12],
                                                       [1, 2, 3, 4, 5, 6]], 0):
        job = gather()
        if job.ready is not None:  # CUDA: the copy into host memory landed
            job.ready.synchronize()
        client.put(job.ns, job.token_ids, job.kv, first_block=job.first_block)
    assert client.lookup(bf16, TOKENS).matched_tokens == 6 * BT
    assert client.stats().tiers["dram"].num_blocks == 8

    dst = gpu_cache(None)
    loader = GroupedTransfers(client, bf16, [dst, dst], kernels)
    loader.start()
    assert loader.load(bf16, TOKENS, [[0, 0, 0, 0, 20, 21], [13, 14, 15, 16, 17, 18]], 0)
    loader.finish()
    if GPU_DEVICE != "cpu":
        torch.cuda.synchronize()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[20, 21]].cpu(), s[[11, 12]].cpu())
        assert torch.equal(d[[13, 14, 15, 16, 17, 18]].cpu(), s[[1, 2, 3, 4, 5, 6]].cpu())
        assert not d[NULL_BLOCK_ID].any()
    moved.close()
    loader.close()
