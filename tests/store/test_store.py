"""The embedded Store over real DRAM (shared memory) and SSD (files) tiers."""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import os
import random

import pytest
import torch

from kvstore import codecs
from kvstore.config import DramConfig, KVStoreConfig, SsdConfig, TierConfig
from kvstore.errors import CorruptPage, InvalidArgument, KVStoreError, LeaseNotFound
from kvstore.keys import Namespace
from kvstore.page import PageMeta, decode_page, encode_page
from kvstore.spec import KVSpec
from kvstore.store import Store
from kvstore.store.writes import WriteBuffers

from ..conftest import random_kv, random_tokens

MiB = 1 << 20


def make_config(tmp_path, dram_bytes=64 * MiB, ssd_bytes=256 * MiB, **ssd) -> KVStoreConfig:
    return KVStoreConfig(
        dram=DramConfig(capacity_bytes=dram_bytes, chunk_bytes=1 * MiB),
        ssd=SsdConfig(path=str(tmp_path / "ssd"), capacity_bytes=ssd_bytes, segment_bytes=1 * MiB,
                      **{"admit_after_accesses": 1, "fsync": "never", **ssd}),
    )


@pytest.fixture
async def store(tmp_path):
    async with Store(make_config(tmp_path)) as s:
        yield s


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_put_get_round_trip_bit_exact(tmp_path, spec, dtype):
    spec = dataclasses.replace(spec, dtype=dtype)
    ns = Namespace(model_id="m", spec=spec, tenant="t")
    tokens = random_tokens(70)
    kv = random_kv(spec, 70)
    async with Store(make_config(tmp_path)) as store:
        assert await store.put(ns, tokens, kv) == 64  # 4 full blocks; the tail is not stored
        assert await store.put(ns, tokens, kv) == 0  # already present: not rewritten
        got = await store.get(ns, tokens)
        assert got.dtype == spec.torch_dtype and torch.equal(got, kv[:, :, :64])


async def test_lookup_partial_prefixes(store, ns, spec):
    tokens = random_tokens(64)
    await store.put(ns, tokens[:32], random_kv(spec, 32))
    res = await store.lookup(ns, tokens)
    assert (res.num_tokens, res.matched_tokens, res.tokens_per_tier) == (64, 32, {"dram": 32})
    assert len(res.keys) == 2
    assert (await store.lookup(ns, tokens[:40])).matched_tokens == 32
    assert (await store.lookup(ns, tokens[:8])).matched_tokens == 0
    other = tokens[:16] + [t + 1 for t in tokens[16:]]
    assert (await store.lookup(ns, other)).matched_tokens == 16
    assert await store.get(ns, random_tokens(32, seed=9)) is None
    got = await store.get(ns, tokens[:48])
    assert got.shape[2] == 32


async def test_namespaces_do_not_share_blocks(store, ns, spec):
    tokens = random_tokens(32)
    await store.put(ns, tokens, random_kv(spec, 32))
    for change in ({"revision": "r9"}, {"tenant": "other"}, {"adapter_id": "lora"}):
        assert (await store.lookup(dataclasses.replace(ns, **change), tokens)).matched_tokens == 0


@pytest.mark.parametrize(
    "kv, tokens, match",
    [
        ("not a tensor", 32, "torch.Tensor"),
        (torch.zeros(2, 2, 32, 2, 16, dtype=torch.float32), 32, "dtype"),
        (torch.zeros(2, 2, 32, 3, 16, dtype=torch.bfloat16), 32, "shape"),
        (torch.zeros(2, 32, 2, 16, dtype=torch.bfloat16), 32, "shape"),
        (torch.zeros(2, 2, 31, 2, 16, dtype=torch.bfloat16), 32, "tokens"),
        (torch.zeros(2, 2, 32, 2, 16, dtype=torch.bfloat16), 0, "empty"),
    ],
)
async def test_bad_input_is_rejected_and_store_keeps_working(store, ns, spec, kv, tokens, match):
    with pytest.raises(InvalidArgument, match=match):
        await store.put(ns, list(range(tokens)), kv)
    with pytest.raises(InvalidArgument):
        await store.lookup(ns, [])
    with pytest.raises(InvalidArgument):
        await store.get(ns, "abc")
    good = random_tokens(32)
    kv_good = random_kv(spec, 32)
    assert await store.put(ns, good, kv_good) == 32
    assert torch.equal(await store.get(ns, good), kv_good)


