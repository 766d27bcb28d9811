"""The SGLang HiCache backend against SGLang's real ``HiCacheStorage`` interface and backend
factory, a real daemon, and a host pool laid out as SGLang's MHA host pool in ``page_first``.

Batches are called as SGLang's cache controller calls them with
``hicache_storage_pass_prefix_keys``: each carries the keys of the pages before it."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvstore.errors import InvalidArgument
from kvstore.integrations.sglang import KVStoreHiCache
from tests.server.helpers import DaemonThread, rpc_calls, short_tmpdir, small_config

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


def after(*prefix_keys: str) -> HiCacheStorageExtraInfo:
    """What SGLang hands a batch call: the page keys before the batch, from the sequence start."""
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix_keys))


START = after()  # a batch at the start of its sequence


@pytest.fixture
def daemon():
    root = short_tmpdir()
    with DaemonThread(small_config(root)) as running:
        yield running
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def address(daemon):
    return daemon.unix_address


def rpc_count(daemon, method: str) -> float:
    """Calls of ``method`` the daemon has handled (its own per-method RPC metric)."""
    return float(rpc_calls(daemon, method))


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
    assert writer.batch_set_v1(keys, pages(0, 1, 2, 3), START) == [True] * 4
    # Into other pages of another pool: each key lands where its host indices say.
    assert reader.batch_get_v1(keys, pages(7, 6, 5, 4), START) == [True] * 4
    for key_index, page in enumerate((7, 6, 5, 4)):
        assert torch.equal(target.page(page), source.page(key_index))


def test_batches_after_a_prefix(address):
    """A later batch of a sequence is stored and loaded behind the pages before it; pages out
    of order in the host pool (no single view over them) round-trip as well."""
    source, target = HostPool(seed=5), HostPool()
    writer, reader = backend(address, source), backend(address, target)
    assert writer.batch_set_v1(["p0", "p1"], pages(0, 1), START) == [True, True]
    assert writer.batch_set_v1(["p2", "p3"], pages(5, 3), after("p0", "p1")) == [True, True]
    assert reader.batch_exists(["p2", "p3", "p4"], after("p0", "p1")) == 2
    assert reader.batch_get_v1(["p2", "p3"], pages(0, 1), after("p0", "p1")) == [True, True]
    assert torch.equal(target.page(0), source.page(5))
    assert torch.equal(target.page(1), source.page(3))
    assert not target.page(2).any()  # the prefix pages were not loaded


def test_a_page_whose_prefix_is_not_stored_is_not_stored(address):
    storage = backend(address, HostPool(seed=6))
    assert storage.batch_set_v1(["q1"], pages(1), after("q0")) == [False]
    assert storage.batch_exists(["q0", "q1"], START) == 0


def test_batch_exists_counts_leading_hits(address):
    storage = backend(address, HostPool(seed=2))
    storage.batch_set_v1(["a", "b", "c"], pages(0, 1, 2), START)
    assert storage.batch_exists(["a", "b", "c"], START) == 3
    assert storage.batch_exists(["a", "b", "missing", "c"], START) == 2
    assert storage.batch_exists(["missing", "a"], START) == 0
    assert storage.batch_exists(["c"], after("a", "b")) == 1
    assert storage.batch_exists(["c", "d"], after("a", "b")) == 1
    assert storage.batch_exists(["b"], START) == 0  # "b" is stored behind "a" only


def test_batch_exists_is_one_lookup(daemon):
    """A batch of 64 keys, all stored, costs the daemon one Lookup RPC (it was one per key)."""
    storage = backend(daemon.unix_address, HostPool(seed=7))
    keys = [f"k{i}" for i in range(NUM_PAGES)]
    storage.batch_set_v1(keys, pages(*range(NUM_PAGES)), START)
    batch = keys * 8  # 64 keys: a chain of the same pages' hashes, stored only up to 8
    before = rpc_count(daemon, "Lookup")
    assert storage.batch_exists(keys, START) == NUM_PAGES
    assert storage.batch_exists(batch, START) == NUM_PAGES
    assert rpc_count(daemon, "Lookup") - before == 2


def test_batch_get_and_set_are_one_lease_and_one_reservation(daemon):
    source, target = HostPool(seed=8), HostPool()
    writer = backend(daemon.unix_address, source)
    reader = backend(daemon.unix_address, target)
    keys = [f"g{i}" for i in range(4)]
    counts = {m: rpc_count(daemon, m) for m in ("Reserve", "Commit", "Acquire", "Release")}
    assert writer.batch_set_v1(keys, pages(0, 1, 2, 3), START) == [True] * 4
    assert reader.batch_get_v1(keys, pages(4, 5, 6, 7), START) == [True] * 4
    reader._client.flush_releases()  # the client gives a lease back after the read returned
    assert {m: rpc_count(daemon, m) - n for m, n in counts.items()} == {
        "Reserve": 1, "Commit": 1, "Acquire": 1, "Release": 1}


def test_a_missing_key_loads_nothing(address):
    source, target = HostPool(seed=3), HostPool()
    backend(address, source).batch_set_v1(["x"], pages(0), START)
    assert backend(address, target).batch_get_v1(["x", "y"], pages(0, 1), START) == [True, False]
    assert torch.equal(target.page(0), source.page(0))
    assert not target.page(1).any()


def test_revisions_and_tenants_never_share(address):
    backend(address, HostPool(seed=4), revision="r1").batch_set_v1(["k"], pages(0), START)
    assert backend(address, HostPool(), revision="r2").batch_exists(["k"], START) == 0
    assert backend(address, HostPool(), revision="r1", tenant="globex").batch_exists(
        ["k"], START) == 0
    assert backend(address, HostPool(), revision="r1").batch_exists(["k"], START) == 1


def test_calls_without_prefix_keys_are_refused(address):
    """Without ``hicache_storage_pass_prefix_keys`` a batch cannot name its chain: the error
    says which setting to turn on; the pre-v1 calls (no prefix keys at all) are refused."""
    storage = backend(address, HostPool(seed=9))
    with pytest.raises(InvalidArgument, match="hicache_storage_pass_prefix_keys"):
        storage.batch_exists(["a"])
    with pytest.raises(InvalidArgument, match="hicache_storage_pass_prefix_keys"):
        storage.batch_set_v1(["a"], pages(0), HiCacheStorageExtraInfo())
    for call in (lambda: storage.exists("a"), lambda: storage.get("a"),
                 lambda: storage.batch_set(["a"], [None])):
        with pytest.raises(InvalidArgument, match="interface_v1"):
            call()


def test_unsupported_layouts_are_refused(address):
    pool = HostPool()
    pool.layout = "layer_first"
    with pytest.raises(InvalidArgument, match="layer_first"):
        backend(address, pool)
