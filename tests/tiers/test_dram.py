"""DramTier: slots in real memfd arenas (one per tenant), capacity, reuse, corruption, seals,
sharing by descriptor, concurrency."""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import subprocess
import sys
import textwrap
import time
from collections import deque

import numpy as np
import pytest
import torch

from kvstore.config import DramConfig
from kvstore.errors import CorruptPage, InvalidArgument, Unavailable
from kvstore.keys import BlockKey
from kvstore.page import PageMeta, decode_page, encode_page, verify_page
from kvstore.policy.base import RoomNeed
from kvstore.tiers.arena import GrowthBudget, SlabAllocator
from kvstore.tiers.dram import THREAD_VERIFY_BYTES, DramTier

MiB = 1 << 20
HAS_SHM = os.path.isdir("/dev/shm")


def make_page(seed: int, payload_bytes: int, tenant: str = "acme"
              ) -> tuple[BlockKey, bytes, PageMeta]:
    """An encoded page with a key and payload derived from ``seed``."""
    key = BlockKey(hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=16).digest())
    meta = PageMeta(key=key, namespace=bytes(16), parent=None, block_index=seed % 1000,
                    tenant=tenant, model_id="test/model", codec="raw", codec_id=1)
    payload = np.random.default_rng(seed).integers(0, 256, payload_bytes, dtype=np.uint8)
    return key, encode_page(meta, payload.tobytes()), meta


def _flip_byte(path: str, offset: int) -> None:
    """Damage one byte through a mapping of our own, as a stray writer would."""
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), offset + 1)
        m[offset] ^= 0xFF
        m.close()


@pytest.fixture
async def tier(tmp_path):
    config = DramConfig(capacity_bytes=64 * MiB, chunk_bytes=MiB,
                        shm_dir="/dev/shm" if HAS_SHM else str(tmp_path))
    t = DramTier(config)
    await t.open()
    yield t
    await t.close()


async def test_write_read_delete_contains(tier: DramTier) -> None:
    key, page, meta = make_page(1, 10_000)
    assert not tier.contains(key)
    assert await tier.write(key, page, meta)
    assert tier.contains(key) and tier.page_size(key) == len(page)
    got = await tier.read(key)
    assert got is not None and bytes(got.data) == page and got.meta == meta
    assert await tier.write(key, page, meta)  # present already: a no-op that says True
    assert tier.stats().num_blocks == 1
    assert list(tier.entries()) == [meta]
    assert await tier.delete(key)
    assert not await tier.delete(key)
    assert not tier.contains(key) and tier.used_bytes == 0
    assert await tier.read(key) is None
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.bytes_read, stats.bytes_written) == (
        1, 1, len(page), len(page))


async def test_read_of_missing_key_counts_a_miss(tier: DramTier) -> None:
    key, _, _ = make_page(2, 100)
    assert await tier.read(key) is None
    assert tier.stats().misses == 1 and tier.stats().hits == 0


async def test_sizes_make_slot_classes_and_used_bytes_counts_slots(tier: DramTier) -> None:
    sizes = [100, 5000, 5000, 20_000, 3 * MiB // 2]
    for i, size in enumerate(sizes):
        key, page, meta = make_page(10 + i, size)
        assert await tier.write(key, page, meta)
        assert tier.footprint(key).size_class == SlabAllocator.slot_bytes_for(len(page))
        assert tier.locate(key)[0] % 4096 == 0
    stats = tier.stats()
    assert stats.extra["slot_classes"] == 4
    expected = sum(SlabAllocator.slot_bytes_for(len(make_page(10 + i, s)[1]))
                   for i, s in enumerate(sizes))
    assert stats.used_bytes == expected
    for i, size in enumerate(sizes):
        key, page, _ = make_page(10 + i, size)
        got = await tier.read(key)
        assert got is not None and bytes(got.data) == page


async def test_write_rejects_a_page_whose_meta_names_another_key(tier: DramTier) -> None:
    key, page, _ = make_page(3, 100)
    _, _, other_meta = make_page(4, 100)
    with pytest.raises(InvalidArgument):
        await tier.write(key, page, other_meta)


async def test_arena_is_a_memfd_another_process_maps_by_descriptor(tier: DramTier) -> None:
    """No file in /dev/shm or anywhere: another process reaches the arena only through a
    descriptor it was given (here inherited; the daemon sends it over its Unix socket)."""
    key, page, meta = make_page(5, 300_000)
    assert await tier.write(key, page, meta)
    tenant, fd = tier.region_fd(tier.region_of("acme"))
    assert tenant == "acme" and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    if HAS_SHM:
        assert not [name for name in os.listdir("/dev/shm") if tier.region_of("acme") in name]
    offset, length = tier.locate(key)
    child_fd = os.dup(fd)  # a descriptor of our own to hand over; the tier keeps its own
    script = textwrap.dedent(f"""
        import mmap, hashlib
        from kvstore.page import decode_page
        m = mmap.mmap({child_fd}, {length}, mmap.MAP_SHARED, mmap.PROT_READ, offset={offset})
        page = decode_page(memoryview(m), expected_key=bytes.fromhex({bytes(key).hex()!r}))
        print(hashlib.sha256(page.payload).hexdigest(), page.meta.tenant)
    """)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(child_fd,))
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        os.close(child_fd)
    assert proc.returncode == 0, stderr.decode()
    expected = hashlib.sha256(decode_page(page).payload).hexdigest()
    assert stdout.decode().split() == [expected, "acme"]