async def test_demotion_to_ssd_and_back(tmp_path, ns, spec):
    cfg = make_config(tmp_path, dram_bytes=1 * MiB)
    page = spec.block_bytes  # 4 KiB blocks: 1 MiB of DRAM holds about 200 of them
    async with Store(cfg) as store:
        runs = []
        for i in range(40):
            tokens = random_tokens(16 * 8, seed=i)
            kv = random_kv(spec, 16 * 8, seed=i)
            assert await store.put(ns, tokens, kv) == 128
            runs.append((tokens, kv))
        stats = store.stats()
        assert stats.tiers["dram"].used_bytes <= MiB
        assert stats.counters.demotions > 0 and stats.tiers["ssd"].num_blocks > 0
        for tokens, kv in runs:  # everything is still served, from whichever tier holds it
            assert torch.equal(await store.get(ns, tokens), kv)
        assert page > 0


async def test_capacity_bounds_hold_under_thousands_of_puts(tmp_path, ns, spec):
    cfg = make_config(tmp_path, dram_bytes=1 * MiB, ssd_bytes=3 * MiB)
    async with Store(cfg) as store:
        for i in range(1500):
            await store.put(ns, random_tokens(32, seed=i), random_kv(spec, 32, seed=i))
            if i % 100 == 0:
                s = store.stats()
                assert s.tiers["dram"].used_bytes <= cfg.dram.capacity_bytes
                assert s.tiers["ssd"].used_bytes <= cfg.ssd.capacity_bytes
        s = store.stats()
        assert s.tiers["dram"].used_bytes <= cfg.dram.capacity_bytes
        assert s.tiers["ssd"].used_bytes <= cfg.ssd.capacity_bytes
        assert s.counters.dropped > 0
        disk = sum(p.stat().st_size for p in (tmp_path / "ssd").glob("*") if p.suffix != ".mdb"
                   and p.is_file() and "lock" not in p.name and "data.mdb" not in p.name)
        assert disk <= cfg.ssd.capacity_bytes
        tokens, kv = random_tokens(32, seed=1499), random_kv(spec, 32, seed=1499)
        assert torch.equal(await store.get(ns, tokens), kv)


async def test_restart_serves_ssd_blocks(tmp_path, ns, spec):
    cfg = make_config(tmp_path, fsync="always")
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    async with Store(cfg) as store:
        await store.put(ns, tokens, kv)  # DRAM only; close persists it to SSD
    async with Store(cfg) as store:
        res = await store.lookup(ns, tokens)
        assert res.tokens_per_tier == {"ssd": 64}
        assert torch.equal(await store.get(ns, tokens), kv)
        rows = store.list_blocks(tenant=ns.tenant)
        assert {r.block_index for r in rows} == {0, 1, 2, 3}


@pytest.mark.parametrize("into", ["fresh", "out"])
async def test_corrupt_ssd_page_is_a_miss(tmp_path, ns, spec, into):
    """A get (into a fresh result, or into the caller's buffer: then a view of its front)
    ends before a block that fails verification."""
    cfg = make_config(tmp_path)
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    async with Store(cfg) as store:
        await store.put(ns, tokens, kv)
    segments = sorted(p for p in (tmp_path / "ssd").iterdir() if p.name.startswith("seg"))
    data = bytearray(segments[0].read_bytes())
    third_key = (await _keys(ns, tokens))[2]
    pos = bytes(data).find(third_key)  # the third block's page header
    assert pos > 0
    data[pos + 200] ^= 0xFF
    segments[0].write_bytes(bytes(data))
    async with Store(cfg) as store:
        buf = torch.zeros(spec.shape(64), dtype=spec.torch_dtype) if into == "out" else None
        got = await store.get(ns, tokens, out=buf)
        assert got.shape[2] == 32 and torch.equal(got, kv[:, :, :32])  # never the bad block
        assert buf is None or got.data_ptr() == buf.data_ptr()
        assert store.stats().tiers["ssd"].corrupt == 1
        assert (await store.lookup(ns, tokens)).matched_tokens == 32


async def _keys(ns, tokens):
    from kvstore.keys import block_keys

    return block_keys(ns, tokens)


