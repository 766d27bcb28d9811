"""Hints over the wire against a real daemon: the policy field, the CancelHint RPC, a lookup
ending a hint, and the outcome counters in the daemon's stats."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from kvstore.client import AsyncClient
from kvstore.errors import InvalidArgument
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from .helpers import small_config
from .test_metrics import free_port, samples

NUM_BLOCKS = 6


async def on_ssd_only(config, ns, spec) -> list[int]:
    """A prompt written to a daemon that then stopped: its blocks are on SSD only."""
    tokens = random_tokens(spec.block_tokens * NUM_BLOCKS, seed=7)
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address) as client:
            await client.put(ns, tokens, random_kv(spec, len(tokens), seed=7), zero_copy=False)
    finally:
        await daemon.stop(1.0)
    return tokens


@pytest.fixture
async def restarted(config, ns, spec):
    tokens = await on_ssd_only(config, ns, spec)
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address) as client:
            yield client, tokens
    finally:
        await daemon.stop(1.0)


async def test_wait_lands_the_prefix_and_the_counters_say_so(restarted, ns):
    client, tokens = restarted
    assert (await client.lookup(ns, tokens)).tokens_per_tier == {"ssd": len(tokens)}
    assert await client.hint(ns, tokens, deadline_s=60, policy="wait") == NUM_BLOCKS
    counters = (await client.stats()).counters
    assert (counters.hint_blocks, counters.hint_landed, counters.hint_cancelled) == \
        (NUM_BLOCKS, NUM_BLOCKS, 0)
    assert (await client.lookup(ns, tokens)).tokens_per_tier == {"dram": len(tokens)}


async def test_cancel_and_arrival_end_hints_and_every_block_is_counted(restarted, ns):
    client, tokens = restarted
    assert await client.cancel_hint(ns, tokens) == 0  # nothing pending
    scheduled = await client.hint(ns, tokens, deadline_s=60, policy="timeout")
    ended = await client.cancel_hint(ns, tokens)  # 1, or 0 if it had already landed
    assert scheduled == NUM_BLOCKS and ended in (0, 1)
    await client.lookup(ns, tokens)
    assert await client.cancel_hint(ns, tokens) == 0  # the lookup ended whatever was left
    await client.hint(ns, tokens, deadline_s=60, policy="wait")  # ends once all are counted
    c = (await client.stats()).counters
    assert c.hint_landed + c.hint_late + c.hint_cancelled == c.hint_blocks
    assert c.hint_cancelled >= ended  # a cancelled hint had at least one block left


async def test_hint_outcomes_are_metrics(root, ns, spec):
    config = small_config(root, metrics_port=free_port())
    tokens = await on_ssd_only(config, ns, spec)
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address) as client:
            assert await client.hint(ns, tokens, deadline_s=60, policy="wait") == NUM_BLOCKS
            assert await client.hint(ns, tokens, deadline_s=60) == 0  # all in DRAM now
        url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    finally:
        await daemon.stop(1.0)
    got = samples(text.decode())
    assert got[("kvstore_hint_blocks_total", ())] == NUM_BLOCKS
    assert got[("kvstore_hint_landed_total", ())] == NUM_BLOCKS
    assert got[("kvstore_hint_cancelled_total", ())] == 0
    assert got[("kvstore_hint_late_total", ())] == got[("kvstore_hint_skipped_total", ())] == 0


async def test_an_unknown_policy_is_an_invalid_argument(restarted, ns):
    client, tokens = restarted
    with pytest.raises(InvalidArgument, match="hint policy"):
        await client.hint(ns, tokens, deadline_s=1.0, policy="eventually")


async def test_fifty_hints_of_one_prefix_read_it_from_the_ssd_once(restarted, ns):
    """Regression: 50 hints of the same prefix sent together each read every block from the
    SSD (2,230-2,745 reads for 50 hints, issue 28, item 7); a block on its way is now shared."""
    client, tokens = restarted
    reads = (await client.stats()).tiers["ssd"].hits
    landed = await asyncio.gather(*(client.hint(ns, tokens, deadline_s=60, policy="wait")
                                    for _ in range(50)))
    # later hints plan only the blocks not in DRAM when they arrive
    assert landed[0] == NUM_BLOCKS and all(0 <= n <= NUM_BLOCKS for n in landed)
    assert (await client.stats()).tiers["ssd"].hits - reads == NUM_BLOCKS
    assert (await client.lookup(ns, tokens)).tokens_per_tier == {"dram": len(tokens)}


async def test_a_hint_of_a_grouped_prefix_brings_every_groups_pages_up(config):
    """A cache of groups on SSD only after a restart: one hint brings every page its hit needs
    (prefix blocks, window blocks, the state snapshot) into DRAM; a lookup ends a pending one."""
    from kvstore.client.groups import AsyncGroupCache
    from kvstore.keys import Namespace

    from ..test_groups import BT, cache, parts_of

    spec = cache()
    ns = Namespace("m", spec)
    ids = random_tokens(6 * BT + 5, seed=8)
    data = [parts_of(group, 6 * BT, seed=i) for i, group in enumerate(spec.groups)]
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address) as client:
            await AsyncGroupCache(client, ns).save(ids, 6, data)
    finally:
        await daemon.stop(1.0)
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address) as client:
            groups = AsyncGroupCache(client, ns)
            assert (await groups.lookup(ids)).tokens_per_tier == {"ssd": 6 * BT}
            assert await client.hint(ns, ids, deadline_s=60, policy="wait") == 6 * 3 + 3 + 1
            assert (await groups.lookup(ids)).tokens_per_tier == {"dram": 6 * BT}
            assert await client.cancel_hint(ns, ids) == 0
    finally:
        await daemon.stop(1.0)
