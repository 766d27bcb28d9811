"""DramTier: pages in sealed published steps and staging slots in memfd arenas (per tenant),
capacity, reuse, steps given back whole, sharing by descriptor, writers that try to change
published pages, concurrency."""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque

import numpy as np
import pytest
import torch

from kvstore.config import DramConfig
from kvstore.errors import CorruptPage, InvalidArgument, Unavailable
from kvstore.keys import BlockKey
from kvstore.page import (
    PUBLISHED_HEADER_BYTES,
    PageMeta,
    decode_page,
    encode_page,
    is_published,
    is_retired,
    verify_page,
)
from kvstore.room import RoomNeed
from kvstore.tiers.dram.arena import StepPool
from kvstore.tiers.dram.growth import AHEAD_NICE
from kvstore.tiers.dram.slabs import GrowthBudget, SlabAllocator
from kvstore.tiers.dram.tier import THREAD_COPY_BYTES, DramTier

from .published_attacks import all_refused, attack

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


def slots_within(capacity_bytes: int, chunk_bytes: int, page_bytes: int) -> int:
    """How many pages of ``page_bytes`` fill a tier of ``capacity_bytes``: whole steps of
    ``chunk_bytes`` (a header page, then slots), the last one smaller."""
    pool, room, total = StepPool(chunk_bytes), capacity_bytes, 0
    while (step := pool.step_bytes_for(page_bytes, room)) is not None:
        total += (step - PUBLISHED_HEADER_BYTES) // SlabAllocator.slot_bytes_for(page_bytes)
        room -= step
    return total


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
        assert tier.locate(key)[1] % 4096 == 0
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
    region, offset, length = tier.locate(key)
    assert region in tier.published_regions("acme") and region != tier.region_of("acme")
    for name in (region, tier.region_of("acme")):
        tenant, fd = tier.region_fd(name)
        assert tenant == "acme" and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        if HAS_SHM:
            assert not [entry for entry in os.listdir("/dev/shm") if name in entry]
    tenant, fd = tier.region_fd(region)
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
    regions = {t: [tier.region_of(t), *tier.published_regions(t)] for t in pages}
    assert not set(regions["acme"]) & set(regions["globex"])
    assert tier.stats().extra["arenas"] == 2
    for tenant, names in regions.items():
        assert {tier.region_fd(name)[0] for name in names} == {tenant}
    assert tier.region_fd("dram.unknown") is None
    for tenant, (key, page, _) in pages.items():
        other = "globex" if tenant == "acme" else "acme"
        region, offset, length = tier.locate(key)
        assert region in regions[tenant]
        with open(tier.region_path(region), "rb") as f, mmap.mmap(f.fileno(), 0,
                                                                prot=mmap.PROT_READ) as m:
            assert m[offset:offset + length] == page
        for name in regions[other]:
            with open(tier.region_path(name), "rb") as f, mmap.mmap(f.fileno(), 0,
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
        assert len(stored_a) == slots_within(4 * MiB, MiB, len(class_a[0][1]))
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
        # Re-cut steps of A's size: each holds at most one slot of B fewer than a fresh one.
        fresh = slots_within(4 * MiB, MiB, len(page_b))
        assert fresh - tier.stats().extra["published_steps"] <= len(stored_b) <= fresh
        for key, page in stored_b:
            assert bytes((await tier.read(key)).data) == page
        # Emptied steps go back whole: after emptying, one page larger than a step fits.
        for key, _ in stored_b:
            await tier.delete(key)
        key_c, page_c, meta_c = make_page(4000, 3 * MiB)
        assert await tier.write(key_c, page_c, meta_c)
        assert bytes((await tier.read(key_c)).data) == page_c
    finally:
        await tier.close()


@pytest.mark.parametrize("payload_bytes", [50_000, THREAD_COPY_BYTES])  # inline, in a thread
async def test_no_route_a_descriptor_holder_can_take_changes_a_published_page(
        tier: DramTier, payload_bytes: int) -> None:
    """A client holds the descriptor of the step its page is in (what the daemon sends it) and
    tries every way to change the page: each is refused, or lands in a private copy, and the
    page reads back as stored. The same routes do change the staging arena, which clients may
    write: the attacks are real."""
    key, page, meta = make_page(6, payload_bytes)
    assert await tier.write(key, page, meta)
    region, offset, length = tier.locate(key)
    fd = os.dup(tier.region_fd(region)[1])
    try:
        outcomes = await asyncio.to_thread(attack, fd, offset + length - 10)
    finally:
        os.close(fd)
    assert all_refused(outcomes), outcomes
    got = await tier.read(key)
    assert got.is_trusted and bytes(got.data) == page and tier.stats().corrupt == 0
    del got
    slot = await tier.allocate_slot(4096, "acme")
    fd = os.dup(tier.region_fd(tier.region_of("acme"))[1])
    try:
        staging = await asyncio.to_thread(attack, fd, slot.offset)
    finally:
        os.close(fd)
        tier.abort(slot)
    assert staging["pwrite"] == "CHANGED" and staging["a shared writable mapping"] == "CHANGED"


class _Checking:
    """A commit check (``PageCheck``) that records how far the copy had landed at each piece,
    runs ``then`` once all of it has, and verifies the whole copy."""

    def __init__(self, seen: list[bytes], then=None) -> None:
        self.seen, self.then, self.fed = seen, then, []

    def feed(self, view: memoryview, copied: int) -> None:
        self.fed.append(copied)

    def finish(self, out: memoryview) -> PageMeta:
        assert self.fed == sorted(self.fed) and self.fed[-1] == len(out)
        if self.then is not None:
            self.then()
        page = decode_page(out)
        self.seen.append(bytes(out))
        return page.meta


class _Refusing(_Checking):
    def finish(self, out: memoryview) -> PageMeta:
        raise CorruptPage("refused")


async def test_a_slot_changed_during_its_check_is_never_served(tier: DramTier,
                                                                monkeypatch) -> None:
    """claim copies the staging slot's page into published memory and checks that copy there
    (one copy, no private one): a writer that rewrites its slot while the check runs (a
    forged page, checksum recomputed) changes nothing that is checked or served; the
    staging slot is free once published."""
    key, page, meta = make_page(17, 400_000)
    slot = await tier.allocate_slot(len(page), "acme")
    staging = tier.slot_view(slot)
    staging[:len(page)] = page
    forged = encode_page(meta, bytes(len(decode_page(page).payload)))
    seen: list[bytes] = []
    monkeypatch.setattr("kvstore.tiers.dram.staging.CHECK_PIECE_BYTES", 64 << 10)  # several pieces

    def forge() -> None:
        staging[:len(forged)] = forged

    staged = tier.used_bytes
    check = _Checking(seen, forge)
    claim = await tier.claim(slot, key, len(page), check)
    assert await tier.checked(claim) == meta and len(check.fed) == round(len(page) / (64 << 10)) > 1
    assert not tier.contains(key) and tier.locate(key) is None  # nobody is told before publish
    assert tier.publish(claim) == len(page)
    assert tier.used_bytes == staged  # the staging slot went, the published one came
    got = await tier.read(key)
    assert bytes(got.data) == page == seen[0] and got.is_trusted
    verify_page(got)
    assert tier.locate(key)[0] in tier.published_regions("acme")


async def test_a_claim_that_fails_its_check_publishes_nothing(tier: DramTier) -> None:
    """A check that raises fails ``checked``; ``drop`` gives the published slot back and the
    staging slot stays the writer's, so the key is never stored. A page claiming more bytes
    than its slot, or another tenant's page, is refused."""
    key, page, meta = make_page(18, 400_000)
    slot = await tier.allocate_slot(len(page), "acme")
    tier.slot_view(slot)[:len(page)] = page
    used = tier.used_bytes

    claim = await tier.claim(slot, key, len(page), _Refusing([]))
    with pytest.raises(CorruptPage, match="refused"):
        await tier.checked(claim)
    tier.drop(claim)
    assert tier.used_bytes == used and not tier.contains(key)
    with pytest.raises(CorruptPage, match="its slot holds"):
        await tier.claim(slot, key, slot.slot_bytes + 1, _Refusing([]))
    claim = await tier.claim(slot, key, len(page), _Checking([]))
    assert await tier.checked(claim) == meta and tier.publish(claim) == len(page)
    other_key, other_page, _ = make_page(19, 400_000, tenant="globex")
    slot = await tier.allocate_slot(len(other_page), "acme")
    tier.slot_view(slot)[:len(other_page)] = other_page
    claim = await tier.claim(slot, other_key, len(other_page), _Checking([]))
    with pytest.raises(InvalidArgument, match="does not fit"):
        await tier.checked(claim)
    tier.drop(claim)
    tier.abort(slot)
    assert not tier.contains(other_key)


async def test_an_emptied_step_goes_back_whole_and_says_so(tmp_path) -> None:
    """Steps are the unit memory moves between tenants in: acme's emptied steps stay backed
    until globex needs the memory; then each is marked retired in its header, unmapped and
    closed, and a client mapping of it (held here) sees the mark and can drop it; the
    budget never passes capacity."""
    tier = DramTier(DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB))
    await tier.open()
    try:
        acme = [make_page(6100 + i, 200_000) for i in range(40)]
        stored = [k for k, p, m in acme if await tier.write(k, p, m)]
        steps = tier.published_regions("acme")
        assert len(steps) == 4
        fds = [os.dup(tier.region_fd(name)[1]) for name in steps]
        client_maps = [mmap.mmap(fd, 0, prot=mmap.PROT_READ) for fd in fds]  # read-only
        assert all(is_published(m) and not is_retired(m) for m in client_maps)
        for k in stored:
            await tier.delete(k)
        assert tier.published_regions("acme") == steps  # empty, still backed
        key, page, meta = make_page(7100, 3 * MiB, tenant="globex")
        assert await tier.write(key, page, meta)
        kept = tier.published_regions("acme")
        assert len(kept) < len(steps)  # as many as the page needed went back, no more
        for name, m in zip(steps, client_maps):
            assert is_retired(m) == (name not in kept)
            assert (tier.region_fd(name) is None) == (name not in kept)
        assert tier.stats().extra["arena_bytes"] <= tier.capacity_bytes
        for m, fd in zip(client_maps, fds):
            m.close()
            os.close(fd)
        assert bytes((await tier.read(key)).data) == page
    finally:
        await tier.close()


