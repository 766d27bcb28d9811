"""The block directory: prefix matches, per-tier token counts by the fastest holder, and the
fastest holder kept as tiers gain and lose a block in any order."""

from __future__ import annotations

import asyncio

from kvstore.keys import BlockKey
from kvstore.page import PageMeta
from kvstore.room import Footprint, RoomNeed
from kvstore.store.directory import BlockDirectory

TIERS = ("hot", "warm", "cold")
SLOT = Footprint(size_class=0, nbytes=100)


def meta(i: int) -> PageMeta:
    return PageMeta(key=BlockKey(i.to_bytes(16, "little")), namespace=bytes(16),
                    parent=BlockKey((i - 1).to_bytes(16, "little")) if i else None,
                    block_index=i, tenant="acme", model_id="m", codec="raw")


def key(i: int) -> BlockKey:
    return meta(i).key


def never(_: BlockKey) -> bool:
    return False


def test_fastest_follows_the_chain_order_whatever_the_placement_order():
    d = BlockDirectory(TIERS)
    d.place(meta(0), "cold", 10, SLOT)
    assert d.get(key(0)).fastest == "cold"
    d.place(meta(0), "hot", 10, SLOT)  # promoted
    assert d.get(key(0)).fastest == "hot"
    d.place(meta(0), "warm", 10, SLOT)  # a copy below the fastest: it stays
    assert d.get(key(0)).fastest == "hot"
    d.unplace(key(0), "hot")
    assert d.get(key(0)).fastest == "warm"
    d.unplace(key(0), "cold")  # not the fastest: unchanged
    assert d.get(key(0)).fastest == "warm"
    assert d.unplace(key(0), "warm") is None and key(0) not in d


def test_tokens_per_tier_counts_each_block_once_at_its_fastest_tier_in_chain_order():
    d = BlockDirectory(TIERS)
    for i, tiers in enumerate([("cold",), ("cold", "hot"), ("warm",), ("hot",), ("cold",)]):
        for tier in tiers:
            d.place(meta(i), tier, 10, SLOT)
    entries = d.match_prefix([key(i) for i in range(5)])
    counts = d.tokens_per_tier(entries, 16)
    assert counts == {"hot": 32, "warm": 16, "cold": 32}
    assert list(counts) == ["hot", "warm", "cold"]
    assert d.tokens_per_tier([], 16) == {}


def test_match_prefix_stops_at_the_first_missing_key():
    d = BlockDirectory(TIERS)
    for i in (0, 1, 2, 4):
        d.place(meta(i), "hot", 10, SLOT)
    keys = [key(i) for i in range(6)]
    assert [e.meta.key for e in d.match_prefix(keys)] == keys[:3]
    assert [e.meta.key for e in d.match_prefix(iter(keys[:2]))] == keys[:2]
    assert d.match_prefix(keys[3:]) == [] and d.match_prefix([]) == []
    assert len(d.match_prefix(keys[:3])) == 3  # every key held: the whole list


def test_touch_counts_hits_only_for_hits_and_takes_the_callers_keys():
    d = BlockDirectory(TIERS)
    for i in range(3):
        d.place(meta(i), "hot", 10, SLOT)
    entries = d.match_prefix([key(i) for i in range(3)])
    d.touch(entries, hit=False)
    assert [e.hits for e in entries] == [0, 0, 0]
    d.touch(entries, keys=[e.meta.key for e in entries])
    assert [e.hits for e in entries] == [1, 1, 1]
    # The chain was touched parents last: the oldest block of the tier is the tail.
    assert d.coldest("hot", 10) == [key(2)]


async def test_touches_on_a_loop_apply_on_its_next_turn_or_before_any_order_is_read():
    d = BlockDirectory(["hot"])
    for i in range(3):
        d.place(meta(i), "hot", 10, SLOT)
    order = d._orders["hot"]
    d.touch(d.match_prefix([key(0)]))
    d.touch(d.match_prefix([key(1)]))
    assert order.coldest(10, never) == [key(0)]  # not applied yet: the oldest is block 0
    await asyncio.sleep(0)
    assert order.coldest(10, never) == [key(2)]  # applied in the order they were made
    d.touch(d.match_prefix([key(2)]))
    assert d.coldest("hot", 10) == [key(0)]  # reading through the directory applies them
    d.touch(d.match_prefix([key(0)]))
    assert d.victims("hot", RoomNeed(nbytes=10)) == [key(1)]
    d.touch(d.match_prefix([key(1)]))
    d.place(meta(3), "hot", 10, SLOT)  # a change to an order applies them first
    assert order.coldest(10, never) == [key(2)]


async def test_hits_of_a_touch_on_a_loop_are_counted_before_anyone_reads_them():
    """A lookup's hits are counted with its touch, after the reply; whoever reads the counters
    (a block's info, the entries a stats call walks) sees them counted."""
    d = BlockDirectory(["hot"])
    for i in range(2):
        d.place(meta(i), "hot", 10, SLOT)
    entries = d.match_prefix([key(0), key(1)])
    d.touch(entries)
    assert [d.info(e).hits for e in entries] == [1, 1]
    d.touch(entries)
    assert sorted(e.hits for e in d.entries()) == [2, 2]
    d.touch(entries)
    d.touch(entries, hit=False)
    await asyncio.sleep(0)
    assert [e.hits for e in entries] == [3, 3]



async def test_a_long_chain_is_applied_in_pieces_tail_first_and_ranks_as_one(monkeypatch):
    """Regression: a 262,144-block lookup's touch re-ranked every block of every order in one
    loop turn. A long chain now reaches the orders a piece per turn, its tail first, so the
    parents still end up more recent than every child."""
    from kvstore.store import directory

    monkeypatch.setattr(directory, "TOUCH_SLICE_BLOCKS", 4)
    d = BlockDirectory(["hot"])
    for i in range(12):  # placed 11 first: the oldest; 0 the most recent
        d.place(meta(11 - i), "hot", 10, SLOT)
    order = d._orders["hot"]
    d.touch(d.match_prefix([key(i) for i in range(10)]))  # blocks 0-9: 3 pieces
    await asyncio.sleep(0)
    # a turn applies about a piece's worth: pieces (8, 9) then (4-7), not (0-3) yet
    assert order.coldest(300, never) == [key(11), key(10), key(3)]
    assert (d.get(key(4)).hits, d.get(key(3)).hits) == (1, 0)
    for _ in range(3):
        await asyncio.sleep(0)
    assert order.coldest(1200, never) == [key(i) for i in (11, 10, *range(9, -1, -1))]
    assert [d.get(key(i)).hits for i in range(11)] == [1] * 10 + [0]