async def test_concurrent_put_get_lookup(store, ns, spec):
    prompts = [(random_tokens(48, seed=i % 20), random_kv(spec, 48, seed=i % 20))
               for i in range(100)]

    async def worker(i):
        tokens, kv = prompts[i]
        await store.put(ns, tokens, kv)
        res = await store.lookup(ns, tokens)
        got = await store.get(ns, tokens)
        return res.matched_tokens, got is not None and torch.equal(got, kv[:, :, :48])

    results = await asyncio.gather(*(worker(i) for i in random.sample(range(100), 100)))
    assert all(m == 48 and ok for m, ok in results)
    assert store.stats().num_blocks == 20 * 3


async def test_evict_filters(store, ns, spec):
    other = dataclasses.replace(ns, tenant="globex")
    await store.put(ns, random_tokens(64), random_kv(spec, 64))
    await store.put(other, random_tokens(32), random_kv(spec, 32))
    with pytest.raises(InvalidArgument):
        await store.evict()
    assert await store.evict(model_id="nope") == 0
    assert await store.evict(tenant="globex") == 2
    assert {r.tenant for r in store.list_blocks()} == {ns.tenant}
    keys = [r.key for r in store.list_blocks()][:1]
    assert await store.evict(keys=keys) == 1
    assert await store.evict(everything=True) == 3
    assert store.stats().num_blocks == 0


async def test_tenant_stats_count_only_that_tenant(store, ns, spec):
    other = dataclasses.replace(ns, tenant="globex")
    await store.put(ns, random_tokens(64), random_kv(spec, 64))
    await store.put(other, random_tokens(32), random_kv(spec, 32))
    assert store.stats(tenant="globex").tiers["dram"].num_blocks == 2
    assert store.stats(tenant=ns.tenant).tiers["dram"].num_blocks == 4
    assert store.stats(tenant="nobody").num_blocks == 0
    assert store.stats().num_blocks == 6


async def test_lease_pins_blocks_and_expires(tmp_path, ns, spec):
    cfg = make_config(tmp_path)
    async with Store(cfg) as store:
        tokens, kv = random_tokens(32), random_kv(spec, 32)
        await store.put(ns, tokens, kv)
        lease = await store.acquire(ns, tokens, lease_s=0.5)
        assert lease.matched_tokens == 32 and len(lease.blocks) == 2
        assert await store.evict(everything=True) == 0  # pinned blocks stay
        with open(_arena_path(store, ns.tenant, lease.blocks[0].region), "rb") as f, \
                mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as arena:
            loc = lease.blocks[0]
            page = decode_page(arena[loc.offset:loc.offset + loc.length], expected_key=loc.key)
            assert torch.equal(codecs.decode(page.payload), kv[:, :, :16])
        await asyncio.sleep(1.0)  # past the deadline: the reaper unpins
        with pytest.raises(LeaseNotFound):
            await store.release(lease.lease_id)
        assert await store.evict(everything=True) == 2


async def test_release_unknown_lease(store):
    with pytest.raises(LeaseNotFound, match="does not exist"):
        await store.release("no-such-lease")


async def test_reserve_commit_zero_copy_put(store, ns, spec):
    tokens, kv = random_tokens(48), random_kv(spec, 48)
    res = await store.reserve(ns, tokens)
    assert [g.block_index for g in res.blocks] == [0, 1, 2]
    codec = codecs.get(res.codec)
    with open(_arena_path(store, ns.tenant, res.blocks[0].region), "r+b") as f, \
            mmap.mmap(f.fileno(), 0) as arena:
        for g in res.blocks:
            meta = PageMeta(key=g.key, namespace=ns.fingerprint, parent=g.parent,
                            block_index=g.block_index, tenant=ns.tenant, model_id=ns.model_id,
                            codec=codec.name, codec_id=codec.codec_id)
            bt = spec.block_tokens
            page = encode_page(meta, codec.encode(kv[:, :, g.block_index * bt:][:, :, :bt]))
            assert len(page) <= g.capacity_bytes
            arena[g.offset:g.offset + len(page)] = page
    assert await store.commit(res.reservation_id) == 48
    assert torch.equal(await store.get(ns, tokens), kv)
    with pytest.raises(LeaseNotFound):
        await store.commit(res.reservation_id)


