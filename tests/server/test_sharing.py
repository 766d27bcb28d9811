"""Two real daemons, each with its own DRAM and SSD, given nothing but a shared Redis's url:
what an engine stores on one through shared memory (Reserve/Commit) or over the socket (Put)
the other serves bit-exact, and the write-through queue's counters reach Prometheus."""

from __future__ import annotations

import dataclasses
import shutil
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import Client
from kvstore.config import KVStoreConfig, RemoteConfig
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

from ..conftest import random_kv, random_tokens
from ..redis_servers import free_port
from .helpers import DaemonThread, rpc_calls, short_tmpdir, small_config, wait_for

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16)  # 8 KiB blocks
NS = Namespace(model_id="m", spec=SPEC, tenant="default")


def only_the_url(root: Path, url: str, key_prefix: str, **server) -> KVStoreConfig:
    """A small daemon as `kvstore serve --remote-url URL` makes it (the key prefix keeps tests
    apart on one server)."""
    config = small_config(root, **server)
    return dataclasses.replace(config, remote=RemoteConfig(url=url, key_prefix=key_prefix))


@pytest.fixture
def configs(redis_url, key_prefix):
    roots = [short_tmpdir(), short_tmpdir()]
    yield [only_the_url(roots[0], redis_url, key_prefix, metrics_port=free_port()),
           only_the_url(roots[1], redis_url, key_prefix)]
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


@pytest.mark.parametrize("zero_copy", [True, False], ids=["commit", "put"])
def test_what_one_daemon_stores_the_other_serves(configs, zero_copy):
    n = 16 * 10
    tokens, kv = random_tokens(n, seed=1), random_kv(SPEC, n, seed=1)
    with DaemonThread(configs[0]) as one, DaemonThread(configs[1]) as two, \
            Client(one.unix_address, zero_copy=zero_copy) as first, \
            Client(two.unix_address) as second:
        assert first.put(NS, tokens, kv) == n
        assert (rpc_calls(one, "Commit") > 0) == zero_copy
        assert wait_for(lambda: second.lookup(NS, tokens).matched_tokens == n)
        assert second.lookup(NS, tokens).tokens_per_tier == {"remote": n}
        assert torch.equal(second.get(NS, tokens), kv)

        remote = (("tier", "remote"),)
        got: dict = {}

        def all_written() -> bool:  # the background writer may still be at it
            got.update(scrape(one.metrics_port))
            return got.get(("kvstore_tier_write_through_written_total", remote)) == 10

        assert wait_for(all_written)
        assert got[("kvstore_tier_write_through_queued_total", remote)] == 10
        assert got[("kvstore_tier_write_through_dropped_full_total", remote)] == 0
        assert got[("kvstore_tier_write_through_queue_blocks", remote)] == 0
        extra = first.stats().tiers["remote"].extra  # the same counters over the wire
        assert extra["write_through_written"] == 10 and extra["write_through_failed"] == 0


def test_a_cache_of_groups_one_daemon_stored_hits_and_loads_on_the_other(configs):
    """Attention, latent, window, state and fp8 groups saved through one daemon: the other's
    lookup finds every group whole in the shared tier (counted there), its load brings each
    group back bit-exact, and another tenant's lookup finds nothing."""
    from kvstore.client.groups import GroupCache
    from kvstore.groups import GroupKind

    from ..test_groups import BT, cache, parts_of, same_bits

    spec = cache()
    ns = Namespace("m", spec)
    ids = random_tokens(6 * BT + 5, seed=4)
    data = [parts_of(group, 6 * BT, seed=i) for i, group in enumerate(spec.groups)]
    with DaemonThread(configs[0]) as one, DaemonThread(configs[1]) as two, \
            Client(one.unix_address) as first, Client(two.unix_address) as second:
        GroupCache(first, ns).save(ids, 6, data)
        other = GroupCache(second, ns)
        assert wait_for(lambda: other.lookup(ids).matched_tokens == 6 * BT)
        assert other.lookup(ids).tokens_per_tier == {"remote": 6 * BT}
        loaded = other.load(ids, 6)
        assert loaded is not None
        for group, got, sent in zip(spec.groups, loaded, data):
            for part in group.parts:
                want = sent[part.name]
                if group.kind is GroupKind.WINDOW:
                    want = want[:, got.first_token:6 * BT]
                assert same_bits(got.parts[part.name], want), (group.label, part.name)
        # now held here: counted in the local tier
        assert other.lookup(ids).tokens_per_tier == {"dram": 6 * BT}
        stranger = GroupCache(second, dataclasses.replace(ns, tenant="other"))
        assert stranger.lookup(ids).matched_tokens == 0


def test_a_grouped_hit_in_the_shared_tier_stops_where_a_snapshot_is_missing(configs):
    """The shared tier holds the prefix groups' 6 blocks, but the state snapshot and window
    blocks only of a prefix of 4: the other daemon's hit is 4 blocks, never 6 without its
    state, and what it loads is the state at 4."""
    from kvstore.client.groups import GroupCache, _Plans
    from kvstore.groups import GroupKind

    from ..test_groups import BT, cache, parts_of, same_bits

    spec = cache()
    ns = Namespace("m", spec)
    ids = random_tokens(6 * BT + 5, seed=5)
    data = [parts_of(group, 6 * BT, seed=i) for i, group in enumerate(spec.groups)]
    with DaemonThread(configs[0]) as one, DaemonThread(configs[1]) as two, \
            Client(one.unix_address) as first, Client(two.unix_address) as second:
        GroupCache(first, ns).save(ids, 4, data)
        for put in _Plans(ns).save(ids, 6, data):  # the prefix groups' blocks 4 and 5 only
            if spec.groups[put.group].is_prefix:
                first.put(put.ns, put.tokens, put.stored)
        other = GroupCache(second, ns)
        assert wait_for(lambda: other.lookup(ids).matched_tokens == 4 * BT, timeout_s=10)
        # every write-through has landed: still 4
        assert wait_for(lambda: first.stats().tiers["remote"].extra["write_through_queued"]
                        == first.stats().tiers["remote"].extra["write_through_written"])
        assert other.lookup(ids).matched_tokens == 4 * BT
        state = next(g for g, group in enumerate(spec.groups) if group.kind is GroupKind.STATE)
        loaded = other.load(ids, 4)
        for part in spec.groups[state].parts:
            assert same_bits(loaded[state].parts[part.name], data[state][part.name])