async def test_each_tenant_has_an_arena_of_its_own(tier: DramTier) -> None:
    """Pages of two tenants land in two memfds: neither arena holds a byte of the other's."""
    pages = {t: make_page(20 + i, 200_000, tenant=t) for i, t in enumerate(("acme", "globex"))}
    for key, page, meta in pages.values():
        assert await tier.write(key, page, meta)
    regions = {t: tier.region_of(t) for t in pages}
    assert len(set(regions.values())) == 2 and tier.stats().extra["arenas"] == 2
    fds = {t: tier.region_fd(regions[t]) for t in pages}
    assert {t: fd[0] for t, fd in fds.items()} == {"acme": "acme", "globex": "globex"}
    assert tier.region_fd("dram.unknown") is None
    for tenant, (key, page, _) in pages.items():
        other = "globex" if tenant == "acme" else "acme"
        with open(tier.arena_path(tenant), "rb") as f, mmap.mmap(f.fileno(), 0,
                                                               prot=mmap.PROT_READ) as m:
            offset, length = tier.locate(key)
            assert m[offset:offset + length] == page
        with open(tier.arena_path(other), "rb") as f, mmap.mmap(f.fileno(), 0,
                                                              prot=mmap.PROT_READ) as m:
            assert m.find(page[-4096:]) < 0


async def test_a_holder_of_the_descriptor_cannot_resize_or_seal_the_arena(tier: DramTier) -> None:
    """Regression guard: a client shrinking its arena under the daemon's mapping would kill
    the daemon with SIGBUS on its next touch; the memfd is sealed at its size."""
    import fcntl

    key, page, meta = make_page(6, 100_000)
    assert await tier.write(key, page, meta)
    fd = os.open(tier.arena_path("acme"), os.O_RDWR)  # what a client holds: read-write
    try:
        size = os.fstat(fd).st_size
        for new_size in (0, size + (1 << 20)):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, new_size)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    finally:
        os.close(fd)
    assert bytes((await tier.read(key)).data) == page


async def test_tenants_share_the_capacity_and_free_tails_move_between_them(tmp_path) -> None:
    """One tier-wide budget: one tenant may fill it, another finds no room, and once the first
    empties its arena the second takes its memory back (arena bytes never pass capacity)."""
    tier = DramTier(DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB))
    await tier.open()
    try:
        acme = [make_page(6000 + i, 200_000) for i in range(40)]
        stored = [k for k, p, m in acme if await tier.write(k, p, m)]
        assert 0 < len(stored) < len(acme) and tier.used_bytes <= tier.capacity_bytes
        key, page, meta = make_page(7000, 200_000, tenant="globex")
        assert not await tier.write(key, page, meta)  # acme's arena holds all the memory
        assert tier.stats().extra["arena_bytes"] <= tier.capacity_bytes
        for k in stored:
            await tier.delete(k)
        assert await tier.write(key, page, meta)
        assert bytes((await tier.read(key)).data) == page
        assert tier.stats().extra["arena_bytes"] <= tier.capacity_bytes
        big_key, big, big_meta = make_page(7001, 3 * MiB, tenant="globex")
        assert await tier.write(big_key, big, big_meta)  # needs nearly all of acme's memory
        assert tier.stats().extra["arena_bytes"] <= tier.capacity_bytes
    finally:
        await tier.close()


