"""The SGLang HiCache backend with an MLA host pool, against SGLang's real ``HiCacheStorage``
interface, storage config and backend factory and a real daemon: pages round-trip bit-exact,
two tensor-parallel ranks share one copy, and an MHA pool's pages are keyed as before.

The host pool is laid out as SGLang 0.5.23's ``MLATokenToKVPoolHost``
(``sglang/srt/mem_cache/pool_host/mla.py``: ``init_kv_buffer`` and ``get_page_buffer_meta``);
the real class cannot be imported here, as its package imports torchvision, which the
``--no-deps`` install of SGLang does not bring."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvstore.client import Client
from kvstore.errors import InvalidArgument
from kvstore.integrations.sglang import KVStoreHiCache, page_tokens
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from tests.integrations.test_sglang import HostPool
from tests.server.helpers import DaemonThread, rpc_calls, short_tmpdir, small_config

PAGE_SIZE = 16
NUM_PAGES = 8
START = HiCacheStorageExtraInfo(prefix_keys=[])


def after(*prefix_keys: str) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix_keys))


class MLAHostPool:
    """The buffer and ``get_page_buffer_meta`` of SGLang's ``MLATokenToKVPoolHost``: one row of
    ``kv_lora_rank + qk_rope_head_dim`` per token per layer, one pointer per page."""

    page_size = PAGE_SIZE
    kv_lora_rank, qk_rope_head_dim = 32, 8
    layer_num = 3

    def __init__(self, layout: str = "page_first", seed: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, kv_cache_dim: int | None = None) -> None:
        self.layout, self.dtype = layout, dtype
        self.kv_cache_dim = kv_cache_dim or self.kv_lora_rank + self.qk_rope_head_dim
        self.size = NUM_PAGES * PAGE_SIZE
        if layout == "page_first":
            dims = (self.size, self.layer_num, 1, self.kv_cache_dim)
        else:  # page_first_direct
            dims = (NUM_PAGES, self.layer_num, PAGE_SIZE, 1, self.kv_cache_dim)
        g = torch.Generator().manual_seed(seed or 0)
        if seed is None:
            self.kv_buffer = torch.zeros(dims, dtype=dtype)
        elif dtype.is_floating_point and dtype.itemsize > 1:
            self.kv_buffer = torch.randn(dims, generator=g).to(dtype)
        else:  # fp8 rows: every bit pattern, as an engine's packed bytes
            raw = torch.randint(0, 256, dims, generator=g, dtype=torch.uint8)
            self.kv_buffer = raw.view(dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        # pool_host/mla.py, layouts page_first and page_first_direct
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        ptrs = [base + i * self.layer_num * self.kv_cache_dim * item
                for i in indices.tolist()[:: self.page_size]]
        size = self.layer_num * item * self.page_size * self.kv_cache_dim
        return ptrs, [size] * len(ptrs)

    def page(self, index: int) -> torch.Tensor:
        """Page ``index`` as ``[layer_num, page_size, row]`` whatever the layout."""
        if self.layout == "page_first":
            return self.kv_buffer[index * PAGE_SIZE:(index + 1) * PAGE_SIZE, :, 0].transpose(0, 1)
        return self.kv_buffer[index, :, :, 0]


def pages(*indices: int) -> torch.Tensor:
    return torch.cat([torch.arange(i * PAGE_SIZE, (i + 1) * PAGE_SIZE) for i in indices])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def daemon():
    root = short_tmpdir()
    with DaemonThread(small_config(root)) as running:
        yield running
    shutil.rmtree(root, ignore_errors=True)


def backend(address: str, pool, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = True,
            **config: object) -> KVStoreHiCache:
    """The backend as SGLang creates it for an MLA model (``is_mla_model`` is SGLang's flag
    for a rank-replicated cache): its factory's dynamic loading, then the host pool."""
    config = {"pp_rank": 0, "pp_size": 1, **config}
    storage_config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first", model_name="tiny/mla",
        extra_config={"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
                      "class_name": "KVStoreHiCache", "interface_v1": 1,
                      "address": address}, **config)
    storage = StorageBackendFactory.create_backend("dynamic", storage_config, pool)
    storage.register_mem_pool_host(pool)
    return storage


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mla_pages_round_trip_bit_exact(daemon, layout):
    source, target = MLAHostPool(layout, seed=1), MLAHostPool(layout)
    writer = backend(daemon.unix_address, source)
    reader = backend(daemon.unix_address, target)
    keys = ["m0", "m1", "m2", "m3"]
    assert writer.batch_set_v1(keys, pages(0, 1, 2, 3), START) == [True] * 4
    assert reader.batch_exists(keys, START) == 4
    assert reader.batch_get_v1(keys, pages(7, 6, 5, 4), START) == [True] * 4
    for key_index, page in enumerate((7, 6, 5, 4)):
        assert same_bits(target.page(page), source.page(key_index))
    assert not target.page(0).any()


