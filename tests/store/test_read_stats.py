"""A tier's ``hits`` and ``bytes_read`` count every read it serves: pages leased out of it
(clients read them in place) and pages sent from where they lie, not only copied reads.

Regression: a vLLM engine loaded 108k tokens a run from DRAM through leases while the DRAM
tier's hits and bytes_read stayed 0, because only the copy-read path counted them.
"""

from __future__ import annotations

import pytest

from kvstore.client import Client
from kvstore.store import Store

from ..conftest import random_kv, random_tokens
from ..server.helpers import DaemonThread, small_config
from .test_store import make_config


@pytest.fixture
async def store(tmp_path):
    async with Store(make_config(tmp_path)) as s:
        yield s


async def test_a_lease_counts_its_pages_as_reads_of_the_tier_lending_them(store, ns, spec):
    tokens = random_tokens(64)
    await store.put(ns, tokens, random_kv(spec, 64))
    before = store.stats().tiers["dram"]
    lease = await store.acquire(ns, tokens)
    after = store.stats().tiers["dram"]
    assert lease.tier == "dram" and len(lease.blocks) == 4
    assert after.hits - before.hits == 4
    assert after.bytes_read - before.bytes_read == sum(lease.blocks.lengths)
    await store.release(lease.lease_id)
    again = store.stats().tiers["dram"]  # counted once per lease, not per look at the stats
    assert (again.hits, again.bytes_read) == (after.hits, after.bytes_read)


async def test_pages_sent_in_place_count_as_reads(store, ns, spec):
    tokens = random_tokens(48, seed=1)
    await store.put(ns, tokens, random_kv(spec, 48, seed=1))
    before = store.stats().tiers["dram"]
    pinned = await store.get_in_place(ns, tokens)
    assert pinned is not None
    pinned.release()
    after = store.stats().tiers["dram"]
    assert after.hits - before.hits == 3 and after.bytes_read - before.bytes_read >= pinned.nbytes


def test_a_zero_copy_get_counts_in_the_daemons_stats(tmp_path, ns, spec):
    tokens, kv = random_tokens(64, seed=2), random_kv(spec, 64, seed=2)
    with DaemonThread(small_config(tmp_path)) as daemon, \
            Client(daemon.unix_address, zero_copy=True) as client:
        client.put(ns, tokens, kv)
        before = client.stats().tiers["dram"]
        assert client.get(ns, tokens).equal(kv)
        after = client.stats().tiers["dram"]
    assert after.hits - before.hits == 4
    assert after.bytes_read - before.bytes_read >= kv.nbytes
