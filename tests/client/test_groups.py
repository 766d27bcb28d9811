"""A cache of groups through a real daemon: one lookup for every group, a hit only when every
group is whole, window blocks and state snapshots on their own, one copy of a replicated group
under tensor parallelism, fp8 pages with their scales bit-exact, lossy codecs refused for them."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from kvstore.client import Client
from kvstore.client.groups import GroupCache
from kvstore.config import DramConfig
from kvstore.errors import InvalidArgument
from kvstore.groups import CacheSpec, GroupKind
from kvstore.keys import Namespace, block_keys
from kvstore.spec import KVSpec
from tests.server.helpers import DaemonThread, short_tmpdir, small_config
from tests.test_groups import BT, cache, parts_of, same_bits


@pytest.fixture
def root():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def client(root):
    with DaemonThread(small_config(root)) as daemon, Client(daemon.unix_address) as kv:
        yield kv


def tokens(n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def all_parts(spec: CacheSpec, num_tokens: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [parts_of(g, num_tokens, seed + i) for i, g in enumerate(spec.groups)]


def num_blocks(kv: Client) -> int:
    return kv.stats().num_blocks


def test_save_lookup_load_every_kind_bit_exact(client):
    spec = cache()
    ns = Namespace("m", spec)
    groups = GroupCache(client, ns)
    ids = tokens(6 * BT + 5)
    data = all_parts(spec, 6 * BT)
    before = num_blocks(client)
    groups.save(ids, 6, data)
    # attention and latent and fp8: 6 blocks each; window 40 tokens of 96: blocks 3..5; state: 1.
    assert num_blocks(client) - before == 6 * 3 + 3 + 1
    hit = groups.lookup(ids)
    assert hit.matched_tokens == 6 * BT
    loaded = groups.load(ids, 6)
    for group, got, sent in zip(spec.groups, loaded, data):
        for p in group.parts:
            want = sent[p.name]
            if group.kind is GroupKind.WINDOW:
                assert got.first_token == 3 * BT
                want = want[:, 3 * BT:6 * BT]
            assert same_bits(got.parts[p.name], want), (group.label, p.name)


def test_lookup_is_one_call_for_every_group(client):
    ns = Namespace("m", cache())
    groups = GroupCache(client, ns)
    ids = tokens(4 * BT)
    groups.save(ids, 4, all_parts(ns.cache, 4 * BT))
    before = client.stats().counters.lookups
    assert groups.lookup(ids).matched_tokens == 4 * BT
    assert client.stats().counters.lookups - before == 1  # the daemon saw one Lookup


def test_a_missing_snapshot_falls_back_to_the_last_whole_prefix(client):
    spec = cache()
    ns = Namespace("m", spec)
    groups = GroupCache(client, ns)
    ids = tokens(8 * BT)
    data = all_parts(spec, 8 * BT)
    groups.save(ids, 3, data)
    groups.save(ids, 8, data)
    assert groups.lookup(ids).matched_tokens == 8 * BT
    state = ns.group(3)
    chain = block_keys(state, ids)
    from kvstore.keys import snapshot_keys
    assert client.evict(keys=snapshot_keys(state, [chain[7]])) == 1
    # Blocks 4..8 of the attention groups are stored, but only n = 3 has its snapshot.
    assert groups.lookup(ids).matched_tokens == 3 * BT
    assert groups.load(ids, 3) is not None
    assert client.evict(keys=snapshot_keys(state, [chain[2]])) == 1
    assert groups.lookup(ids).matched_tokens == 0


def test_a_missing_window_or_attention_block_is_no_hit(client):
    spec = cache()
    ns = Namespace("m", spec)
    groups = GroupCache(client, ns)
    ids = tokens(6 * BT)
    groups.save(ids, 6, all_parts(spec, 6 * BT))
    from kvstore.keys import snapshot_keys
    window = ns.group(2)
    assert client.evict(keys=snapshot_keys(window, [block_keys(window, ids)[4]])) == 1
    assert groups.lookup(ids).matched_tokens == 0
    groups.save(ids, 6, all_parts(spec, 6 * BT))
    assert groups.lookup(ids).matched_tokens == 6 * BT
    latent = ns.group(1)
    assert client.evict(keys=[block_keys(latent, ids)[5]]) == 1
    assert groups.lookup(ids).matched_tokens == 0  # n = 5 has no snapshot


def test_a_replicated_group_is_stored_once_under_tensor_parallelism(client):
    spec = cache()
    ids = tokens(4 * BT)
    ranks = [GroupCache(client, Namespace("m", spec, tp_rank=r, tp_size=2)) for r in range(2)]
    data = [all_parts(spec, 4 * BT, seed=10 * r) for r in range(2)]
    data[1][1] = data[0][1]  # the latent is the same on both ranks
    before = num_blocks(client)
    ranks[0].save(ids, 4, data[0])
    one_rank = num_blocks(client) - before
    ranks[1].save(ids, 4, data[1])
    # Rank 1 adds its sharded groups, not the latent's 4 blocks again.
    assert num_blocks(client) - before == 2 * one_rank - 4
    for r in range(2):
        loaded = ranks[r].load(ids, 4)
        assert same_bits(loaded[1].parts["kv"], data[0][1]["kv"][:, :4 * BT])
        assert same_bits(loaded[0].parts["k"], data[r][0]["k"][:, :4 * BT])


def test_another_revision_or_adapter_reuses_nothing(client):
    spec = cache()
    ids = tokens(4 * BT)
    GroupCache(client, Namespace("m", spec, revision="a")).save(ids, 4, all_parts(spec, 4 * BT))
    assert GroupCache(client, Namespace("m", spec, revision="a")).lookup(ids).matched_tokens
    for ns in (Namespace("m", spec, revision="b"), Namespace("m", spec, revision="a",
                                                             adapter_id="lora1")):
        assert GroupCache(client, ns).lookup(ids).matched_tokens == 0


def test_invalidating_a_grouped_namespace_drops_every_group(client):
    spec = cache()
    ns = Namespace("m", spec)
    ids = tokens(4 * BT)
    GroupCache(client, ns).save(ids, 4, all_parts(spec, 4 * BT))
    assert client.invalidate(ns) == 4 * 3 + 3 + 1
    assert GroupCache(client, ns).lookup(ids).matched_tokens == 0


def test_a_grouped_namespace_is_refused_where_one_group_is_meant(client):
    ns = Namespace("m", cache())
    with pytest.raises(InvalidArgument, match="Namespace.group"):
        client.get(ns, tokens(2 * BT))


def test_an_old_single_spec_request_still_works(client):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=BT)
    ns = Namespace("m", spec)
    ids = tokens(2 * BT)
    kv = torch.randn(spec.shape(2 * BT)).bfloat16()
    assert client.put(ns, ids, kv) == 2 * BT
    assert torch.equal(client.get(ns, ids), kv)
    assert client.lookup(ns, ids).matched_tokens == 2 * BT


@pytest.mark.parametrize("group", [3, 4])
def test_a_lossy_tier_refuses_state_and_fp8_pages_by_name(root, group):
    config = small_config(root)
    config = dataclasses.replace(config, dram=DramConfig(capacity_bytes=config.dram.capacity_bytes,
                                                         chunk_bytes=config.dram.chunk_bytes,
                                                         codec="fp8_e4m3"))
    spec = cache()
    ns = Namespace("m", spec)
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as kv:
        g = spec.groups[group]
        stored = g.pack(parts_of(g, BT), BT)
        with pytest.raises(InvalidArgument, match="lossy codec 'fp8_e4m3'.*raw or zstd"):
            kv.put(ns.group(group), tokens(BT), stored, zero_copy=False)
        # A bf16 attention group is re-encoded as before.
        g0 = spec.groups[2]
        assert kv.put(ns.group(2), tokens(BT), g0.pack(parts_of(g0, BT), BT),
                      zero_copy=False) == BT


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("scales", ["tensor", "head", "token"])
def test_fp8_engine_pages_round_trip_bit_exact_with_their_scales(client, dtype, scales):
    from kvstore.groups import CacheGroup

    spec = CacheSpec((CacheGroup.attention(3, 2, 16, dtype, scales=scales),
                      CacheGroup.latent(2, [("kv", 32, dtype), ("pe", 8, "bfloat16")],
                                        scales="tensor")), BT)
    ns = Namespace("m", spec)
    ids = tokens(3 * BT)
    data = all_parts(spec, 3 * BT, seed=5)
    GroupCache(client, ns).save(ids, 3, data)
    loaded = GroupCache(client, ns).load(ids, 3)
    for group, got, sent in zip(spec.groups, loaded, data):
        for p in group.parts:
            assert same_bits(got.parts[p.name], sent[p.name]), (dtype, scales, p.name)
    assert ns.group(0).spec.dtype == "uint8"  # stored as bytes: no codec re-encodes them


def test_the_async_twin_keeps_one_surface_and_round_trips(root):
    import asyncio
    import inspect

    from kvstore.client import AsyncClient
    from kvstore.client.groups import AsyncGroupCache

    def public(cls):
        return {n: inspect.signature(f).parameters.keys() for n, f in vars(cls).items()
                if callable(f) and not n.startswith("_")}

    assert public(GroupCache) == public(AsyncGroupCache)
    spec = cache()
    ns = Namespace("m", spec)
    ids = tokens(5 * BT)
    data = all_parts(spec, 5 * BT)

    async def run(address):
        async with AsyncClient(address) as kv:
            groups = AsyncGroupCache(kv, ns)
            await groups.save(ids, 5, data)
            assert (await groups.lookup(ids)).matched_tokens == 5 * BT
            return await groups.load(ids, 5)

    with DaemonThread(small_config(root)) as daemon:
        loaded = asyncio.run(run(daemon.unix_address))
    for group, got, sent in zip(spec.groups, loaded, data):
        if group.kind is GroupKind.STATE:
            assert same_bits(got.parts["ssm"], sent["ssm"])
        elif group.kind is not GroupKind.WINDOW:
            assert same_bits(got.parts[group.parts[0].name], sent[group.parts[0].name][:, :5 * BT])


def test_bytes_pages_demoted_to_a_lossy_tier_stay_bit_exact(root):
    """A chain of raw DRAM over an fp8 SSD: state and fp8 pages pushed out of DRAM keep their
    lossless encoding on the SSD (before, the fp8 codec refused them and they were not moved
    there) and read back bit-exact; a bf16 attention group is re-encoded as before."""
    from kvstore.groups import CacheGroup

    config = small_config(root, dram_bytes=1 << 20, ssd={"codec": "fp8_e4m3"})
    spec = CacheSpec((CacheGroup.attention(4, 4, 64, "bfloat16"),
                      CacheGroup.attention(4, 4, 64, "float8_e4m3fn", scales="head"),
                      CacheGroup.state(4, {"ssm": ((16, 64), "float32")})), BT)
    ns = Namespace("m", spec)
    with DaemonThread(config) as daemon, Client(daemon.unix_address, zero_copy=False) as kv:
        groups = GroupCache(kv, ns)
        prompts = [tokens(4 * BT, seed=s) for s in range(12)]  # ~12 x 212 KiB > 1 MiB DRAM
        data = [all_parts(spec, 4 * BT, seed=s) for s in range(12)]
        for ids, parts in zip(prompts, data):
            groups.save(ids, 4, parts)
        assert kv.stats().tiers["ssd"].num_blocks > 0
        from_ssd = 0
        for ids, parts in zip(prompts, data):
            result = groups.lookup(ids)
            hit = result.matched_tokens
            from_ssd += result.tokens_per_tier.get("ssd", 0)
            if not hit:
                continue
            loaded = groups.load(ids, hit // BT)
            for g in (1, 2):
                for p in spec.groups[g].parts:
                    want = parts[g][p.name]
                    if p.name in ("k", "v"):
                        want = want[:, :hit]
                    elif p.per_block:
                        want = want[:, :hit // BT]
                    assert same_bits(loaded[g].parts[p.name], want)
        assert from_ssd, "no hit was served from the SSD"


def test_a_pin_of_a_grouped_prefix_keeps_every_groups_pages(client):
    """One pin covers every page the grouped hit needs (prefix blocks, the window's blocks,
    the state snapshot): an evict leaves them all, so the hit stays whole; unpin ends it."""
    spec = cache()
    ns = Namespace("m", spec)
    groups = GroupCache(client, ns)
    ids = tokens(6 * BT + 5, seed=9)
    groups.save(ids, 6, all_parts(spec, 6 * BT))
    info = client.pin(ns, ids, 600)
    assert info.num_blocks == 6 * 3 + 3 + 1  # as stored: attention, latent, fp8; window; state
    assert len(client.list_pins()) == 1
    client.evict(tenant="default")
    assert groups.lookup(ids).matched_tokens == 6 * BT
    assert groups.load(ids, 6) is not None
    assert client.unpin(ns, ids) == 1
    assert client.list_pins() == []
    client.evict(tenant="default")
    assert groups.lookup(ids).matched_tokens == 0
    assert num_blocks(client) == 0


def test_a_pin_of_a_cache_without_prefix_groups_is_named_and_ended_by_its_snapshot(client):
    """A window and a state group only (no group keeps the whole prefix): the pin is named by
    group 0's last page, and unpin finds it again from the tokens."""
    spec = cache(groups=tuple(g for g in cache().groups if not g.is_prefix))
    ns = Namespace("m", spec)
    groups = GroupCache(client, ns)
    ids = tokens(5 * BT, seed=10)
    groups.save(ids, 5, all_parts(spec, 5 * BT))
    assert client.pin(ns, ids, 600).num_blocks == 3 + 1
    client.evict(tenant="default")
    assert groups.lookup(ids).matched_tokens == 5 * BT
    assert client.unpin(ns, ids) == 1
    client.evict(tenant="default")
    assert groups.lookup(ids).matched_tokens == 0
