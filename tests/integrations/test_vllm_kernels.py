"""The vLLM connector's GPU-cache path (``vllm_kernels``) against a real daemon, on caches laid
out as vLLM 0.26 lays them out on CUDA (logical ``[num_blocks, H, block_size, 2D]`` in NHD
memory order). Without CUDA the caches are CPU tensors and the kernels run in Triton's
interpreter; on a GPU the same test runs on CUDA tensors and streams."""

from __future__ import annotations

import pytest
import torch

from kvstore.client import Client
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm_kernels import KernelTransfers, check_gpu_layers
from kvstore.integrations.vllm_saves import AsyncSaves, SaveLimits
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

from ..server.helpers import DaemonThread, small_config

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_runnable(torch.device(DEVICE)),
                                reason="needs CUDA or TRITON_INTERPRET=1")
SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=32, block_tokens=16)
NUM_BLOCKS = 12


def vllm_gpu_cache(poison: bool) -> list[torch.Tensor]:
    """Per layer, vLLM's logical (B, H, N, 2D) over NHD memory (B, N, H, 2D)."""
    memory = (NUM_BLOCKS, SPEC.block_tokens, SPEC.num_kv_heads, 2 * SPEC.head_dim)
    layers = []
    for _ in range(SPEC.num_layers):
        if poison:
            t = torch.full(memory, float("nan"), dtype=torch.bfloat16, device=DEVICE)
        else:
            t = torch.randn(memory, device=DEVICE).to(torch.bfloat16)
        layers.append(t.permute(0, 2, 1, 3))  # logical (B, H, N, 2D)
    return layers


def kv_of(layers: list[torch.Tensor], block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V of one block of each layer, read as vLLM's attention reads them."""
    out = []
    for t in layers:
        k, v = t[block].transpose(0, 1).split(SPEC.head_dim, dim=-1)  # (N, H, D) each
        out.append((k, v))
    return out


def same(a, pa, b, pb) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
               for i, j in zip(pa, pb) for x, y in zip(kv_of(a, i), kv_of(b, j)))


@pytest.fixture
def daemon(tmp_path):
    with DaemonThread(small_config(tmp_path)) as d:
        yield d


def test_saves_in_two_steps_then_loads_whole_and_behind_a_local_prefix(daemon):
    ns = Namespace(model_id="m", spec=SPEC, tenant="default", extra_salt="vllm/cuda")
    tokens = list(range(500, 500 + 5 * 16))
    src = vllm_gpu_cache(poison=False)
    with Client(daemon.unix_address) as client, Client(daemon.unix_address) as save_client:
        saver = KernelTransfers(client, ns, src)
        saves = AsyncSaves(lambda n, ids, kv, first: save_client.put(n, ids, kv,
                                                                     first_block=first),
                           SaveLimits())
        src_blocks = [7, 2, 9, 0, 4]
        # a prefill of two steps: blocks 0-1, then 2-4 added behind them
        for first, end in ((0, 2), (2, 5)):
            saves.seen("r1")
            assert saves.submit("r1", 1, lambda f=first, e=end: saver.gather(
                "r1", ns, tokens[:e * 16], src_blocks[:e], f))
        saves.close()
        assert saves.finished({"r1"}) == {"r1"}
        assert saves.take_stats().saved_blocks == 5
        assert client.lookup(ns, tokens).matched_tokens == 80

        dst = vllm_gpu_cache(poison=True)
        loader = KernelTransfers(client, ns, dst)
        loader.start()
        assert loader.load(ns, tokens, [3, 5, 1, 10, 8], 0) == 5
        for layer in range(SPEC.num_layers):
            loader.wait_for_layer(layer)
        loader.finish()
        # behind a local prefix of two blocks: those pages are not written
        other = vllm_gpu_cache(poison=True)
        partial = KernelTransfers(client, ns, other)
        partial.start()
        assert partial.load(ns, tokens, [6, 11, 2, 3, 9], 2) == 5
        partial.finish()
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        assert same(src, src_blocks, dst, [3, 5, 1, 10, 8])
        assert same(src, src_blocks[2:], other, [2, 3, 9])
        assert all(torch.isnan(t[[6, 11]]).all() for t in other)
        untouched = [b for b in range(NUM_BLOCKS) if b not in (3, 5, 1, 10, 8)]
        assert all(torch.isnan(t[untouched]).all() for t in dst)
        # another request's namespace (a different salt) finds none of it
        salted = Namespace(model_id="m", spec=SPEC, tenant="default",
                           extra_salt="vllm/cuda/salt")
        assert loader.load(salted, tokens, [3, 5, 1, 10, 8], 0) == 0
        for cache in (saver, loader, partial):
            cache.close()


def test_a_prefix_stored_short_loads_what_is_there(daemon):
    """Three of five blocks stored: the load says 3, and only three pages are written (the
    connector reports the other two as load errors, and vLLM recomputes them)."""
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = list(range(900, 900 + 5 * 16))
    src = vllm_gpu_cache(poison=False)
    with Client(daemon.unix_address) as client:
        saver = KernelTransfers(client, ns, src)
        kv, ready = saver.cache.gather([1, 2, 3])
        if ready is not None:
            ready.synchronize()
        assert client.put(ns, tokens[:48], kv) == 48
        dst = vllm_gpu_cache(poison=True)
        loader = KernelTransfers(client, ns, dst)
        loader.start()
        assert loader.load(ns, tokens, [4, 5, 6, 7, 8], 0) == 3
        loader.finish()
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        assert same(src, [1, 2, 3], dst, [4, 5, 6])
        assert all(torch.isnan(t[[7, 8]]).all() for t in dst)
        saver.close()
        loader.close()


def test_layouts_kvstore_cannot_read_are_refused_by_name():
    mla = torch.empty(NUM_BLOCKS, SPEC.block_tokens, 576, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgument, match="layer model.layers.0.self_attn.attn: cache"):
        check_gpu_layers([("model.layers.0.self_attn.attn", mla)], SPEC.num_kv_heads,
                         SPEC.block_tokens, SPEC.head_dim)
    wrong_heads = torch.empty(NUM_BLOCKS, 4, SPEC.block_tokens, 2 * SPEC.head_dim)
    with pytest.raises(InvalidArgument, match=r"\[num_blocks, 2, 16, 64\]"):
        check_gpu_layers([("l0", wrong_heads)], SPEC.num_kv_heads, SPEC.block_tokens,
                         SPEC.head_dim)
    check_gpu_layers([("l0", vllm_gpu_cache(poison=True)[0])], SPEC.num_kv_heads,
                     SPEC.block_tokens, SPEC.head_dim)
