"""Prefetch hints against a real two-tier store (DRAM over SSD, blocks on SSD after a restart):
the request's arrival or an explicit cancel ends a hint, the policies, and each scheduled block
counted once as landed, late or cancelled."""

from __future__ import annotations

import pytest
import torch

from kvstore.config import KVStoreConfig, TierConfig
from kvstore.errors import InvalidArgument
from kvstore.store import Store

from ..conftest import random_kv, random_tokens
from .test_chain import SPEC, dram, namespace, ssd

NUM_BLOCKS = 12


def on_ssd(tmp_path) -> KVStoreConfig:
    return KVStoreConfig(tiers=(
        TierConfig("mem", "dram", dram(4 << 20)),
        TierConfig("disk", "ssd", ssd(tmp_path, persist_on_close=True))))


async def stored(tmp_path, ns, seed: int = 31):
    """A prompt whose blocks only the SSD holds (written, then the store restarted)."""
    tokens = random_tokens(SPEC.block_tokens * NUM_BLOCKS, seed=seed)
    kv = random_kv(SPEC, len(tokens), seed=seed)
    async with Store(on_ssd(tmp_path)) as store:
        await store.put(ns, tokens, kv)
    return tokens, kv


def outcomes(store: Store) -> tuple[int, int, int, int, int]:
    c = store.stats().counters
    return c.hint_blocks, c.hint_landed, c.hint_late, c.hint_cancelled, c.hint_skipped


async def settled(store: Store) -> None:
    """Wait until the store's hints have ended and been counted."""
    await store._hints.settle()


async def test_the_request_arriving_cancels_its_hint(tmp_path):
    ns = namespace()
    tokens, kv = await stored(tmp_path, ns)
    async with Store(on_ssd(tmp_path)) as store:
        assert await store.hint(ns, tokens, deadline_s=60) == NUM_BLOCKS
        # The request arrives before the hint's task has run: its lookup ends the hint, and
        # the request loads what it needs itself.
        hit = await store.lookup(ns, tokens)
        assert hit.tokens_per_tier == {"disk": len(tokens)}
        await settled(store)
        assert outcomes(store) == (NUM_BLOCKS, 0, 0, NUM_BLOCKS, 0)
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"disk": len(tokens)}
        assert torch.equal(await store.get(ns, tokens), kv)


async def test_another_tenant_or_prefix_does_not_cancel_a_hint(tmp_path):
    ns = namespace()
    tokens, _ = await stored(tmp_path, ns)
    async with Store(on_ssd(tmp_path)) as store:
        assert await store.hint(ns, tokens, deadline_s=60) == NUM_BLOCKS
        await store.lookup(namespace(tenant="other"), tokens)  # same tokens, other tenant
        await store.lookup(ns, tokens[: SPEC.block_tokens * 4])  # a shorter prefix
        await settled(store)
        assert outcomes(store) == (NUM_BLOCKS, NUM_BLOCKS, 0, 0, 0)
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"mem": len(tokens)}


async def test_an_acquire_or_a_cancel_ends_a_hint(tmp_path):
    ns = namespace()
    tokens, _ = await stored(tmp_path, ns)
    async with Store(on_ssd(tmp_path)) as store:
        assert await store.hint(ns, tokens, deadline_s=60, policy="timeout") == NUM_BLOCKS
        assert await store.cancel_hint(ns, tokens) == 1  # the request was dropped
        assert await store.cancel_hint(ns, tokens) == 0  # nothing left to cancel
        await settled(store)
        assert outcomes(store)[3] == NUM_BLOCKS
        longer = tokens + random_tokens(SPEC.block_tokens * 2, seed=99)
        assert await store.hint(ns, tokens, deadline_s=60) == NUM_BLOCKS
        lease = await store.acquire(ns, longer)  # its prefix covers the hinted one
        await store.release(lease.lease_id)
        await settled(store)
        blocks, landed, late, cancelled, _ = outcomes(store)
        assert blocks == 2 * NUM_BLOCKS and cancelled == 2 * NUM_BLOCKS and landed == late == 0


async def test_wait_returns_the_blocks_that_landed(tmp_path):
    ns = namespace()
    tokens, kv = await stored(tmp_path, ns)
    async with Store(on_ssd(tmp_path)) as store:
        assert await store.hint(ns, tokens, deadline_s=60, policy="wait") == NUM_BLOCKS
        assert outcomes(store) == (NUM_BLOCKS, NUM_BLOCKS, 0, 0, 0)
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"mem": len(tokens)}
        assert await store.hint(ns, tokens, deadline_s=60, policy="wait") == 0  # nothing left
        assert torch.equal(await store.get(ns, tokens), kv)


async def test_every_scheduled_block_is_counted_once(tmp_path):
    """Whatever the timing, each scheduled block ends landed, late or cancelled."""
    ns = namespace()
    tokens, _ = await stored(tmp_path, ns)
    async with Store(on_ssd(tmp_path)) as store:
        scheduled = await store.hint(ns, tokens, deadline_s=0.02, policy="timeout")
        await store.cancel_hint(ns, tokens)
        await settled(store)
        blocks, landed, late, cancelled, skipped = outcomes(store)
        assert blocks == scheduled and blocks + skipped == NUM_BLOCKS
        assert landed + late + cancelled == scheduled


@pytest.mark.parametrize("bad", ["eventually", ""])
async def test_an_unknown_policy_is_refused(tmp_path, bad):
    ns = namespace()
    tokens, _ = await stored(tmp_path, ns)
    async with Store(on_ssd(tmp_path)) as store:
        with pytest.raises(InvalidArgument, match="hint policy"):
            await store.hint(ns, tokens, deadline_s=1.0, policy=bad)
        with pytest.raises(InvalidArgument, match="deadline_s"):
            await store.hint(ns, tokens, deadline_s=0)
