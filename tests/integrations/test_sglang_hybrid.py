"""The SGLang HiCache backend's v2 calls for a hybrid model (full-attention KV, Mamba state and
sliding-window KV pools) against SGLang's real ``HiCacheStorage`` interface, storage config,
``PoolTransfer`` / ``PoolTransferResult`` types and backend factory, and a real daemon.

Calls are made as SGLang 0.5.23's hybrid cache controller makes them
(``mem_cache/hybrid_cache/hybrid_cache_controller.py``): a node's backup stores the Mamba and
SWA pools with ``batch_set_v2`` (the state at the node's last page, the window's trailing
pages, each with ``prefix_keys`` covering the span before its keys), then the KV pages with
``batch_set_v1``; a prefetch asks ``batch_exists_v2`` for the span with placeholder trailing
keys, then loads KV with ``batch_get_v1`` and the trailing pools with ``batch_get_v2``.

The host pools are stand-ins built from SGLang's source: the real ``MambaPoolHost`` and
``MHATokenToKVPoolHost`` cannot be imported here (their package imports torchvision, which the
``--no-deps`` install of SGLang does not bring). ``MambaHostPool`` keeps ``MambaPoolHost``'s
``page_first`` buffers and attributes (``pool_host/mamba.py``: ``__init__``,
``init_kv_buffer``, ``get_data_page``); the SWA pool is an MHA host pool, as
``hybrid_pool_assembler.build_kv_host_pool`` makes it.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvstore.errors import InvalidArgument
from kvstore.integrations.sglang import KVStoreHiCache
from tests.integrations.test_sglang import PAGE_SIZE, HostPool, pages
from tests.integrations.test_sglang_mla import MLAHostPool, same_bits
from tests.server.helpers import DaemonThread, rpc_calls, short_tmpdir, small_config

WINDOW_PAGES = 2
TRAILING = PoolHitPolicy.TRAILING_PAGES
KEYS = [f"h{i}" for i in range(6)]


class MambaHostPool:
    """``MambaPoolHost`` in ``page_first``: one slot per state (page size 1), buffers
    ``[slots, layers, 1, *shape]``, the temporal (SSM) state in float32 and two conv states
    in bf16."""

    layout = "page_first"
    page_size = 1
    num_mamba_layers = 3
    temporal_state_shape = (2, 4, 8)
    temporal_dtype = torch.float32
    conv_dtype = torch.bfloat16

    def __init__(self, seed: int | None = None, size: int = 8) -> None:
        self.conv_state_shapes = [(6, 3), (4, 3)]
        self.slot_state_buffers: list[torch.Tensor] = []  # registered side states: none
        self.size = size
        self.dtype = self.conv_dtype
        self.temporal_state_elem_size = math.prod(self.temporal_state_shape)
        g = torch.Generator().manual_seed(seed or 0)

        def buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            dims = (size, self.num_mamba_layers, 1, *shape)
            return torch.zeros(dims, dtype=dtype) if seed is None else \
                torch.randn(dims, generator=g).to(dtype)

        self.temporal_buffer = buffer(self.temporal_state_shape, self.temporal_dtype)
        self.conv_buffer = [buffer(s, self.conv_dtype) for s in self.conv_state_shapes]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        # pool_host/mamba.py: the slot's temporal then conv states, as bytes
        tensors = [self.temporal_buffer[index], *(c[index] for c in self.conv_buffer)]
        return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors])


class SWAHostPool(HostPool):
    """The sliding-window layers' MHA host pool (fewer layers than the full-attention one)."""

    layer_num = 2


def after(*prefix_keys: str) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix_keys))


@pytest.fixture
def daemon():
    root = short_tmpdir()
    with DaemonThread(small_config(root)) as running:
        yield running
    shutil.rmtree(root, ignore_errors=True)


class Pools:
    """A hybrid model's host pools: full-attention KV (the anchor), Mamba, SWA."""

    def __init__(self, seed: int | None = None, kv: object | None = None,
                 swa: bool = True) -> None:
        self.kv = kv if kv is not None else HostPool(seed=seed)
        self.mamba = MambaHostPool(seed=None if seed is None else seed + 100)
        self.swa = SWAHostPool(seed=None if seed is None else seed + 200) if swa else None