async def test_commit_of_a_bad_page_publishes_nothing(store, ns, spec):
    tokens = random_tokens(32)
    res = await store.reserve(ns, tokens)
    with open(_arena_path(store, ns.tenant, res.blocks[0].region), "r+b") as f, \
            mmap.mmap(f.fileno(), 0) as arena:
        arena[res.blocks[0].offset:res.blocks[0].offset + 8] = b"garbage!"
    with pytest.raises(CorruptPage):
        await store.commit(res.reservation_id)
    assert (await store.lookup(ns, tokens)).matched_tokens == 0
    kv = random_kv(spec, 32)
    assert await store.put(ns, tokens, kv) == 32  # the slots were freed, the keys are free
    assert torch.equal(await store.get(ns, tokens), kv)


async def test_hint_promotes_ssd_blocks(tmp_path, ns, spec):
    cfg = make_config(tmp_path)
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    async with Store(cfg) as store:
        await store.put(ns, tokens, kv)
    async with Store(cfg) as store:
        assert await store.hint(ns, tokens, deadline_s=5.0) == 4
        # Polled through the counters: a lookup of the prefix is its request arriving, which
        # would end the hint.
        for _ in range(100):
            counters = store.stats().counters
            if counters.hint_landed + counters.hint_late == 4:
                break
            await asyncio.sleep(0.02)
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"dram": 64}


async def test_closed_store_refuses(tmp_path, ns):
    store = Store(make_config(tmp_path))
    with pytest.raises(KVStoreError, match="not open"):
        await store.lookup(ns, random_tokens(16))


CRASH_CHILD = """
import asyncio, os, sys
from kvstore.config import DramConfig, KVStoreConfig, SsdConfig, TierConfig
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from kvstore.store import Store
from kvstore.store.writes import WriteBuffers
from tests.conftest import random_kv, random_tokens

async def main(path):
    os.makedirs(path + "-shm")  # the killed child's arena file stays out of /dev/shm
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
    ns = Namespace(model_id="test/model", spec=spec, revision="r1", tenant="acme")
    # No DRAM: every put lands on SSD, durable before put returns under fsync="always".
    cfg = KVStoreConfig(dram=DramConfig(capacity_bytes=0, shm_dir=path + "-shm"),
                        ssd=SsdConfig(path=path, capacity_bytes=256 << 20,
                                      segment_bytes=1 << 20, fsync="always"))
    async with Store(cfg) as store:
        i = 0
        while True:
            await store.put(ns, random_tokens(32, seed=i), random_kv(spec, 32, seed=i))
            print(i, flush=True)
            i += 1

asyncio.run(main(sys.argv[1]))
"""


async def test_sigkill_loses_no_acknowledged_put(tmp_path, ns, spec):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, str(tmp_path / "ssd")],
                             stdout=subprocess.PIPE, text=True, cwd=root)
    acked = []
    for line in child.stdout:
        acked.append(int(line))
        if len(acked) >= 40:
            break
    child.send_signal(signal.SIGKILL)
    rest = child.communicate()[0]
    acked += [int(x) for x in rest.split()]
    cfg = make_config(tmp_path, fsync="always")
    async with Store(cfg) as store:
        for i in acked:
            got = await store.get(ns, random_tokens(32, seed=i))
            assert got is not None and torch.equal(got, random_kv(spec, 32, seed=i)), i
        assert store.stats().tiers["ssd"].corrupt == 0


async def test_commit_checks_the_codec_and_abort_frees_slots(store, ns, spec):
    tokens, kv = random_tokens(16), random_kv(spec, 16)
    res = await store.reserve(ns, tokens)
    g = res.blocks[0]
    fp8 = codecs.get("fp8_e4m3")
    meta = PageMeta(key=g.key, namespace=ns.fingerprint, parent=None, block_index=0,
                    tenant=ns.tenant, model_id=ns.model_id, codec=fp8.name, codec_id=fp8.codec_id)
    page = encode_page(meta, fp8.encode(kv))
    with open(_arena_path(store, ns.tenant, g.region), "r+b") as f, \
            mmap.mmap(f.fileno(), 0) as arena:
        arena[g.offset:g.offset + len(page)] = page
    with pytest.raises(InvalidArgument, match="reservation asked for 'raw'"):
        await store.commit(res.reservation_id)
    res = await store.reserve(ns, tokens)
    await store.abort(res.reservation_id)
    with pytest.raises(LeaseNotFound):
        await store.abort(res.reservation_id)
    assert await store.put(ns, tokens, kv) == 16  # at once: the keys were released