async def test_capacity_bound_with_store_style_eviction(tmp_path) -> None:
    config = DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB,
                        shm_dir="/dev/shm" if HAS_SHM else str(tmp_path))
    tier = DramTier(config)
    await tier.open()
    rng = np.random.default_rng(7)
    sizes = [3000, 9000, 60_000, 200_000]
    live: deque[tuple[BlockKey, bytes]] = deque()
    try:
        for i in range(2000):
            key, page, meta = make_page(1000 + i, int(rng.choice(sizes)) + int(rng.integers(64)))
            while not await tier.write(key, page, meta):
                assert live, "an empty tier refused a page smaller than its capacity"
                old_key, _ = live.popleft()
                assert await tier.delete(old_key)
            live.append((key, page))
            assert tier.used_bytes <= tier.capacity_bytes
            assert tier.stats().extra["arena_bytes"] <= config.capacity_bytes
        stats = tier.stats()
        assert stats.rejected > 0
        assert stats.extra["arena_bytes"] <= config.capacity_bytes
        assert stats.num_blocks == len(live)
        for key, page in live:
            got = await tier.read(key)
            assert got is not None and bytes(got.data) == page
    finally:
        await tier.close()


async def test_emptied_chunks_are_reassigned_to_another_class(tmp_path) -> None:
    config = DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB,
                        shm_dir="/dev/shm" if HAS_SHM else str(tmp_path))
    tier = DramTier(config)
    await tier.open()
    try:
        class_a = [make_page(2000 + i, 30_000) for i in range(400)]
        stored_a = [k for k, p, m in class_a if await tier.write(k, p, m)]
        assert 0 < len(stored_a) < len(class_a)  # filled up
        slot_a = tier.footprint(stored_a[0]).size_class
        assert len(stored_a) == 4 * (MiB // slot_a)
        # A page of another class does not fit until class A lets a chunk go.
        key_b, page_b, meta_b = make_page(3000, 100_000)
        assert not tier.can_write(len(page_b))
        assert not await tier.write(key_b, page_b, meta_b)
        slot_b = SlabAllocator.slot_bytes_for(len(page_b))
        # What the tier needs: one slot of B's class (A's slots do not help), or of A's.
        assert tier.room_for(len(page_b)) == RoomNeed(nbytes=slot_b, size_class=slot_b)
        assert tier.room_for(len(class_a[0][1])) == RoomNeed(nbytes=slot_a, size_class=slot_a)
        assert tier.footprint(key_b) is None
        for key in stored_a:
            await tier.delete(key)
        assert tier.stats().extra["slot_classes"] == 0
        class_b = [make_page(3000 + i, 100_000) for i in range(60)]
        stored_b = [(k, p) for k, p, m in class_b if await tier.write(k, p, m)]
        assert len(stored_b) == 4 * (MiB // slot_b)
        for key, page in stored_b:
            assert bytes((await tier.read(key)).data) == page
        # Freed chunks merge: after emptying, one page larger than a chunk fits.
        for key, _ in stored_b:
            await tier.delete(key)
        key_c, page_c, meta_c = make_page(4000, 3 * MiB)
        assert await tier.write(key_c, page_c, meta_c)
        assert bytes((await tier.read(key_c)).data) == page_c
    finally:
        await tier.close()


@pytest.mark.parametrize("payload_bytes", [50_000, THREAD_VERIFY_BYTES])  # inline, in a thread
async def test_corrupt_page_is_dropped_and_counted(tier: DramTier, payload_bytes: int) -> None:
    key, page, meta = make_page(6, payload_bytes)
    assert await tier.write(key, page, meta)
    offset, length = tier.locate(key)
    await asyncio.to_thread(_flip_byte, tier.arena_path("acme"), offset + length - 10)
    assert await tier.read(key) is None
    stats = tier.stats()
    assert stats.corrupt == 1 and not tier.contains(key) and stats.used_bytes == 0


def _overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[offset:offset + len(data)] = data


@pytest.mark.parametrize("payload_bytes", [50_000, THREAD_VERIFY_BYTES])
async def test_a_page_forged_in_the_arena_fails_its_seal(tier: DramTier, payload_bytes) -> None:
    """A writer with the arena mapped replaces a stored page's payload and recomputes the plain
    checksum: the page still parses and its checksum holds, but it no longer matches the seal
    the tier keeps, so every read is a corrupt miss."""
    key, page, meta = make_page(16, payload_bytes)
    assert await tier.write(key, page, meta)
    forged = encode_page(meta, bytes(len(decode_page(page).payload)))  # same size, all zeros
    assert decode_page(forged, expected_key=key).meta == meta
    offset, _ = tier.locate(key)
    await asyncio.to_thread(_overwrite, tier.arena_path("acme"), offset, forged)
    unverified = await tier.read(key, verify=False)
    assert bytes(unverified.data) == forged
    with pytest.raises(CorruptPage, match="fails its seal"):
        verify_page(unverified)
    del unverified
    assert await tier.read(key) is None
    assert tier.stats().corrupt == 1 and not tier.contains(key)


async def test_a_slot_changed_after_its_checked_copy_is_never_served(tier: DramTier) -> None:
    """publish seals the store's checked copy, not the slot: a writer that rewrites its slot
    after the copy was taken (a forged page, checksum recomputed) gets a corrupt miss."""
    key, page, meta = make_page(17, 400_000)
    slot = await tier.allocate_slot(len(page), "acme")
    tier.slot_view(slot)[:len(page)] = page
    checked = bytes(tier.slot_view(slot)[:len(page)])
    forged = encode_page(meta, bytes(len(decode_page(page).payload)))
    tier.slot_view(slot)[:len(forged)] = forged
    assert await tier.publish(slot, key, meta, checked) == len(page)
    assert await tier.read(key) is None and tier.stats().corrupt == 1
    key2, page2, meta2 = make_page(18, 400_000)
    slot = await tier.allocate_slot(len(page2), "acme")
    tier.slot_view(slot)[:len(page2)] = page2
    assert await tier.publish(slot, key2, meta2, bytes(page2)) == len(page2)
    assert bytes((await tier.read(key2)).data) == page2
    with pytest.raises(InvalidArgument, match="does not fit"):  # another tenant's page
        slot = await tier.allocate_slot(len(page2), "globex")
        await tier.publish(slot, key2, meta2, page2)


async def test_close_releases_the_arenas(tmp_path) -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB, shm_dir=str(tmp_path)))
    await tier.open()
    key, page, meta = make_page(7, 1000)
    assert await tier.write(key, page, meta)
    held = await tier.read(key, verify=False)  # a reader still holding a view must not break close
    region = tier.region_of("acme")
    assert tier.region_fd(region) is not None
    await tier.close()
    assert tier.region_fd(region) is None and tier.arena_path("acme") is None
    assert bytes(held.data) == page
    assert os.listdir(tmp_path) == []  # nothing was ever made in shm_dir
    with pytest.raises(Unavailable):
        await tier.read(key)


