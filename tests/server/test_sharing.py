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