def backend(address: str, pools: Pools, *, tp_rank: int = 0, tp_size: int = 1,
            **extra: object) -> KVStoreHiCache:
    """The backend as SGLang's hybrid controller attaches it: the factory, the anchor pool,
    then every pool entry through ``register_mem_host_pool_v2``."""
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=isinstance(pools.kv, MLAHostPool),
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny/hybrid",
        extra_config={"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
                      "class_name": "KVStoreHiCache", "interface_v1": 1, "address": address,
                      "swa_window_tokens": WINDOW_PAGES * PAGE_SIZE, **extra})
    storage = StorageBackendFactory.create_backend("dynamic", config, pools.kv)
    storage.register_mem_pool_host(pools.kv)
    for name, pool in ((PoolName.KV, pools.kv), (PoolName.MAMBA, pools.mamba),
                       (PoolName.SWA, pools.swa)):
        if pool is not None:
            storage.register_mem_host_pool_v2(pool, name)
    storage.on_host_pools_registered()
    assert isinstance(storage, KVStoreHiCache)
    return storage


def back_up(storage: KVStoreHiCache, n: int, *, slot: int, swa_pages: list[int],
            mamba: bool = True, swa: bool = True) -> None:
    """A node ending at page ``n`` backed up as the hybrid controller does: the Mamba state at
    its last page and the SWA window's trailing pages (``batch_set_v2``, each with the prefix
    before its keys), then KV pages ``0..n`` (``batch_set_v1``) from host pages ``0..n``."""
    window = KEYS[max(0, n - WINDOW_PAGES):n]
    if mamba:
        transfer = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([slot]),
                                keys=[KEYS[n - 1]], hit_policy=TRAILING)
        assert storage.batch_set_v2([transfer], after(*KEYS[:n - 1])) == {
            PoolName.MAMBA: [True]}
    if swa:
        transfer = PoolTransfer(PoolName.SWA, host_indices=pages(*swa_pages), keys=window,
                                hit_policy=TRAILING)
        assert storage.batch_set_v2([transfer], after(*KEYS[:n - len(window)])) == {
            PoolName.SWA: [True] * len(window)}
    assert storage.batch_set_v1(KEYS[:n], pages(*range(n)), after()) == [True] * n


def query(storage: KVStoreHiCache, n: int, **transfer: object) -> PoolTransferResult:
    """The prefetch's hit query for a span of ``n`` pages, trailing keys as placeholders."""
    transfers = [PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING),
                 PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * WINDOW_PAGES,
                              hit_policy=TRAILING)]
    for t in transfers:
        for field, value in transfer.items():
            setattr(t, field, value)
    return storage.batch_exists_v2(KEYS[:n], transfers, after())


def load(storage: KVStoreHiCache, n: int, *, slot: int, swa_pages: list[int],
         kv_pages: list[int]) -> dict:
    """The prefetch's loads for a hit of ``n`` pages: KV, then the trailing pools with their
    keys re-aligned to the hit (``_sync_trailing_keys``)."""
    results = {PoolName.KV: storage.batch_get_v1(KEYS[:n], pages(*kv_pages), after())}
    window = KEYS[max(0, n - WINDOW_PAGES):n]
    results.update(storage.batch_get_v2(
        [PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=[KEYS[n - 1]],
                      hit_policy=TRAILING)], after(*KEYS[:n - 1])))
    results.update(storage.batch_get_v2(
        [PoolTransfer(PoolName.SWA, host_indices=pages(*swa_pages), keys=window,
                      hit_policy=TRAILING)], after(*KEYS[:n - len(window)])))
    return results


def test_every_pool_round_trips_bit_exact(daemon):
    source, target = Pools(seed=1), Pools()
    writer = backend(daemon.unix_address, source)
    back_up(writer, 4, slot=5, swa_pages=[2, 3])
    reader = backend(daemon.unix_address, target)
    hit = query(reader, 4)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [4])
    assert hit.extra_pool_hit_pages == {"kv": 4, "mamba": 4, "swa": 4}
    results = load(reader, 4, slot=2, swa_pages=[6, 7], kv_pages=[4, 5, 6, 7])
    assert results == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True], PoolName.SWA: [True] * 2}
    for i, page in enumerate((4, 5, 6, 7)):
        assert torch.equal(target.kv.page(page), source.kv.page(i))
    assert torch.equal(target.mamba.get_data_page(2), source.mamba.get_data_page(5))
    assert torch.equal(target.mamba.temporal_buffer[2], source.mamba.temporal_buffer[5])
    for host, stored in ((6, 2), (7, 3)):
        assert torch.equal(target.swa.page(host), source.swa.page(stored))
    assert not target.mamba.get_data_page(5).any()  # only the slot asked for was written


