"""The SGLang HiCache backend against SGLang's real ``HiCacheStorage`` interface and backend
factory, a real daemon, and a host pool laid out as SGLang's MHA host pool in ``page_first``."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvstore.errors import InvalidArgument
from kvstore.integrations.sglang import KVStoreHiCache
from tests.server.helpers import DaemonThread, short_tmpdir, small_config

PAGE_SIZE = 16
NUM_PAGES = 8


class HostPool:
    """The buffer and ``get_page_buffer_meta`` of SGLang's ``MHATokenToKVPoolHost`` in the
    ``page_first`` layout: ``[2, tokens, layers, heads, head_dim]``, two pointers per page."""

    layout = "page_first"
    page_size = PAGE_SIZE
    layer_num, head_num, head_dim = 3, 2, 16
    dtype = torch.bfloat16

    def __init__(self, seed: int | None = None) -> None:
        self.size = NUM_PAGES * PAGE_SIZE
        dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)
        g = torch.Generator().manual_seed(seed or 0)
        self.kv_buffer = (torch.randn(dims, generator=g) if seed is not None
                          else torch.zeros(dims)).to(self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        # sglang/srt/mem_cache/pool_host/mha.py, layout page_first
        item = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        ptrs = []
        for i in indices.tolist()[:: self.page_size]:
            k_ptr = self.kv_buffer.data_ptr() + i * self.layer_num * self.head_num \
                * self.head_dim * item
            ptrs += [k_ptr, k_ptr + v_offset]
        size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def page(self, index: int) -> torch.Tensor:
        return self.kv_buffer[:, index * PAGE_SIZE : (index + 1) * PAGE_SIZE]


def pages(*indices: int) -> torch.Tensor:
    return torch.cat([torch.arange(i * PAGE_SIZE, (i + 1) * PAGE_SIZE) for i in indices])


@pytest.fixture
def address():
    root = short_tmpdir()
    with DaemonThread(small_config(root)) as daemon:
        yield daemon.unix_address
    shutil.rmtree(root, ignore_errors=True)


def backend(address: str, pool: HostPool, **extra: object) -> HiCacheStorage:
    """The backend as SGLang creates it: its factory's dynamic loading, then the host pool."""
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="tiny/model",
        extra_config={"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
                      "class_name": "KVStoreHiCache", "interface_v1": 1, "address": address,
                      **extra})
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage


def test_pages_round_trip_between_host_pools(address):
    source, target = HostPool(seed=1), HostPool()
    writer, reader = backend(address, source), backend(address, target)
    assert isinstance(writer, KVStoreHiCache)
    keys = ["h0", "h1", "h2", "h3"]
    assert writer.batch_set_v1(keys, pages(0, 1, 2, 3)) == [True] * 4
    # Into other pages of another pool: each key lands where its host indices say.
    assert reader.batch_get_v1(keys, pages(7, 6, 5, 4)) == [True] * 4
    for key_index, page in enumerate((7, 6, 5, 4)):
        assert torch.equal(target.page(page), source.page(key_index))


def test_batch_exists_counts_leading_hits(address):
    storage = backend(address, HostPool(seed=2))
    storage.batch_set_v1(["a", "b", "c"], pages(0, 1, 2))
    assert storage.batch_exists(["a", "b", "c"]) == 3
    assert storage.batch_exists(["a", "b", "missing", "c"]) == 2
    assert storage.batch_exists(["missing", "a"]) == 0
    assert storage.exists("c") and not storage.exists("d")


def test_a_missing_key_loads_nothing(address):
    source, target = HostPool(seed=3), HostPool()
    backend(address, source).batch_set_v1(["x"], pages(0))
    assert backend(address, target).batch_get_v1(["x", "y"], pages(0, 1)) == [True, False]
    assert torch.equal(target.page(0), source.page(0))
    assert not target.page(1).any()


def test_revisions_and_tenants_never_share(address):
    backend(address, HostPool(seed=4), revision="r1").batch_set_v1(["k"], pages(0))
    assert backend(address, HostPool(), revision="r2").batch_exists(["k"]) == 0
    assert backend(address, HostPool(), revision="r1", tenant="globex").batch_exists(["k"]) == 0
    assert backend(address, HostPool(), revision="r1").batch_exists(["k"]) == 1


def test_unsupported_layouts_are_refused(address):
    pool = HostPool()
    pool.layout = "layer_first"
    with pytest.raises(InvalidArgument, match="layer_first"):
        backend(address, pool)
