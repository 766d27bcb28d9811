"""vLLM's fp8 caches (``cache_dtype`` fp8/fp8_e4m3/fp8_e5m2) through the connector's GPU path
against a real daemon: dense attention in vLLM's CUDA layout and the MLA latent cache
``[num_blocks, block_size, 576]`` round-trip bit for bit under a namespace naming the flavour
and scales; the cache dtypes kvstore does not store are refused by name. Without CUDA the
caches are CPU tensors and the kernels run in Triton's interpreter."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kvstore.client import Client
from kvstore.client.groups import GroupCache
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.engine_fp8 import Fp8Cache
from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm_fp8 import check_fp8_layers, fp8_cache_of
from kvstore.integrations.vllm_kernels import KernelTransfers, check_mla_layers, mla_namespace
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

from ..server.helpers import DaemonThread, small_config

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_runnable(torch.device(DEVICE)),
                                reason="needs CUDA or TRITON_INTERPRET=1")
LAYERS, BLOCK, HEADS, HEAD_DIM, NUM_BLOCKS = 2, 16, 2, 32, 10
RANK, ROPE = 64, 16  # a small DeepSeek-like latent: 80 fp8 bytes a token
SENTINEL = 0x7F


def random_bytes(*shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8).to(DEVICE)


def vllm_fp8_cache(fill: int | None = None) -> list[torch.Tensor]:
    """Per layer, vLLM's logical (B, H, N, 2D) uint8 over NHD memory (B, N, H, 2D)."""
    memory = (NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM)
    return [(random_bytes(*memory) if fill is None else
             torch.full(memory, fill, dtype=torch.uint8, device=DEVICE)).permute(0, 2, 1, 3)
            for _ in range(LAYERS)]


def mla_fp8_cache(fill: int | None = None) -> list[torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK, RANK + ROPE)
    return [random_bytes(*shape) if fill is None else
            torch.full(shape, fill, dtype=torch.uint8, device=DEVICE) for _ in range(LAYERS)]


def saved(transfers: KernelTransfers, client: Client, ns: Namespace, tokens: list[int],
          block_ids: list[int]) -> int:
    kv, ready = transfers.cache.gather(block_ids)
    if ready is not None:
        ready.synchronize()
    return client.put(ns, tokens, kv)


def loaded(transfers: KernelTransfers, ns: Namespace, tokens: list[int], block_ids: list[int],
           first_block: int = 0) -> int:
    transfers.start()
    got = transfers.load(ns, tokens, block_ids, first_block)
    transfers.finish()
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_dense_fp8_pages_round_trip_bit_exact(tmp_path, cache_dtype):
    fp8 = Fp8Cache(cache_dtype, ())  # static scales, as the connector keys them
    spec = KVSpec(LAYERS, HEADS, HEAD_DIM, BLOCK, dtype="uint8")
    ns = fp8.bind(Namespace(model_id="m", spec=spec, extra_salt="vllm/cuda"))
    tokens = list(range(500, 500 + 4 * BLOCK))
    src = vllm_fp8_cache()
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        saver = KernelTransfers(client, ns, src, fp8=fp8)
        assert saved(saver, client, ns, tokens, [7, 2, 9, 0]) == 4 * BLOCK
        dst = vllm_fp8_cache(SENTINEL)
        loader = KernelTransfers(client, ns, dst, fp8=fp8)
        assert loaded(loader, ns, tokens, [3, 5, 1, 8], first_block=1) == 4
        for a, b in zip(src, dst):
            assert torch.equal(a[[2, 9, 0]], b[[5, 1, 8]])
            assert bool((b[[0, 2, 3, 4, 6, 7, 9]] == SENTINEL).all())
        other = Fp8Cache("fp8_e4m3" if cache_dtype == "fp8_e5m2" else "fp8_e5m2", ())
        assert client.lookup(other.bind(Namespace(model_id="m", spec=spec,
                                                  extra_salt="vllm/cuda")),
                             tokens).matched_tokens == 0
        saver.close()
        loader.close()