async def test_concurrent_writes_reads_deletes_stay_consistent(tier: DramTier) -> None:
    pages = [make_page(5000 + i, [2000, 40_000, 1_100_000][i % 3]) for i in range(100)]

    async def cycle(i: int) -> None:
        key, page, meta = pages[i]
        assert await tier.write(key, page, meta)
        got = await tier.read(key)
        assert got is not None and bytes(got.data) == page
        if i % 2:
            assert await tier.delete(key)

    await asyncio.gather(*(cycle(i) for i in range(100)))
    await asyncio.gather(*(tier.write(*pages[i]) for i in range(0, 100, 2)))  # rewrites: no-ops
    remaining = {k for k, _, _ in pages[0::2]}
    assert {m.key for m in tier.entries()} == remaining
    expected = sum(SlabAllocator.slot_bytes_for(len(p)) for _, p, _ in pages[0::2])
    assert tier.used_bytes == expected and tier.stats().num_blocks == 50


async def test_pin_cuda_without_cuda_is_a_no_op(tier: DramTier) -> None:
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU run")
    assert await tier.pin_cuda() is False


async def test_reserve_grows_ahead_of_demand_within_capacity(tmp_path) -> None:
    tier = DramTier(DramConfig(capacity_bytes=6 * MiB, chunk_bytes=4 * MiB, shm_dir=str(tmp_path)))
    await tier.open()
    try:
        assert tier.stats().extra["arena_bytes"] == 0
        assert await tier.reserve(5 * MiB, "acme") == 5 * MiB  # a chunk, then the rest asked for
        assert tier.stats().extra["arena_bytes"] == 5 * MiB
        assert await tier.reserve(100 * MiB, "acme") == 6 * MiB  # capped at capacity
        key, page, meta = make_page(12, 5 * MiB)
        assert tier.can_write(len(page)) and await tier.write(key, page, meta)
        assert bytes((await tier.read(key)).data) == page
    finally:
        await tier.close()