@pytest.mark.parametrize("ssd_codec", ["fp8_e4m3+zstd", "int4", "raw+zstd"])
async def test_cold_tier_codec_transcodes_on_demotion(tmp_path, ns, spec, ssd_codec):
    cfg = make_config(tmp_path, codec=ssd_codec)
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    async with Store(cfg) as store:
        await store.put(ns, tokens, kv)  # raw in DRAM; close writes SSD pages with ssd_codec
    async with Store(cfg) as store:
        assert {r.tiers for r in store.list_blocks()} == {("ssd",)}
        got = await store.get(ns, tokens)
        rel = ((got.float() - kv.float()).norm() / kv.float().norm()).item()
        # raw+zstd is lossless; fp8 e4m3 keeps ~2^-4 relative error, int4 ~1/15 of a group range.
        assert rel == 0 if ssd_codec == "raw+zstd" else rel < 0.15
        used = store.stats().tiers["ssd"].bytes_written
        if ssd_codec == "int4":
            assert used < kv.numel()  # < 1 byte/element against 2 for bf16


def _arena_path(store: Store, tenant: str, region: str) -> str:
    """A path this process opens the region of ``tenant``'s memory named ``region`` by (a
    same-host client gets a descriptor from the daemon instead)."""
    dram = store.tiers["dram"]
    assert dram.region_fd(region)[0] == tenant
    return dram.region_path(region)


def _try_to_damage_dram_copy(store: Store, key) -> None:
    """Try to flip bytes at the end of a block's DRAM page through a writable mapping of the
    memory it is in, as a client holding its descriptor could: published memory refuses."""
    region, offset, length = store.tiers["dram"].locate(key)
    with open(store.tiers["dram"].region_path(region), "r+b") as f:
        with pytest.raises(PermissionError):
            mmap.mmap(f.fileno(), 0)
        with pytest.raises(PermissionError):
            os.pwrite(f.fileno(), b"\xff" * 8, offset + length - 40)


# 4 blocks of 4 KiB are verified and decoded on the loop, 4 of 256 KiB on decode threads.
BIG_SPEC = KVSpec(num_layers=8, num_kv_heads=8, head_dim=64, block_tokens=16, dtype="bfloat16")


@pytest.mark.parametrize("big", [False, True], ids=["inline", "threads"])
async def test_a_stored_dram_page_cannot_be_damaged_and_is_read_in_place(store, spec, big):
    """Regression guard for the read path that skips the private copy and the second hash:
    that is safe only because nobody can write the memory a DRAM page is served from. Writes
    through its descriptor are refused, and gets (decoded on the loop or on threads) return
    the stored K/V, with nothing counted corrupt."""
    spec = BIG_SPEC if big else spec
    ns = Namespace(model_id="test/model", spec=spec, tenant="acme")
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    await store.put(ns, tokens, kv)
    keys = await _keys(ns, tokens)
    for key in (keys[0], keys[2]):
        _try_to_damage_dram_copy(store, key)
        page = await store.tiers["dram"].read(key, verify=False)
        assert page.is_trusted
        del page
    got = await store.get(ns, tokens)
    assert torch.equal(got, kv)
    assert got.untyped_storage().nbytes() == got.numel() * got.element_size()
    assert store.stats().tiers["dram"].corrupt == 0


async def test_blocks_promoted_from_ssd_are_published_like_puts(tmp_path, ns, spec):
    """Pages a hint copies up from SSD (verified there) land in published memory too: nobody
    can damage them, and they are served from DRAM."""
    cfg = make_config(tmp_path)
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    async with Store(cfg) as store:
        await store.put(ns, tokens, kv)  # close persists the blocks to SSD
    async with Store(cfg) as store:
        # Copies them up to DRAM (waiting: a lookup would be the request arriving, ending it).
        assert await store.hint(ns, tokens, deadline_s=5.0, policy="wait") == 4
        keys = await _keys(ns, tokens)
        _try_to_damage_dram_copy(store, keys[1])
        _try_to_damage_dram_copy(store, keys[3])
        assert torch.equal(await store.get(ns, tokens), kv)
        stats = store.stats()
        assert stats.tiers["dram"].corrupt == 0 and stats.tiers["ssd"].corrupt == 0
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"dram": 64}