def test_the_hit_is_the_prefix_where_every_pool_is_whole(daemon):
    """KV of 5 pages, the state and window stored for n = 3 only: the hit is 3, never 5."""
    storage = backend(daemon.unix_address, Pools(seed=2))
    back_up(storage, 3, slot=1, swa_pages=[1, 2])
    assert storage.batch_set_v1(KEYS[3:5], pages(3, 4), after(*KEYS[:3])) == [True, True]
    assert storage.batch_exists(KEYS[:5], after()) == 5  # the KV pool alone
    hit = query(storage, 5)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (3, [3])
    # The window without the state, or the state without the window, is no hit at 5 either.
    storage.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=pages(3, 4), keys=KEYS[3:5],
                                       hit_policy=TRAILING)], after(*KEYS[:3]))
    assert query(storage, 5).kv_hit_pages == 3
    back_up(storage, 5, slot=2, swa_pages=[3, 4], swa=False)
    assert query(storage, 5).kv_hit_pages == 5


def test_a_missing_mamba_snapshot_falls_back_to_the_last_stored(daemon):
    """Snapshots at 2 and 4 of a 6-page span whose KV and window are all stored: the hit is
    4; the load at 4 serves every pool."""
    source, target = Pools(seed=3), Pools()
    writer = backend(daemon.unix_address, source)
    back_up(writer, 2, slot=0, swa_pages=[0, 1])
    back_up(writer, 4, slot=1, swa_pages=[2, 3])
    back_up(writer, 6, slot=2, swa_pages=[4, 5], mamba=False)
    reader = backend(daemon.unix_address, target)
    assert query(reader, 6).kv_hit_pages == 4
    assert query(reader, 3).kv_hit_pages == 2  # a span that ends between snapshots
    results = load(reader, 4, slot=3, swa_pages=[6, 7], kv_pages=[0, 1, 2, 3])
    assert all(all(r) for r in results.values())
    assert torch.equal(target.mamba.get_data_page(3), source.mamba.get_data_page(1))


def test_another_tenant_revision_or_geometry_sees_nothing(daemon):
    address = daemon.unix_address
    back_up(backend(address, Pools(seed=4), revision="r1"), 3, slot=0, swa_pages=[1, 2])
    assert query(backend(address, Pools(), revision="r1"), 3).kv_hit_pages == 3
    for other in (backend(address, Pools(), revision="r2"),
                  backend(address, Pools(), revision="r1", tenant="globex"),
                  backend(address, Pools(), revision="r1", swa_window_tokens=3 * PAGE_SIZE)):
        assert query(other, 3).kv_hit_pages == 0
        assert other.batch_exists(KEYS[:3], after()) == 0  # the KV pages are bound too
        assert load(other, 3, slot=0, swa_pages=[4, 5], kv_pages=[0, 1, 2]) == {
            PoolName.KV: [False] * 3, PoolName.MAMBA: [False], PoolName.SWA: [False] * 2}


def test_hit_query_is_one_lookup(daemon):
    storage = backend(daemon.unix_address, Pools(seed=5))
    back_up(storage, 4, slot=0, swa_pages=[2, 3])
    before = float(rpc_calls(daemon, "Lookup"))
    assert query(storage, 4).kv_hit_pages == 4
    assert float(rpc_calls(daemon, "Lookup")) - before == 1


def test_queries_kvstore_cannot_promise_answer_no_hit(daemon):
    """A pool asked under a policy kvstore does not keep (every page of a window), or a wider
    trailing window than the group keeps, is no hit: a hit the get could not serve is never
    reported."""
    storage = backend(daemon.unix_address, Pools(seed=6))
    back_up(storage, 4, slot=0, swa_pages=[2, 3])
    assert query(storage, 4).kv_hit_pages == 4
    wide = [PoolTransfer(PoolName.SWA, keys=["p"] * (WINDOW_PAGES + 1), hit_policy=TRAILING)]
    assert storage.batch_exists_v2(KEYS[:4], wide, after()).kv_hit_pages == 0
    every = [PoolTransfer(PoolName.SWA, keys=["p"] * 4, hit_policy=PoolHitPolicy.ALL_PAGES)]
    assert storage.batch_exists_v2(KEYS[:4], every, after()).kv_hit_pages == 0
    draft = [PoolTransfer(PoolName.DRAFT, keys=["p"], hit_policy=TRAILING)]
    assert storage.batch_exists_v2(KEYS[:4], draft, after()).kv_hit_pages == 0


def test_bad_transfers_fail_their_entries(daemon):
    storage = backend(daemon.unix_address, Pools(seed=7))
    short = PoolTransfer(PoolName.SWA, host_indices=pages(0), keys=KEYS[:2], hit_policy=TRAILING)
    assert storage.batch_set_v2([short], after()) == {PoolName.SWA: [False, False]}
    unknown = PoolTransfer(PoolName.INDEXER, host_indices=pages(0), keys=KEYS[:1])
    assert storage.batch_get_v2([unknown], after()) == {PoolName.INDEXER: [False]}
    with pytest.raises(InvalidArgument, match="hicache_storage_pass_prefix_keys"):
        storage.batch_set_v2([short], HiCacheStorageExtraInfo())