async def test_zero_capacity_rejects_every_write(tmp_path) -> None:
    tier = DramTier(DramConfig(capacity_bytes=0, chunk_bytes=MiB, shm_dir=str(tmp_path)))
    await tier.open()
    try:
        key, page, meta = make_page(14, 100)
        assert not tier.can_write(len(page))
        assert not await tier.write(key, page, meta)
        assert tier.stats().rejected == 1 and not tier.contains(key)
    finally:
        await tier.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_pin_cuda_registers_the_arena_as_it_grows() -> None:
    tier = DramTier(DramConfig(capacity_bytes=64 * MiB, chunk_bytes=4 * MiB))
    await tier.open()
    try:
        first = make_page(13, 100_000)
        assert await tier.write(*first)
        assert await tier.pin_cuda()
        pages = [make_page(100 + i, 3 * MiB) for i in range(8)]  # grown after pinning
        for key, page, meta in pages:
            assert await tier.write(key, page, meta)
        for key, page, _ in [first, *pages]:
            got = await tier.read(key, verify=False)  # a view of the arena, not a private copy
            verify_page(got)
            host = torch.frombuffer(got.payload, dtype=torch.uint8)
            assert host.is_pinned()
            on_gpu = host.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(on_gpu.cpu(), host)
            del host, got
    finally:
        await tier.close()


def test_allocator_merges_regions_and_plans_growth() -> None:
    alloc = SlabAllocator(capacity_bytes=4 * MiB, chunk_bytes=MiB)
    assert alloc.plan_growth(5000) == MiB - MiB % 8192  # a chunk trimmed to whole 8 KiB slots
    assert alloc.plan_growth(5 * MiB) is None
    alloc.add_grown(0, 4 * MiB)
    slots = [alloc.allocate(MiB) for _ in range(4)]
    assert alloc.allocate(MiB) is None and alloc.plan_growth(100) is None
    for slot in slots:
        alloc.release(slot)
    assert alloc.free_region_bytes == 4 * MiB and alloc.plan_growth(4 * MiB) == 0


def test_allocator_keeps_chunks_inside_one_pinned_growth_step() -> None:
    """Regression: a slot spanning two cudaHostRegister ranges made host-to-device copies fail
    with cudaErrorInvalidValue, so growth after pinning must not merge with earlier space."""
    slot_bytes = 3 * MiB
    alloc = SlabAllocator(capacity_bytes=16 * MiB, chunk_bytes=4 * MiB)
    alloc.add_grown(0, 4 * MiB)
    first = alloc.allocate(slot_bytes)  # leaves a 1 MiB tail free
    alloc.merge_growth = False
    assert alloc.plan_growth(slot_bytes) == slot_bytes  # the tail does not count
    alloc.add_grown(4 * MiB, slot_bytes)
    second = alloc.allocate(slot_bytes)
    assert (first.offset, second.offset) == (0, 4 * MiB)
    alloc.release(first)
    alloc.release(second)
    assert alloc.free_region_bytes == 4 * MiB + slot_bytes
    assert alloc.allocate(4 * MiB + slot_bytes) is None  # the two never merge


async def _best_seconds(rounds: int, fn, reset=None) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        await fn()
        best = min(best, time.perf_counter() - t0)
        if reset is not None:
            await reset()
    return best


def _copy_row(method: str, out: torch.Tensor, i: int, src: memoryview) -> None:
    if method == "numpy":  # single-threaded
        np.copyto(out[i].numpy(), np.frombuffer(src, dtype=np.uint8))
    else:  # torch copy_ spreads a large copy over the intra-op threads
        out[i].copy_(torch.frombuffer(src, dtype=torch.uint8))


