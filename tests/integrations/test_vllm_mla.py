"""vLLM's MLA cache (``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` per layer)
through the connector's GPU path: it is a latent cache group's pages (``kvstore.groups``), one
copy for every tensor-parallel rank. Without CUDA the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kvstore.client import Client
from kvstore.client.groups import GroupCache
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.integrations.vllm_kernels import KernelTransfers, mla_namespace
from kvstore.keys import Namespace

from ..server.helpers import DaemonThread, small_config

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_runnable(torch.device(DEVICE)),
                                reason="needs CUDA or TRITON_INTERPRET=1")
LAYERS, BLOCK, RANK, ROPE, NUM_BLOCKS = 2, 16, 64, 16, 10  # a small DeepSeek-like latent


def mla_cache(poison: bool) -> list[torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK, RANK + ROPE)
    if poison:
        return [torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
                for _ in range(LAYERS)]
    return [torch.randn(shape, device=DEVICE).to(torch.bfloat16) for _ in range(LAYERS)]


def namespace(tp_rank: int, tp_size: int) -> Namespace:
    return mla_namespace(model_id="mla", revision="r1", tenant="default", num_layers=LAYERS,
                         kv_lora_rank=RANK, rope_dim=ROPE, block_tokens=BLOCK,
                         dtype=torch.bfloat16, tp_rank=tp_rank, tp_size=tp_size,
                         extra_salt="vllm/cuda")


def test_mla_pages_round_trip_are_one_copy_for_every_rank_and_read_as_a_latent_group(tmp_path):
    tokens = list(range(70, 70 + 4 * BLOCK))
    src = mla_cache(poison=False)
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        full = namespace(0, 2)
        rank0, rank1 = full.group(0), namespace(1, 2).group(0)
        assert rank0.fingerprint == rank1.fingerprint  # replicated: keyed without the rank
        saver = KernelTransfers(client, rank0, src, layout="mla")
        kv, ready = saver.cache.gather([5, 1, 8, 2])
        if ready is not None:
            ready.synchronize()
        assert client.put(rank0, tokens, kv) == 4 * BLOCK
        blocks = client.stats().num_blocks
        assert client.put(rank1, tokens, kv) == 0  # rank 1's are the same pages: nothing new
        assert client.stats().num_blocks == blocks
        dst = mla_cache(poison=True)
        loader = KernelTransfers(client, rank1, dst, layout="mla")
        loader.start()
        assert loader.load(rank1, tokens, [0, 3, 9, 4], 1) == 4  # behind one local block
        loader.finish()
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        for a, b in zip(src, dst):
            assert torch.equal(a[[1, 8, 2]], b[[3, 9, 4]])
            assert torch.isnan(b[[0, 1, 2, 5, 6, 7, 8]]).all()
        # the pages are the latent group's: the groups client reads its two parts back
        got = GroupCache(client, full).load(tokens, 4)
        latent = got[0].parts
        want = torch.stack([torch.cat([t[b] for b in [5, 1, 8, 2]]) for t in src])  # [L, T, 576]
        assert torch.equal(latent["kv"].to(want.device), want[..., :RANK])
        assert torch.equal(latent["pe"].to(want.device), want[..., RANK:])
        saver.close()
        loader.close()
