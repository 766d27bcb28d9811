"""Staging memory outside what was lent: a tenant's arena touched where the tier never lent
it is punched back to its lent ranges, the lent slots keep their bytes, and what cannot be
freed yet is charged to the budget (``kvstore.tiers.dram.overreach``)."""

from __future__ import annotations

import mmap
import os

import pytest

from kvstore.config import DramConfig
from kvstore.tiers.dram.arena import ShmArena
from kvstore.tiers.dram.overreach import unlent_ranges
from kvstore.tiers.dram.tier import DramTier

MiB = 1 << 20


@pytest.fixture
async def tier(tmp_path):
    t = DramTier(DramConfig(capacity_bytes=64 * MiB, chunk_bytes=MiB))
    await t.open()
    yield t
    await t.close()


def _touch_all(tier: DramTier, tenant: str) -> None:
    """What a client of ``tenant`` can do: map its whole arena writable and read every page."""
    fd = os.open(tier.arena_path(tenant), os.O_RDWR)
    try:
        with mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED) as mapped:
            sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))
    finally:
        os.close(fd)


def _held(tier: DramTier, tenant: str) -> int:
    return os.stat(tier.arena_path(tenant)).st_blocks * 512


def test_unlent_ranges_are_the_rest_of_the_arena():
    assert unlent_ranges([], 10) == [(0, 10)]
    assert unlent_ranges([(0, 4)], 10) == [(4, 6)]
    assert unlent_ranges([(2, 2), (6, 2)], 10) == [(0, 2), (4, 2), (8, 2)]
    assert unlent_ranges([(0, 10)], 10) == []


async def test_a_sweep_punches_out_what_was_not_lent_and_keeps_the_lent_slots(tier):
    slot = await tier.allocate_slot(MiB, "acme")
    view = tier.slot_view(slot)
    view[:4] = b"kept"
    view[-4:] = b"tail"
    lent = tier.stats().extra["staging_bytes"]
    _touch_all(tier, "acme")
    assert _held(tier, "acme") == 64 * MiB
    growth = tier._growth
    async with growth._grow_lock:  # no sweep of the tier's own in between
        assert await growth.overreach._sweep_one(growth.arenas["acme"]) is None
        assert _held(tier, "acme") == lent
        assert bytes(view[:4]) == b"kept" and bytes(view[-4:]) == b"tail"
        extra = tier.stats().extra
        assert extra["staging_outside_bytes"] == 0
        assert extra["staging_punched_bytes"] == 64 * MiB - lent
        assert extra["arena_bytes"] == lent
        assert growth.arenas["acme"].backed_bytes == lent
    del view
    tier.abort(slot)


async def test_what_cannot_be_punched_yet_is_charged_until_it_goes(tier, monkeypatch):
    """A client touching pages again while they are punched leaves some held: that cannot be
    timed from a test, so the punch is made to free nothing. It is charged to the budget (and
    acme may not grow into memory other tenants let go) until a sweep finds it gone."""
    slot = await tier.allocate_slot(MiB, "acme")
    lent = tier.stats().extra["staging_bytes"]
    _touch_all(tier, "acme")
    real_punch = ShmArena.punch
    monkeypatch.setattr(ShmArena, "punch", lambda self, ranges: None)
    growth = tier._growth
    assert await growth.overreach.sweep() == 64 * MiB - lent
    assert await growth.overreach.sweep() == 64 * MiB - lent  # still held: still charged
    assert tier.stats().extra["arena_bytes"] == 64 * MiB
    assert growth.arenas["acme"].backed_bytes == 64 * MiB
    assert growth.budget.room_bytes == 0
    assert not growth.may_take_from_others(growth.arenas["acme"])
    assert (await tier.held_outside())["acme"] == 64 * MiB - lent  # counts in its quota share
    monkeypatch.setattr(ShmArena, "punch", real_punch)
    assert await growth.overreach.sweep() == 0
    assert tier.stats().extra["arena_bytes"] == lent
    assert growth.may_take_from_others(growth.arenas["acme"])
    assert await tier.held_outside() == {}
    tier.abort(slot)