def measure_dram_throughput(num_pages: int = 32, rounds: int = 3,
                            methods: tuple[str, ...] = ("numpy",)) -> dict[str, float]:
    """GB/s (best of ``rounds``) of 2 MiB pages: put (page bytes -> slot, one at a time and
    gathered), verify (read alone), get (read + verify + copy the payload into a preallocated
    tensor) and memcpy (the same payloads copied from the arena into the same tensor), for each
    copy method. numpy is the steady one on a shared 2-core box: there torch copy_ swung from
    0.3 to 15 GB/s when a neighbour held the other core its OpenMP team waits for."""
    payload_bytes = 2 * MiB

    async def run() -> dict[str, float]:
        capacity = num_pages * 2 * (payload_bytes + 4096)  # room for the gathered puts
        tier = DramTier(DramConfig(capacity_bytes=capacity, chunk_bytes=64 * MiB))
        await tier.open()
        await tier.reserve(capacity, "acme")  # grow and prefault before timing anything
        pages = [make_page(9000 + i, payload_bytes) for i in range(num_pages)]
        out = torch.ones(num_pages, payload_bytes, dtype=torch.uint8)  # faulted in up front

        async def put() -> None:
            for key, page, meta in pages:
                await tier.write(key, page, meta)

        async def put_gather() -> None:
            await asyncio.gather(*(tier.write(*p) for p in pages))

        async def drop() -> None:
            await asyncio.gather(*(tier.delete(key) for key, _, _ in pages))

        async def verify() -> None:
            for key, _, _ in pages:
                await tier.read(key)

        def timed_copies(method: str, views: list[memoryview] | None):
            async def go() -> None:
                for i, (key, _, _) in enumerate(pages):
                    src = views[i] if views is not None else (await tier.read(key)).payload
                    _copy_row(method, out, i, src)
            return go

        def gathered_gets(method: str):
            async def go() -> None:
                got = await asyncio.gather(*(tier.read(key) for key, _, _ in pages))
                for i, page in enumerate(got):
                    _copy_row(method, out, i, page.payload)
            return go

        try:
            await put()
            secs = {"verify": await _best_seconds(rounds, verify)}
            views = [(await tier.read(k)).payload for k, _, _ in pages]
            for method in methods:
                secs[f"get[{method}]"] = await _best_seconds(rounds, timed_copies(method, None))
                secs[f"get_gather[{method}]"] = await _best_seconds(rounds, gathered_gets(method))
                secs[f"memcpy[{method}]"] = await _best_seconds(rounds,
                                                                timed_copies(method, views))
            views.clear()  # lets close() unmap the arena
            await drop()
            secs["put"] = await _best_seconds(rounds, put, drop)
            secs["put_gather"] = await _best_seconds(rounds, put_gather, drop)
        finally:
            await tier.close()
        return {k: num_pages * payload_bytes / v / 1e9 for k, v in secs.items()}

    return asyncio.run(run())


def measure_copy_methods(num_pages: int = 32, rounds: int = 5) -> dict[str, float]:
    """GB/s of copying 2 MiB page bytes into prefaulted shared memory, by method."""
    size = 2 * MiB
    arena = mmap.mmap(-1, num_pages * size)
    dst = np.frombuffer(arena, dtype=np.uint8)
    dst[:] = 1
    srcs = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
            for i in range(num_pages)]
    view = memoryview(arena)
    methods = {
        "memoryview": lambda i, s: view.__setitem__(slice(i * size, (i + 1) * size), s),
        "numpy.copyto": lambda i, s: np.copyto(dst[i * size:(i + 1) * size],
                                               np.frombuffer(s, dtype=np.uint8)),
        "torch.copy_": lambda i, s: torch.from_numpy(dst[i * size:(i + 1) * size]).copy_(
            torch.frombuffer(s, dtype=torch.uint8)),
    }
    result = {}
    for name, fn in methods.items():
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i, src in enumerate(srcs):
                fn(i, src)
            best = min(best, time.perf_counter() - t0)
        result[name] = num_pages * size / best / 1e9
    return result


