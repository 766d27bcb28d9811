"""fp8 engine caches through EngineCache and a real daemon: pages round-trip bit for bit with
their scales bound into the namespace, a cache of other scales never reads them, and a lossy
codec is refused naming it and the dtype. Without CUDA the kernels run in Triton's interpreter
and the daemon's device pool is host memory (the daemon runs in this process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstore.client import Client
from kvstore.client.engine import EngineCache
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.config import DramConfig, HbmConfig, TierConfig
from kvstore.engine_fp8 import Fp8Cache
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

from ..server.helpers import DaemonThread, small_config

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_runnable(torch.device(DEVICE)),
                                reason="needs CUDA or TRITON_INTERPRET=1")
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="uint8")
MiB = 1 << 20
PAGES = 8
SENTINEL = 0x7F  # a NaN in e4m3: a page the load wrote is never it by chance, all of it


def tiers(config, hbm_codec: str = "raw", dram_codec: str = "raw"):
    return dataclasses.replace(config, tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=4 * MiB, device=DEVICE,
                                           codec=hbm_codec)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=8 * MiB, chunk_bytes=MiB,
                                              codec=dram_codec)),
    ))


def fp8_cache(dtype: torch.dtype, fill: int | None = None) -> list[torch.Tensor]:
    """vLLM's CUDA layout, [num_blocks, H, block_size, 2D] (fused_hnd), of fp8 bytes."""
    shape = (PAGES, SPEC.num_kv_heads, SPEC.block_tokens, 2 * SPEC.head_dim)
    return [(torch.full(shape, fill, dtype=torch.uint8) if fill is not None
             else torch.randint(0, 256, shape, dtype=torch.uint8)).to(DEVICE).view(dtype)
            for _ in range(SPEC.num_layers)]


def scales(k: float = 0.5) -> Fp8Cache:
    return Fp8Cache("fp8_e4m3", (k, 0.25) * SPEC.num_layers)


def namespace(fp8: Fp8Cache, salt: str = "") -> Namespace:
    base = Namespace(model_id="m", spec=dataclasses.replace(SPEC, dtype="bfloat16"),
                     extra_salt=salt)
    return fp8.bind(base)


def pages_of(cache: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [t.view(torch.uint8)[ids] for t in cache]


@pytest.mark.parametrize("where", ["hbm", "host", "host zstd"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_fp8_pages_round_trip_bit_exact_with_their_scales(tmp_path, where, dtype):
    config = small_config(tmp_path)
    if where == "hbm":
        config = tiers(config)
    elif where == "host zstd":
        config = dataclasses.replace(config, dram=dataclasses.replace(config.dram,
                                                                      codec="zstd"))
    fp8 = scales()
    ns = namespace(fp8)
    assert ns.spec.dtype == "uint8" and ns.extra_salt.endswith(fp8.salt)
    tokens = list(range(3 * 16 + 5))
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        src = fp8_cache(dtype)
        with EngineCache(client, ns, src, layout="fused_hnd", fp8=fp8) as saver:
            assert saver.save(tokens, [6, 1, 4]) == 48
        assert set(client.lookup(ns, tokens).tokens_per_tier) == \
            ({"gpu"} if where == "hbm" else {"dram"})
        dst = fp8_cache(dtype, SENTINEL)
        with EngineCache(client, ns, dst, layout="fused_hnd", fp8=fp8) as loader:
            handle = loader.load(tokens, [0, 7, 2])
            assert handle.wait() == 48
        for a, b in zip(pages_of(src, [6, 1, 4]), pages_of(dst, [0, 7, 2])):
            assert torch.equal(a, b)
        assert all(bool((t == SENTINEL).all()) for t in pages_of(dst, [1, 3, 4, 5, 6]))

        # Another calibration's scales, the other flavour, and a bf16 cache of the same
        # geometry key other blocks: nothing of these pages is a hit for them.
        for other in (scales(k=1.0), Fp8Cache("fp8_e5m2", fp8.scales)):
            assert client.lookup(namespace(other), tokens).matched_tokens == 0
        plain = Namespace(model_id="m", spec=dataclasses.replace(SPEC, dtype="bfloat16"))
        assert client.lookup(plain, tokens).matched_tokens == 0


def test_a_namespace_without_the_scales_is_refused(tmp_path):
    fp8 = scales()
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        src = fp8_cache(torch.uint8)
        with pytest.raises(InvalidArgument, match="pass fp8="):
            EngineCache(client, namespace(fp8), src, layout="fused_hnd")
        unbound = Namespace(model_id="m", spec=SPEC)
        with pytest.raises(InvalidArgument, match="does not carry this fp8 cache"):
            EngineCache(client, unbound, src, layout="fused_hnd", fp8=fp8)
        cache = EngineCache(client, namespace(fp8), src, layout="fused_hnd", fp8=fp8)
        other = namespace(scales(k=2.0))  # a request's namespace of other scales
        with pytest.raises(InvalidArgument, match="does not carry this fp8 cache"):
            cache.save(list(range(16)), [0], ns=other)
        with pytest.raises(InvalidArgument, match="torch.float8_e4m3fn, fp8= says fp8_e5m2"):
            EngineCache(client, namespace(Fp8Cache("fp8_e5m2", fp8.scales)),
                        fp8_cache(torch.float8_e4m3fn), layout="fused_hnd",
                        fp8=Fp8Cache("fp8_e5m2", fp8.scales))
        cache.close()


@pytest.mark.parametrize("where", ["hbm", "host"])
def test_a_lossy_codec_on_fp8_pages_is_refused_naming_it(tmp_path, where):
    config = tiers(small_config(tmp_path), hbm_codec="fp8_e4m3") if where == "hbm" else \
        dataclasses.replace(small_config(tmp_path),
                            dram=dataclasses.replace(small_config(tmp_path).dram,
                                                     codec="fp8_e4m3"))
    fp8 = scales()
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        cache = EngineCache(client, namespace(fp8), fp8_cache(torch.uint8), layout="fused_hnd",
                            fp8=fp8)
        with cache, pytest.raises(InvalidArgument, match="lossy codec 'fp8_e4m3'.*uint8 pages"):
            cache.save(list(range(32)), [0, 1])
        assert client.stats().num_blocks == 0
        assert client.lookup(namespace(fp8), list(range(32))).matched_tokens == 0  # serving
