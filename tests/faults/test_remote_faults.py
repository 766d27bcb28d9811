"""Two real daemons, each with its own DRAM and SSD, sharing a Redis cluster: a prefix one
stores the other serves identically; a cluster node killed mid-run costs misses only, nothing
corrupt is served, and service resumes; a page corrupted inside Redis is a counted miss;
tenants stay apart across daemons; a wrong password stops the daemon at start, clearly."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis
import torch

from kvstore.cli.doctor import check_remote
from kvstore.client import Client
from kvstore.config import KVStoreConfig, RemoteConfig
from kvstore.keys import Namespace, block_keys
from kvstore.spec import KVSpec
from kvstore.tiers.remote.link import tenant_tag

from ..cli.helpers import invoke
from ..conftest import random_kv, random_tokens
from ..redis_servers import RedisClusterProcs, RedisServer, needs_redis_binary
from ..server.helpers import DaemonProcess, DaemonThread, short_tmpdir, small_config

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16)  # 8 KiB blocks
ACME = Namespace(model_id="m", spec=SPEC, tenant="acme")
GLOBEX = Namespace(model_id="m", spec=SPEC, tenant="globex")


def daemon_config(root: Path, url: str, prefix: str, host: str, **server) -> KVStoreConfig:
    config = small_config(root, **server)
    return dataclasses.replace(config, remote=RemoteConfig(
        url=url, key_prefix=prefix, host_id=host, write_through=True, timeout_s=0.2,
        retries=1, breaker_failures=3, breaker_reset_s=0.5, directory_flush_s=0.05))


@pytest.fixture
def roots():
    made = [short_tmpdir(), short_tmpdir()]
    yield made
    for root in made:
        shutil.rmtree(root, ignore_errors=True)


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not true within {timeout_s} s")


def remote_blocks(client: Client) -> int:
    return client.stats().tiers["remote"].num_blocks


def test_two_daemons_share_a_prefix_through_the_cluster(redis_cluster_url, key_prefix, roots):
    tokens, kv = random_tokens(16 * 20, seed=1), random_kv(SPEC, 16 * 20, seed=1)
    with DaemonThread(daemon_config(roots[0], redis_cluster_url, key_prefix, "one")) as one, \
            DaemonThread(daemon_config(roots[1], redis_cluster_url, key_prefix, "two")) as two, \
            Client(one.unix_address) as first, Client(two.unix_address) as second:
        assert first.put(ACME, tokens, kv) == 320
        wait_for(lambda: remote_blocks(first) == 20)
        hit = second.lookup(ACME, tokens)
        assert hit.matched_tokens == 320 and hit.tokens_per_tier == {"remote": 320}
        assert torch.equal(second.get(ACME, tokens), kv)
        assert second.lookup(ACME, tokens).tokens_per_tier == {"dram": 320}


def test_a_page_corrupted_in_redis_is_a_counted_miss(redis_cluster_url, key_prefix, roots):
    """SETRANGE on the value of block 5: the other daemon serves blocks 0-4 exactly and never
    the damaged one; its remote tier counts it corrupt."""
    tokens, kv = random_tokens(16 * 10, seed=2), random_kv(SPEC, 16 * 10, seed=2)
    with DaemonThread(daemon_config(roots[0], redis_cluster_url, key_prefix, "one")) as one, \
            DaemonThread(daemon_config(roots[1], redis_cluster_url, key_prefix, "two")) as two, \
            Client(one.unix_address) as first, Client(two.unix_address) as second:
        first.put(ACME, tokens, kv)
        wait_for(lambda: remote_blocks(first) == 10)
        key = block_keys(ACME, tokens)[5]
        with redis.RedisCluster.from_url(redis_cluster_url) as client:
            client.setrange(f"{key_prefix}:{tenant_tag('acme')}:p:{key.hex()}", 500, b"\0" * 16)
        got = second.get(ACME, tokens)
        assert torch.equal(got, kv[:, :, :80])
        assert second.stats().tiers["remote"].corrupt == 1


def test_tenants_stay_apart_across_daemons(redis_cluster_url, key_prefix, roots):
    tokens = {"acme": "ta", "globex": "tg"}
    tok, kv = random_tokens(16 * 4, seed=3), random_kv(SPEC, 16 * 4, seed=3)
    configs = [daemon_config(root, redis_cluster_url, key_prefix, host, tenant_tokens=tokens,
                             require_auth_on_unix=True)
               for root, host in zip(roots, ("one", "two"))]
    with DaemonThread(configs[0]) as one, DaemonThread(configs[1]) as two, \
            Client(one.unix_address, token="ta") as acme, \
            Client(two.unix_address, token="tg") as globex:
        acme.put(ACME, tok, kv)
        wait_for(lambda: remote_blocks(acme) == 4)
        assert globex.lookup(GLOBEX, tok).matched_tokens == 0
        assert globex.get(GLOBEX, tok) is None
        with pytest.raises(Exception, match="tenant"):
            globex.get(ACME, tok)
        with redis.RedisCluster.from_url(redis_cluster_url) as client:
            names = [n.decode() for n in client.scan_iter(match=f"{key_prefix}:*:p:*")]
        assert len(names) == 4 and all(f":{tenant_tag('acme')}:" in n for n in names)
        env = {"KVSTORE_REMOTE__KEY_PREFIX": key_prefix}
        listed = invoke("ls", "--cluster", "--tenant", "acme", "--remote-url",
                        redis_cluster_url, "--json", env=env)
        assert listed.exit_code == 0, listed.output
        rows = json.loads(listed.stdout)
        assert {(r["host"], r["block_index"]) for r in rows} == {("one", i) for i in range(4)}
        assert all(r["tiers"] == ["dram"] for r in rows)
        other = invoke("ls", "--cluster", "--tenant", "globex", "--remote-url",
                       redis_cluster_url, "--json", env=env)
        assert json.loads(other.stdout) == []


@needs_redis_binary
def test_killing_a_cluster_node_costs_misses_only_and_service_resumes(key_prefix, roots,
                                                                     tmp_path):
    cluster = RedisClusterProcs(tmp_path).start()
    prompts = [(random_tokens(16 * 8, seed=10 + i), random_kv(SPEC, 16 * 8, seed=10 + i))
               for i in range(12)]
    with ExitStack() as stack:
        stack.callback(cluster.stop)
        one = stack.enter_context(DaemonThread(daemon_config(roots[0], cluster.url,
                                                             key_prefix, "one")))
        two = stack.enter_context(DaemonThread(daemon_config(roots[1], cluster.url,
                                                             key_prefix, "two")))
        first = stack.enter_context(Client(one.unix_address))
        second = stack.enter_context(Client(two.unix_address))
        for i, (tokens, kv) in enumerate(prompts):
            if i == 4:
                cluster.nodes[1].kill()  # mid-run: the writer is still writing through
            first.put(ACME, tokens, kv)
            started = time.monotonic()
            got = second.get(ACME, tokens)  # never an error: a prefix, or nothing
            assert time.monotonic() - started < 2.0
            if got is not None:  # whatever is served is exact
                assert torch.equal(got, kv[:, :, :got.shape[2]])
        stats = second.stats().tiers["remote"]
        assert stats.extra["available"] == 0 and stats.extra["errors"] > 0
        cfg = two.config.remote
        assert not check_remote(cfg).ok
        cluster.restart(1)
        tokens, kv = random_tokens(16 * 8, seed=99), random_kv(SPEC, 16 * 8, seed=99)

        def shared_again() -> bool:
            first.put(ACME, tokens, kv)
            return second.lookup(ACME, tokens).tokens_per_tier.get("remote") == 128

        wait_for(shared_again, timeout_s=30, interval_s=0.5)
        assert torch.equal(second.get(ACME, tokens), kv)
        assert second.stats().tiers["remote"].extra["available"] == 1
        assert check_remote(cfg).ok


@needs_redis_binary
def test_a_wrong_password_stops_the_daemon_at_start(key_prefix, roots):
    server = RedisServer(roots[0], password="right-horse").start()
    try:
        bad = server.url.replace("right-horse", "wrong-horse")
        config = daemon_config(roots[1], bad, key_prefix, "one")
        daemon = DaemonProcess(config, roots[1])
        assert daemon.proc.wait(120) == 1
        log = daemon.log()
        assert "refused the credentials" in log and "remote.url" in log
        assert "wrong-horse" not in log
    finally:
        server.kill()