@pytest.mark.parametrize("kind", ["dram", "ssd"])
async def test_puts_reuse_their_write_buffer_without_touching_stored_pages(tmp_path, spec, ns,
                                                                           kind):
    """In-process puts write their pages into a buffer the next put reuses: pages stored
    before (copied into the arena, appended to a segment) stay intact as later puts overwrite
    the buffer, one at a time and side by side."""
    tier = (TierConfig("mem", "dram", DramConfig(capacity_bytes=64 * MiB, chunk_bytes=MiB))
            if kind == "dram" else
            TierConfig("disk", "ssd", SsdConfig(path=str(tmp_path / "ssd"),
                                                capacity_bytes=64 * MiB, segment_bytes=MiB,
                                                fsync="batch", admit_after_accesses=0)))
    prompts = [(random_tokens(48, seed=i), random_kv(spec, 48, seed=i)) for i in range(8)]
    async with Store(KVStoreConfig(tiers=(tier,))) as store:
        for tokens, kv in prompts[:4]:
            assert await store.put(ns, tokens, kv) == 48
        written = await asyncio.gather(*(store.put(ns, t, kv) for t, kv in prompts[4:]))
        assert written == [48] * 4
        for tokens, kv in prompts:
            assert torch.equal(await store.get(ns, tokens), kv)


def test_write_buffers_reuse_the_smallest_fit_within_bounds(monkeypatch):
    buffers = WriteBuffers()
    monkeypatch.setattr(WriteBuffers, "MAX_KEPT", 2)
    monkeypatch.setattr(WriteBuffers, "MAX_KEPT_BYTES", 2000)
    small, large = buffers.take(100), buffers.take(1000)
    buffers.give(large)
    buffers.give(small)
    assert buffers.take(50) is small and buffers.take(50) is large
    assert len(buffers.take(50)) == 50  # none left: a new one
    for _ in range(3):
        buffers.give(bytearray(10))
    buffers.give(big := bytearray(20))
    assert buffers.take(15) is big and len(buffers.take(15)) == 15  # only two were kept
    buffers.give(bytearray(2001))  # over the bytes bound: dropped
    assert len(buffers.take(2000)) == 2000


# Bit patterns of 16-bit floats: NaN, +Inf, -Inf, a signalling NaN (quiet bit clear, payload
# set), a negative NaN; and values that are finite however near: subnormals, the largest finite.
_NONFINITE_BITS = {"bfloat16": (0x7FC0, 0x7F80, 0xFF80, 0x7F81, 0xFFFF),
                   "float16": (0x7E00, 0x7C00, 0xFC00, 0x7C01, 0xFFFF)}
_EDGE_FINITE_BITS = {"bfloat16": (0x0001, 0x8001, 0x007F, 0x7F7F, 0xFF7F),
                     "float16": (0x0001, 0x8001, 0x03FF, 0x7BFF, 0xFBFF)}


async def _commit_raw_pages(store: Store, ns: Namespace, tokens: list[int], kv: torch.Tensor):
    """Reserve ``tokens``, write each block of ``kv`` as a well-formed raw page (checksum and
    all) into its slot, and commit."""
    res = await store.reserve(ns, tokens)
    raw = codecs.get(res.codec)
    bt = ns.spec.block_tokens
    with open(_arena_path(store, ns.tenant, res.blocks[0].region), "r+b") as f, \
            mmap.mmap(f.fileno(), 0) as arena:
        for g in res.blocks:
            meta = PageMeta(key=g.key, namespace=ns.fingerprint, parent=g.parent,
                            block_index=g.block_index, tenant=ns.tenant, model_id=ns.model_id,
                            codec=raw.name, codec_id=raw.codec_id)
            block = kv[:, :, g.block_index * bt:(g.block_index + 1) * bt]
            page = encode_page(meta, raw.encode(block))
            arena[g.offset:g.offset + len(page)] = page
    return await store.commit(res.reservation_id)