def test_throughput_of_2mib_pages_is_reported() -> None:
    """Prints put/get GB/s against memcpy (no assertion on speed: numbers vary by machine)."""
    gbps = measure_dram_throughput(num_pages=16, rounds=2)
    base = gbps["memcpy[numpy]"]
    print("\n2 MiB pages        GB/s   x memcpy")
    for name in ("memcpy[numpy]", "put", "put_gather", "verify", "get[numpy]",
                 "get_gather[numpy]"):
        print(f"{name:<17} {gbps[name]:6.2f}   {gbps[name] / base:.2f}")
    assert set(gbps) == {"memcpy[numpy]", "get[numpy]", "get_gather[numpy]", "verify", "put",
                         "put_gather"}


if __name__ == "__main__":
    import json

    result = measure_dram_throughput(num_pages=64, rounds=int(os.environ.get("ROUNDS", "10")),
                                     methods=("numpy", "torch"))
    result.update({f"write_copy[{k}]": v for k, v in measure_copy_methods().items()})
    for method in ("numpy", "torch"):
        for get in ("get", "get_gather"):
            result[f"{get}/memcpy[{method}]"] = (result[f"{get}[{method}]"]
                                                 / result[f"memcpy[{method}]"])
    for name in ("put", "put_gather"):
        result[f"{name}/write_copy[numpy]"] = result[name] / result["write_copy[numpy.copyto]"]
    print(json.dumps({k: round(v, 2) for k, v in result.items()}, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


async def test_a_killed_process_leaves_no_arena_behind(tmp_path) -> None:
    """Regression: a daemon killed with SIGKILL used to leave its /dev/shm arena behind for
    good. A memfd has no name in any file system: its memory goes with its last holder."""
    import signal

    code = (
        "import asyncio, os\n"
        "from kvstore.config import DramConfig\n"
        "from kvstore.tiers.dram import DramTier\n"
        "from kvstore.page import PageMeta, encode_page\n"
        "async def main():\n"
        f"    t = DramTier(DramConfig(capacity_bytes=1 << 20, chunk_bytes=1 << 20,"
        f" shm_dir={str(tmp_path)!r}))\n"
        "    await t.open()\n"
        "    meta = PageMeta(bytes(16), bytes(16), None, 0, 'acme', 'm', 'raw', 1)\n"
        "    assert await t.write(meta.key, encode_page(meta, b'x' * 1000), meta)\n"
        "    print(os.readlink(t.arena_path('acme')), flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().startswith("/memfd:kvstore-dram.")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert os.listdir(tmp_path) == []
    if HAS_SHM:  # arena files used to be named after their process
        assert not [name for name in os.listdir("/dev/shm") if f"-{child.pid}-" in name]


def test_allocator_gives_free_chunks_back_anywhere_and_grows_into_them_again() -> None:
    """A free chunk in the middle of an arena goes back to the shared budget (a hole), another
    arena grows with it, and the first arena later backs the hole again before extending."""
    budget = GrowthBudget(4 * MiB)
    first = SlabAllocator(capacity_bytes=4 * MiB, chunk_bytes=MiB, budget=budget)
    second = SlabAllocator(capacity_bytes=4 * MiB, chunk_bytes=MiB, budget=budget)
    for offset in range(0, 4 * MiB, MiB):
        first.add_grown(offset, MiB)
    slots = [first.allocate(MiB) for _ in range(4)]
    assert budget.room_bytes == 0 and second.growth_plan(MiB) is None
    first.release(slots[1])  # a chunk in the middle, between two in use
    assert first.releasable_bytes == MiB
    assert first.release_free(MiB) == [(MiB, MiB)]
    assert (first.backed_bytes, first.grown_bytes, budget.room_bytes) == (3 * MiB, 4 * MiB, MiB)
    assert first.backed_ranges() == [(0, MiB), (2 * MiB, 2 * MiB)]
    assert second.growth_plan(MiB) == (0, MiB)
    second.add_grown(0, MiB)
    assert second.allocate(MiB) is not None and budget.room_bytes == 0
    assert first.growth_plan(MiB) is None  # the hole is there, the budget is not
    first.release(slots[3])
    assert first.release_free(MiB) == [(3 * MiB, MiB)]  # the tail: the extent shrinks
    assert (first.grown_bytes, first.backed_bytes) == (3 * MiB, 2 * MiB)
    assert first.growth_plan(MiB) == (MiB, MiB)  # the hole before a new tail
    first.add_grown(MiB, MiB)
    assert first.allocate(MiB).offset == MiB and first.backed_bytes == 3 * MiB