async def test_close_releases_the_arenas(tmp_path) -> None:
    tier = DramTier(DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB, shm_dir=str(tmp_path)))
    await tier.open()
    key, page, meta = make_page(7, 1000)
    assert await tier.write(key, page, meta)
    held = await tier.read(key, verify=False)  # a reader still holding a view must not break close
    regions = [tier.region_of("acme"), *tier.published_regions("acme")]
    assert len(regions) == 2 and all(tier.region_fd(name) is not None for name in regions)
    await tier.close()
    assert all(tier.region_fd(name) is None for name in regions)
    assert tier.arena_path("acme") is None
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
        "from kvstore.tiers.dram.tier import DramTier\n"
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


def pending_page(seed: int, num_tokens: int, tenant: str = "acme"):
    """A raw bf16 block's page not framed yet (``PendingPage``), and the K/V it holds."""
    from kvstore.codecs import RawCodec
    from kvstore.page import PendingPage

    key, _, meta = make_page(seed, 0, tenant)
    kv = torch.randn(2, 2, num_tokens, 4, 64, generator=torch.Generator().manual_seed(seed))
    kv = kv.to(torch.bfloat16)
    return key, PendingPage(meta, RawCodec().prepare(kv)), kv


@pytest.mark.parametrize("num_tokens", [4, 1024], ids=["on-the-loop", "copy-thread"])
async def test_a_pending_page_is_framed_in_published_memory_and_read_trusted(
        tier: DramTier, num_tokens: int) -> None:
    """``write_pending`` frames the page straight into its published slot (the bytes a
    finished version 2 page has), small pages on the loop and large ones on the copy thread;
    it reads back trusted and verifies."""
    from kvstore.codecs import decode
    from kvstore.page import PAGE_VERSION_BLOB_SUM

    key, page, kv = pending_page(40, num_tokens)
    assert (page.nbytes >= THREAD_COPY_BYTES) == (num_tokens == 1024)
    assert await tier.write_pending(key, page)
    assert await tier.write_pending(key, page)  # present already: True, nothing rewritten
    got = await tier.read(key)
    assert got is not None and got.is_trusted and got.meta == page.meta
    assert bytes(got.data) == bytes(page.finished()) and got.data[4] == PAGE_VERSION_BLOB_SUM
    assert torch.equal(decode(decode_page(bytes(got.data), key).payload), kv)
    stats = tier.stats()
    assert stats.num_blocks == 1 and stats.bytes_written == page.nbytes