def _with_bits(kv: torch.Tensor, index: tuple[int, ...], bits: int) -> torch.Tensor:
    kv = kv.clone()
    kv.view(torch.int16)[index] = bits - (1 << 16) if bits & 0x8000 else bits
    return kv


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
async def test_commit_refuses_a_page_holding_nan_or_inf(store, spec, dtype, where):
    """A well-formed raw page (checksum and all) whose K/V holds NaN or Inf (any sign, a
    signalling NaN too) at its first, a middle or its last element is refused at commit: a
    lossy tier below could never take it on demotion. Regression for the bit-level check."""
    spec = dataclasses.replace(spec, dtype=dtype)
    ns = Namespace(model_id=f"m-{dtype}", spec=spec, tenant="acme")
    kv = random_kv(spec, 32)
    bt = spec.block_tokens
    index = {"first": (0, 0, bt, 0, 0), "middle": (1, 0, bt + 4, 1, 3),
             "last": (spec.num_layers - 1, 1, 2 * bt - 1, spec.num_kv_heads - 1,
                      spec.head_dim - 1)}[where]  # of the second block
    for n, bits in enumerate(_NONFINITE_BITS[dtype]):
        tokens = random_tokens(32, seed=100 + n)
        with pytest.raises(CorruptPage, match="NaN or Inf"):
            await _commit_raw_pages(store, ns, tokens, _with_bits(kv, index, bits))
        assert (await store.lookup(ns, tokens)).matched_tokens == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_commit_takes_subnormal_and_largest_finite_values(store, spec, dtype):
    """The values nearest NaN/Inf in bits (largest finite of each sign) and subnormals pass the
    commit's check, at a page's first and last element, and read back bit for bit."""
    spec = dataclasses.replace(spec, dtype=dtype)
    ns = Namespace(model_id=f"m-{dtype}", spec=spec, tenant="acme")
    kv = random_kv(spec, 32)
    bt, edge = spec.block_tokens, _EDGE_FINITE_BITS[dtype]
    for block in range(2):
        first = (0, 0, block * bt, 0)
        last = (spec.num_layers - 1, 1, block * bt + bt - 1, spec.num_kv_heads - 1)
        for n, bits in enumerate(edge):  # a page's first and last elements, and beside them
            kv = _with_bits(kv, (*first, n), bits)
            kv = _with_bits(kv, (*last, spec.head_dim - 1 - n), edge[-1 - n])
    tokens = random_tokens(32, seed=7)
    assert await _commit_raw_pages(store, ns, tokens, kv)
    assert torch.equal((await store.get(ns, tokens)).view(torch.int16), kv.view(torch.int16))


async def test_get_into_the_callers_buffer_returns_a_view_of_its_front(store, ns, spec):
    """``Store.get(out=)`` writes the stored prefix into the caller's buffer (sized for a
    longer prompt) and returns a view of its front; a prompt with nothing stored leaves it
    untouched and returns None."""
    tokens, kv = random_tokens(48), random_kv(spec, 48)
    assert await store.put(ns, tokens, kv) == 48
    out = torch.full(spec.shape(80), 7.0, dtype=spec.torch_dtype)
    got = await store.get(ns, tokens + random_tokens(37, seed=5), out=out)
    assert got.shape == kv.shape and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, kv) and torch.equal(out[:, :, :48], kv)
    assert bool((out[:, :, 48:] == 7.0).all())
    assert await store.get(ns, random_tokens(48, seed=9), out=out) is None
    assert torch.equal(out[:, :, :48], kv)


@pytest.mark.parametrize("bad, match", [
    (lambda spec: torch.empty(spec.shape(32), dtype=torch.float32), "out is torch.float32"),
    (lambda spec: torch.empty(spec.shape(16), dtype=spec.torch_dtype), r"needs \("),
    (lambda spec: torch.empty(spec.shape(64), dtype=spec.torch_dtype)[:, :, ::2],
     "contiguous"),
    (lambda spec: [0.0] * 4, "must be a torch.Tensor"),
])
async def test_get_refuses_a_bad_out_before_reading(store, ns, spec, bad, match):
    tokens, kv = random_tokens(32), random_kv(spec, 32)
    await store.put(ns, tokens, kv)
    with pytest.raises(InvalidArgument, match=match):
        await store.get(ns, tokens, out=bad(spec))
    assert store.stats().counters.gets == 0
    assert torch.equal(await store.get(ns, tokens), kv)


