"""A long request's share of the store's loop: its per-block work in slices that yield, and a
tenant's heavy requests taking turns that never hold up another tenant's."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from kvstore.api import ModelProfile
from kvstore.config import KVStoreConfig
from kvstore.keys import Namespace, block_keys
from kvstore.spec import KVSpec
from kvstore.store import Store
from kvstore.store import directory as directory_module
from kvstore.store.directory import BlockDirectory
from kvstore.store.slices import LoopShare

from .test_chain import dram

SLICE = 64  # blocks per slice here: a few thousand-block prompts make many slices
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16)


def namespace(tenant: str = "acme") -> Namespace:
    return Namespace(model_id="m", spec=SPEC, tenant=tenant)


def config() -> KVStoreConfig:
    return KVStoreConfig(dram=dram(64 << 20), ssd=dataclasses.replace(
        KVStoreConfig().ssd, enabled=False))


def tokens(num_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, num_blocks * SPEC.block_tokens,
                                                dtype=np.uint32)


@pytest.fixture
async def store():
    async with Store(config()) as s:
        s.share = LoopShare(slice_blocks=SLICE)
        yield s


async def test_keys_in_slices_are_the_keys_in_one_pass():
    ns = namespace()
    for num_blocks in (1, SLICE - 1, SLICE, SLICE + 1, 5 * SLICE + 3):
        arr = tokens(num_blocks, seed=num_blocks)
        arr = np.concatenate([arr, arr[:SPEC.block_tokens - 1]])  # a trailing partial block
        assert await LoopShare(SLICE).keys(ns, arr) == block_keys(ns, arr)


async def test_match_prefix_in_slices_matches_the_directory():
    directory = BlockDirectory(["a"])
    share = LoopShare(SLICE)
    assert await share.match_prefix(directory, [], 16) == ([], {})
    assert directory.tier_names == ("a",)


async def test_a_long_lookup_yields_and_other_work_runs_between_its_slices(store):
    """Regression: a Lookup of a long stored prompt ran from hashing to reply in one step of
    the loop (0.2-0.7 s for 262,144 blocks), so nothing else ran meanwhile."""
    ns = namespace()
    num_blocks = 20 * SLICE
    arr = tokens(num_blocks, seed=1)
    await store.put(ns, arr, torch.zeros(SPEC.shape(arr.size), dtype=SPEC.torch_dtype))
    ticks = 0
    done = asyncio.Event()

    async def other_tenant() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_tenant())
    await asyncio.sleep(0)
    pauses = store.share.num_pauses
    result = await store.lookup(ns, arr)
    done.set()
    await ticker
    assert result.matched_tokens == arr.size
    # hashing, probing and sightings: a yield between every two slices of each
    assert store.share.num_pauses - pauses >= 3 * (num_blocks // SLICE - 1)
    assert ticks >= num_blocks // SLICE


class TurnCounter:
    """Counts calls of a function between two turns of a ticker task: the most seen. (Two
    steps of other tasks can fall between two ticks, one each side of a turn's end: a slice
    per step shows as at most two slices here.)"""

    def __init__(self) -> None:
        self.calls = 0
        self.most = 0
        self.turns = 0
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.turns += 1
            self.most, self.calls = max(self.most, self.calls), 0

    def count(self, n: int = 1) -> None:
        self.calls += n

    def stop(self) -> None:
        self.most = max(self.most, self.calls)
        self._task.cancel()


async def test_a_long_lookups_advice_and_touch_take_a_slice_a_turn(store, monkeypatch):
    """Regression (issue 28, item 7): after the sliced hashing and probing, a long lookup
    scored every block for its advice (a few microseconds each: over a second at 262,144
    blocks) and cut its touch into pieces in one turn of the loop. Now no turn scores or
    touches more than a slice's blocks, and another tenant's short lookup runs meanwhile."""
    monkeypatch.setattr(directory_module, "TOUCH_SLICE_BLOCKS", SLICE)
    ns, other = namespace(), namespace(tenant="zeta")
    num_blocks = 20 * SLICE
    arr = tokens(num_blocks, seed=4)
    await store.put(ns, arr, torch.zeros(SPEC.shape(arr.size), dtype=SPEC.torch_dtype))
    store.set_model_profile(ns, ModelProfile(num_params=8e9, num_layers=32, hidden_size=4096,
                                             flops_per_s=4e14))
    await store.lookup(ns, arr[:SPEC.block_tokens])  # the directory's touches applied
    await asyncio.sleep(0)
    scored, touched = TurnCounter(), TurnCounter()
    placement, directory = store._placement, store._dir
    fastest, apply = placement.fastest_holder, directory._apply
    monkeypatch.setattr(placement, "fastest_holder",
                        lambda entry: (scored.count(), fastest(entry))[1])
    monkeypatch.setattr(directory, "_apply",
                        lambda touch: (touched.count(touch[3] - touch[2]), apply(touch))[1])
    order: list[str] = []

    async def short() -> None:
        await asyncio.sleep(0)  # the long one has begun
        await store.lookup(other, tokens(4, seed=5))
        order.append("short")

    long = await asyncio.gather(store.lookup(ns, arr), short())
    order.append("long")
    for _ in range(num_blocks // SLICE + 2):  # the last pieces of the touch
        await asyncio.sleep(0)
    scored.stop()
    touched.stop()
    assert long[0].matched_tokens == arr.size and long[0].advised_tokens is not None
    assert scored.calls + scored.most > 0 and touched.most > 0
    assert scored.most <= 2 * SLICE and touched.most <= 2 * SLICE, (scored.most, touched.most)
    assert order == ["short", "long"]


async def test_a_list_is_joined_and_cut_a_slice_a_turn():
    """``joined`` and ``truncate``, the reply's keys and a freed chain: a slice per turn."""
    share = LoopShare(SLICE)
    keys = [i.to_bytes(16, "little") for i in range(10 * SLICE + 5)]
    assert await share.joined(keys) == b"".join(keys) and share.num_pauses >= 10
    items, pauses = list(range(10 * SLICE + 5)), share.num_pauses
    await share.truncate(items, 7)
    assert items == list(range(7)) and share.num_pauses - pauses == 9  # 10 cuts
    await share.truncate(items, 7)
    assert items == list(range(7))