async def test_write_pending_refuses_another_keys_page_and_counts_no_room(tmp_path) -> None:
    key, page, _ = pending_page(41, 4)
    other, _, _ = make_page(42, 0)
    tier = DramTier(DramConfig(capacity_bytes=0, chunk_bytes=MiB, shm_dir=str(tmp_path)))
    await tier.open()
    try:
        with pytest.raises(InvalidArgument, match="meta names key"):
            await tier.write_pending(other, page)
        assert not await tier.write_pending(key, page)
        assert tier.stats().rejected == 1 and not tier.contains(key)
    finally:
        await tier.close()


async def test_growth_ahead_of_demand_runs_nicer(tmp_path, monkeypatch) -> None:
    """A step made because a write needs it now is made at the daemon's own CPU priority; the
    next one, made ahead while nothing waits for it, on a thread ``AHEAD_NICE`` nicer, so the
    calls the loop answers meanwhile do not wait for its page faults. Pages land either way."""
    made: list[int] = []
    real_make = DramTier._make_step

    def recording(self, step) -> None:
        made.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        real_make(self, step)

    monkeypatch.setattr(DramTier, "_make_step", recording)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    tier = DramTier(DramConfig(capacity_bytes=8 * MiB, chunk_bytes=MiB))
    await tier.open()
    try:
        pages = [make_page(8100 + i, 200_000) for i in range(12)]
        for key, page, meta in pages:
            assert await tier.write(key, page, meta)
            await asyncio.sleep(0.01)  # growth ahead runs in the background
        for _ in range(100):
            if min(19, base + AHEAD_NICE) in made:
                break
            await asyncio.sleep(0.01)
        assert made[0] == base  # the first step: a write waited for it
        assert min(19, base + AHEAD_NICE) in made
        for key, page, _ in pages:
            assert bytes((await tier.read(key)).data) == page
    finally:
        await tier.close()