async def test_in_process_puts_store_version_2_pages_with_aligned_sections(store, ns, spec):
    """In-process puts frame version 2 pages (the payload hashed once, by its blob checksum)
    whose raw section starts ``SECTION_ALIGN_BYTES``-aligned; a flipped payload bit in such a
    page is still caught once it leaves trusted memory."""
    from kvstore.codecs.base import unpack_blob
    from kvstore.page import PAGE_VERSION_BLOB_SUM, SECTION_ALIGN_BYTES

    tokens, kv = random_tokens(32), random_kv(spec, 32)
    await store.put(ns, tokens, kv)
    key = (await _keys(ns, tokens))[1]
    page = await store.tiers["dram"].read(key, verify=False)
    data = bytes(page.data)
    assert data[4] == PAGE_VERSION_BLOB_SUM
    section = unpack_blob(page.payload, verify=False).sections[0]
    start = len(page.data) - len(page.payload) + (len(page.payload) - 8 - len(section))
    assert start % SECTION_ALIGN_BYTES == 0
    del page, section
    decode_page(data, expected_key=key)
    damaged = bytearray(data)
    damaged[start + 100] ^= 0x10
    with pytest.raises(CorruptPage, match="payload checksum"):
        decode_page(damaged, expected_key=key)


async def test_a_put_too_large_for_dram_is_framed_for_the_ssd_instead(tmp_path):
    """Puts hand the DRAM tier pages to frame in place; a page it cannot hold (larger than
    its whole capacity) is framed into a buffer and written to the SSD, and served from there
    bit-exact."""
    ns = Namespace(model_id="test/model", spec=BIG_SPEC, tenant="acme")
    tokens, kv = random_tokens(32), random_kv(BIG_SPEC, 32)
    async with Store(make_config(tmp_path, dram_bytes=BIG_SPEC.block_bytes // 2)) as store:
        assert await store.put(ns, tokens, kv) == 32
        stats = store.stats()
        assert stats.tiers["dram"].num_blocks == 0 and stats.tiers["ssd"].num_blocks == 2
        assert torch.equal(await store.get(ns, tokens), kv)


async def test_a_block_being_evicted_is_never_leased_or_promoted(tmp_path, ns, spec,
                                                                  monkeypatch):
    """Evict takes an unpinned block whole: once it has started deleting the block's copies
    (here held at the SSD, its only copy, by a gate: the one interleaving a test cannot cause
    otherwise), Lookup, Acquire and get stop before it and nothing promotes it, so no lease can
    hold a copy the eviction is dropping. Blocks a lease pinned meanwhile stay; the rest go
    from every tier."""
    cfg = make_config(tmp_path)
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    async with Store(cfg) as store:
        await store.put(ns, tokens, kv)  # closing persists the DRAM pages to the SSD
    async with Store(cfg) as store:
        assert {r.tiers for r in store.list_blocks()} == {("ssd",)}
        ssd = store.tiers["ssd"]
        entered, gate = asyncio.Event(), asyncio.Event()
        real_delete = ssd.delete

        async def held_delete(key):
            entered.set()
            await gate.wait()
            return await real_delete(key)

        monkeypatch.setattr(ssd, "delete", held_delete)
        evicting = asyncio.ensure_future(store.evict(everything=True))
        await entered.wait()  # deleting the last block (children first), the others untouched
        assert (await store.lookup(ns, tokens)).matched_tokens == 48
        leases = [await store.acquire(ns, tokens) for _ in range(2)]
        assert [lease.matched_tokens for lease in leases] == [48, 48]
        got = await store.get(ns, tokens)
        assert torch.equal(got, kv[:, :, :48])
        gate.set()
        assert await evicting == 1  # the three leased blocks were pinned when evict got there
        monkeypatch.undo()
        assert (await store.lookup(ns, tokens)).matched_tokens == 48
        assert {r.block_index for r in store.list_blocks()} == {0, 1, 2}
        for lease in leases:
            await store.release(lease.lease_id)
        assert await store.evict(everything=True) == 3
        assert store.stats().num_blocks == 0 and ssd.stats().used_bytes == 0