def test_mla_batches_after_a_prefix_and_across_layouts(daemon):
    """A later batch lands behind the pages before it; a ``page_first_direct`` instance loads
    what a ``page_first`` one stored (the layout is not in the key)."""
    source, target = MLAHostPool("page_first", seed=2), MLAHostPool("page_first_direct")
    writer = backend(daemon.unix_address, source)
    reader = backend(daemon.unix_address, target)
    assert writer.batch_set_v1(["p0", "p1"], pages(0, 1), START) == [True, True]
    assert writer.batch_set_v1(["p2", "p3"], pages(6, 3), after("p0", "p1")) == [True, True]
    assert reader.batch_get_v1(["p2", "p3"], pages(0, 1), after("p0", "p1")) == [True, True]
    assert same_bits(target.page(0), source.page(6))
    assert same_bits(target.page(1), source.page(3))
    assert reader.batch_get_v1(["p0", "p9"], pages(2, 3), START) == [True, False]
    assert same_bits(target.page(2), source.page(0))
    assert not target.page(3).any()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_fp8_and_packed_rows_round_trip_bit_exact(daemon, dtype):
    """An fp8 cache (and a packed uint8 row of another width, as SGLang's fp8 DSA pool keeps)
    is stored raw: every bit pattern comes back."""
    width = None if dtype is torch.float8_e4m3fn else 56
    source = MLAHostPool(seed=3, dtype=dtype, kv_cache_dim=width)
    target = MLAHostPool(dtype=dtype, kv_cache_dim=width)
    writer = backend(daemon.unix_address, source)
    reader = backend(daemon.unix_address, target)
    assert writer.batch_set_v1(["f0", "f1"], pages(0, 1), START) == [True, True]
    assert reader.batch_get_v1(["f0", "f1"], pages(2, 3), START) == [True, True]
    assert same_bits(target.page(2), source.page(0))
    assert same_bits(target.page(3), source.page(1))


def test_two_tp_ranks_share_one_copy(daemon):
    """Rank 0 (SGLang's storage writer for MLA) stores the pages once; rank 1 finds and loads
    them, and when asked to store them moves nothing: the daemon holds one copy."""
    source = MLAHostPool(seed=4)
    rank0 = backend(daemon.unix_address, source, tp_rank=0, tp_size=2)
    rank1_pool = MLAHostPool()
    rank1 = backend(daemon.unix_address, rank1_pool, tp_rank=1, tp_size=2)
    keys = [f"t{i}" for i in range(4)]
    assert rank1.batch_set_v1(keys, pages(0, 1, 2, 3), START) == [False] * 4
    with Client(daemon.unix_address) as admin:
        assert admin.stats().num_blocks == 0
        reserves = rpc_calls(daemon, "Reserve")
        assert rank0.batch_set_v1(keys, pages(0, 1, 2, 3), START) == [True] * 4
        assert rank1.batch_set_v1(keys, pages(0, 1, 2, 3), START) == [True] * 4
        assert rpc_calls(daemon, "Reserve") - reserves == 1
        assert admin.stats().num_blocks == 4
    assert rank1.batch_exists(keys, START) == 4
    assert rank1.batch_get_v1(keys, pages(4, 5, 6, 7), START) == [True] * 4
    for i in range(4):
        assert same_bits(rank1_pool.page(4 + i), source.page(i))
    # An instance of another TP size shares the same copy.
    tp8 = backend(daemon.unix_address, MLAHostPool(), tp_rank=5, tp_size=8)
    assert tp8.batch_exists(keys, START) == 4


def test_mha_pages_are_keyed_as_before(daemon):
    """An MHA pool's pages are still stored under the plain ``KVSpec`` namespace they always
    were (the one built here by hand), so pages stored before MLA support stay reachable."""
    pool = HostPool(seed=5)
    storage = backend(daemon.unix_address, pool, mla=False)
    assert storage.batch_set_v1(["h0", "h1"], pages(0, 1), START) == [True, True]
    ns = Namespace(model_id="tiny/mla", spec=KVSpec(
        num_layers=pool.layer_num, num_kv_heads=pool.head_num, head_dim=pool.head_dim,
        block_tokens=PAGE_SIZE, dtype=pool.dtype), extra_salt="sglang/page_first")
    assert storage.namespace == ns
    tokens = np.concatenate([page_tokens(k, PAGE_SIZE) for k in ("h0", "h1")])
    with Client(daemon.unix_address) as client:
        assert client.lookup(ns, tokens).matched_tokens == 2 * PAGE_SIZE
        kv = client.get(ns, tokens)
    assert torch.equal(kv[:, 0].transpose(0, 1), pool.kv_buffer[0, :2 * PAGE_SIZE])


