"""A long request's share of the store's loop: its per-block work in slices that yield, and a
tenant's heavy requests taking turns that never hold up another tenant's."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from kvstore.config import KVStoreConfig
from kvstore.keys import Namespace, block_keys
from kvstore.spec import KVSpec
from kvstore.store import Store
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