def test_unsupported_pools_are_refused_at_registration(daemon):
    address = daemon.unix_address
    pools = Pools()
    with pytest.raises(InvalidArgument, match="swa_window_tokens"):
        backend(address, pools, swa_window_tokens=None)
    storage = backend(address, Pools())
    with pytest.raises(InvalidArgument, match="draft"):
        storage.register_mem_host_pool_v2(HostPool(), PoolName.DRAFT)
    with pytest.raises(InvalidArgument, match="registered twice"):
        storage.register_mem_host_pool_v2(MambaHostPool(), PoolName.MAMBA)
    pools.mamba.slot_state_buffers = [torch.zeros(8, 4)]
    with pytest.raises(InvalidArgument, match="side states"):
        backend(address, pools)


def test_mla_with_mamba_state_one_latent_copy_and_a_state_per_rank(daemon):
    """An MLA model with Mamba-style state (Kimi Linear's shape) at TP=2: the latent is one
    copy written by SGLang's storage writer (rank 0) and loaded by both ranks; each rank's
    state shard is its own, so a rank whose shard is not stored has no hit."""
    address = daemon.unix_address
    ranks = [Pools(seed=10 + r, kv=MLAHostPool(seed=10 + r), swa=False) for r in range(2)]
    storage = [backend(address, ranks[r], tp_rank=r, tp_size=2) for r in range(2)]
    mamba_only = [PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING)]

    def state(r: int) -> None:
        transfer = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([r]), keys=[KEYS[2]],
                                hit_policy=TRAILING)
        assert storage[r].batch_set_v2([transfer], after(*KEYS[:2])) == {PoolName.MAMBA: [True]}

    state(0)
    assert storage[0].batch_set_v1(KEYS[:3], pages(0, 1, 2), after()) == [True] * 3
    assert storage[0].batch_exists_v2(KEYS[:3], mamba_only, after()).kv_hit_pages == 3
    assert storage[1].batch_exists_v2(KEYS[:3], mamba_only, after()).kv_hit_pages == 0
    state(1)
    assert storage[1].batch_set_v1(KEYS[:3], pages(0, 1, 2), after()) == [True] * 3  # stored
    assert storage[1].batch_exists_v2(KEYS[:3], mamba_only, after()).kv_hit_pages == 3
    target = Pools(kv=MLAHostPool(), swa=False)
    reader = backend(address, target, tp_rank=1, tp_size=2)
    assert reader.batch_get_v1(KEYS[:3], pages(5, 6, 7), after()) == [True] * 3
    assert reader.batch_get_v2(
        [PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([4]), keys=[KEYS[2]],
                      hit_policy=TRAILING)], after(*KEYS[:2])) == {PoolName.MAMBA: [True]}
    for host, stored in ((5, 0), (6, 1), (7, 2)):
        assert same_bits(target.kv.page(host), ranks[0].kv.page(stored))  # rank 0's latent
    assert torch.equal(target.mamba.get_data_page(4), ranks[1].mamba.get_data_page(1))


def test_clear_drops_every_pools_pages(daemon):
    """SGLang's cache flush (``clear``) drops the model's KV, window and state pages alike."""
    storage = backend(daemon.unix_address, Pools(seed=11))
    back_up(storage, 3, slot=0, swa_pages=[1, 2])
    assert query(storage, 3).kv_hit_pages == 3
    storage.clear()
    assert query(storage, 3).kv_hit_pages == 0
    assert load(storage, 3, slot=1, swa_pages=[4, 5], kv_pages=[5, 6, 7]) == {
        PoolName.KV: [False] * 3, PoolName.MAMBA: [False], PoolName.SWA: [False] * 2}


def test_an_mha_backend_without_hybrid_pools_reports_no_pool_it_never_stored(daemon):
    """The v2 hit query on a backend that registered no hybrid pool: a KV-only query is the
    v1 answer; a query that needs another pool's pages is no hit."""
    storage = backend(daemon.unix_address, Pools(seed=12))
    plain = StorageBackendFactory.create_backend("dynamic", storage._config, HostPool())
    plain.register_mem_pool_host(storage.mem_pool_host)
    assert plain.batch_set_v1(KEYS[:2], pages(0, 1), after()) == [True, True]
    assert plain.batch_exists_v2(KEYS[:2], [], after()).kv_hit_pages == 2
    assert query(plain, 2).kv_hit_pages == 0