def test_mla_clear_drops_the_pages(daemon):
    storage = backend(daemon.unix_address, MLAHostPool(seed=6))
    storage.batch_set_v1(["c0"], pages(0), START)
    storage.clear()
    assert storage.batch_exists(["c0"], START) == 0


def test_mla_pools_the_backend_cannot_key_are_refused(daemon):
    pool = MLAHostPool()
    pool.layout = "page_first_kv_split"
    with pytest.raises(InvalidArgument, match="page_first_kv_split"):
        backend(daemon.unix_address, pool)
    with pytest.raises(InvalidArgument, match="dcp_size=2"):
        backend(daemon.unix_address, MLAHostPool(), tp_rank=1, tp_size=2, dcp_size=2,
                dcp_rank=1, logical_page_size=2 * PAGE_SIZE)


@pytest.mark.parametrize("mla", [True, False])
def test_pipeline_stages_never_share_pages(daemon, mla):
    """Two pipeline stages whose pools have the same geometry hold different layers: a page
    one stage stored is not found or loaded by the other (it was, keyed alike)."""
    pool = MLAHostPool(seed=7) if mla else HostPool(seed=7)
    stage0 = backend(daemon.unix_address, pool, mla=mla, pp_rank=0, pp_size=2)
    stage1 = backend(daemon.unix_address, MLAHostPool() if mla else HostPool(), mla=mla,
                     pp_rank=1, pp_size=2)
    assert stage0.batch_set_v1(["s0"], pages(0), START) == [True]
    assert stage1.batch_exists(["s0"], START) == 0
    assert stage1.batch_get_v1(["s0"], pages(1), START) == [False]
    assert backend(daemon.unix_address, MLAHostPool() if mla else HostPool(), mla=mla,
                   pp_rank=0, pp_size=2).batch_exists(["s0"], START) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_pages_are_the_latent_groups_format(daemon, dtype):
    """What the backend stores is the groups format itself: ``GroupCache`` over the same
    namespace loads the rows, part by part, as the pool holds them."""
    from kvstore.client.groups import GroupCache

    source = MLAHostPool(seed=8, dtype=dtype, kv_cache_dim=None if dtype.itemsize > 1 else 56)
    storage = backend(daemon.unix_address, source)
    keys = ["g0", "g1"]
    assert storage.batch_set_v1(keys, pages(3, 5), START) == [True, True]
    tokens = np.concatenate([page_tokens(k, PAGE_SIZE) for k in keys])
    with Client(daemon.unix_address) as client:
        cache = GroupCache(client, storage.namespace)
        assert cache.lookup(tokens).matched_tokens == 2 * PAGE_SIZE
        (loaded,) = cache.load(tokens, 2)
    rows = torch.cat([loaded.parts[p.name] for p in storage.namespace.cache.groups[0].parts],
                     dim=2)
    assert same_bits(rows, torch.cat([source.page(3), source.page(5)], dim=1))


def test_a_hybrid_models_unsupported_pools_are_refused_at_attach(daemon):
    """SGLang registers a hybrid model's further host pools after the KV pool: a draft pool
    (which this backend does not store), or a "mamba" pool that is no Mamba host pool, is
    refused with the pool's name at registration, not at the first prefetch."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    storage = backend(daemon.unix_address, MLAHostPool())
    with pytest.raises(InvalidArgument, match="'draft'"):
        storage.register_mem_host_pool_v2(object(), PoolName.DRAFT)
    with pytest.raises(InvalidArgument, match="'mamba'"):
        storage.register_mem_host_pool_v2(object(), PoolName.MAMBA)


def test_a_pool_neither_mha_nor_mla_is_refused_by_name(daemon):
    class CompressedPool:  # as DeepSeek V4's host pools: a layout, no MHA or MLA geometry
        layout, page_size, dtype = "page_first", PAGE_SIZE, torch.bfloat16

    with pytest.raises(InvalidArgument, match="CompressedPool"):
        backend(daemon.unix_address, CompressedPool())