async def test_a_tenants_queued_heavy_lookups_do_not_hold_up_another_tenants(store):
    """Regression: lookups ran whole, in arrival order, so a tenant's lookup queued behind
    another's flood waited for all of it. Now each tenant runs at most HEAVY_PER_TENANT at
    once, and the other's heavy lookup interleaves with those."""
    ns_a, ns_b = namespace(tenant="acme"), namespace(tenant="zeta")
    arr = tokens(20 * SLICE, seed=2)
    order: list[str] = []

    async def lookup(ns, name: str) -> None:
        await store.lookup(ns, arr)
        order.append(name)

    flood = [asyncio.create_task(lookup(ns_a, f"a{i}")) for i in range(8)]
    await asyncio.sleep(0)  # the flood arrives first
    await asyncio.gather(lookup(ns_b, "b"), *flood)
    assert store.share.num_waits >= 8 - store.share.heavy_per_tenant
    assert order.index("b") <= store.share.heavy_per_tenant + 1, order
    assert not store.share._turns  # every turn given back


async def test_short_requests_take_no_turn(store):
    ns = namespace()
    arr = tokens(SLICE, seed=3)
    await asyncio.gather(*(store.lookup(ns, arr) for _ in range(10)))
    assert store.share.num_waits == 0 and store.share.num_pauses == 0


def test_bad_slices_are_refused():
    with pytest.raises(ValueError, match="slice_blocks"):
        LoopShare(slice_blocks=0)