def test_mla_fp8_pages_round_trip_bit_exact_as_the_latent_groups_bytes(tmp_path):
    fp8 = Fp8Cache("fp8", ())
    tokens = list(range(70, 70 + 4 * BLOCK))
    src = mla_fp8_cache()

    def namespace(rank: int) -> tuple[Namespace, Namespace]:
        full = mla_namespace(model_id="mla", revision="r1", tenant="default", num_layers=LAYERS,
                             kv_lora_rank=RANK, rope_dim=ROPE, block_tokens=BLOCK,
                             dtype=torch.bfloat16, tp_rank=rank, tp_size=2,
                             extra_salt="vllm/cuda", fp8=fp8)
        full = fp8.bind(full)
        return full, full.group(0)

    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        full, rank0 = namespace(0)
        _, rank1 = namespace(1)
        assert rank0.fingerprint == rank1.fingerprint  # replicated: one copy for every rank
        assert rank0.spec == KVSpec(LAYERS, 1, (RANK + ROPE) // 2, BLOCK, dtype="uint8")
        saver = KernelTransfers(client, rank0, src, layout="mla", fp8=fp8)
        assert saved(saver, client, rank0, tokens, [5, 1, 8, 2]) == 4 * BLOCK
        dst = mla_fp8_cache(SENTINEL)
        loader = KernelTransfers(client, rank1, dst, layout="mla", fp8=fp8)
        assert loaded(loader, rank1, tokens, [0, 3, 9, 4], first_block=1) == 4
        for a, b in zip(src, dst):
            assert torch.equal(a[[1, 8, 2]], b[[3, 9, 4]])
            assert bool((b[[0, 1, 2, 5, 6, 7, 8]] == SENTINEL).all())
        # The pages are the latent group's bytes: GroupCache reads its one fp8 part back.
        latent = GroupCache(client, full).load(tokens, 4)[0].parts["latent"]
        want = torch.stack([torch.cat([t[b] for b in [5, 1, 8, 2]]) for t in src])
        assert latent.dtype == torch.float8_e4m3fn
        unbound = namespace(0)[0]
        assert client.lookup(dataclasses.replace(unbound, extra_salt="vllm/cuda"),
                             tokens).matched_tokens == 0  # without the fp8 salt: no hit
        assert torch.equal(latent.view(torch.uint8), want.cpu())
        saver.close()
        loader.close()


def config(cache_dtype, **cache) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype, **cache))


def test_the_connector_keys_fp8_caches_by_flavour_and_refuses_the_rest():
    assert fp8_cache_of(config("auto")) is None
    assert fp8_cache_of(config("fp8")).salt == fp8_cache_of(config("fp8_e4m3")).salt \
        == "fp8/e4m3/static"
    assert fp8_cache_of(config("fp8_e5m2")).salt == "fp8/e5m2/static"
    for name in ("fp8_ds_mla", "int8_per_token_head", "fp8_inc"):
        with pytest.raises(InvalidArgument, match=f"cache_dtype='{name}' is not supported"):
            fp8_cache_of(config(name))
    with pytest.raises(InvalidArgument, match="calculate_kv_scales"):
        fp8_cache_of(config("fp8", calculate_kv_scales=True))


def test_registered_layers_must_match_the_cache_dtype():
    fp8 = Fp8Cache("fp8", ())
    bf16 = torch.empty(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgument, match="layer l3: cache_dtype='fp8'.*bfloat16"):
        check_fp8_layers([("l3", bf16)], fp8)
    with pytest.raises(InvalidArgument, match="layer l0: cache is torch.uint8"):
        check_fp8_layers([("l0", bf16.view(torch.uint8))], None)
    ds_mla = torch.empty(NUM_BLOCKS, BLOCK, 656, dtype=torch.uint8)  # fp8_ds_mla rows
    with pytest.raises(InvalidArgument, match=r"\[num_blocks, 16, 80\]"):
        check_mla_layers([("l0", ds_mla)], BLOCK, RANK + ROPE)
    check_mla_layers([("l0", mla_fp8_cache(0)[0])], BLOCK, RANK + ROPE)
