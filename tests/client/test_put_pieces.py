"""A shared-memory put of a prompt as large as most of the DRAM tier: the client reserves and
commits it in pieces, so the staging slots of one piece and the published pages of those before
it share the tier, instead of a whole prompt's staging crowding out its own published pages."""

from __future__ import annotations

import pytest

from kvstore.client import AsyncClient, Client, mappings
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

from ..conftest import random_kv, random_tokens
from ..server.helpers import DaemonThread, rpc_calls, small_config

MiB = 1 << 20
SPEC = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_tokens=16)  # 32 KiB blocks
BLOCKS = 40  # ~1.3 MiB of pages in two 1 MiB steps: the 3 MiB tier holds them once, not twice



@pytest.fixture
def small_tier(tmp_path):
    return small_config(tmp_path, dram_bytes=3 * MiB, ssd={"enabled": False})


def test_a_put_near_the_tiers_size_stores_every_block_in_pieces(small_tier, monkeypatch):
    monkeypatch.setattr(mappings, "PUT_PIECE_BYTES", 16 * SPEC.block_bytes)
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = random_tokens(16 * BLOCKS, seed=3)
    kv = random_kv(SPEC, 16 * BLOCKS, seed=3)
    with DaemonThread(small_tier) as daemon, Client(daemon.unix_address) as client:
        assert client.put(ns, tokens, kv, zero_copy=True) == 16 * BLOCKS
        assert (rpc_calls(daemon, "Reserve"), rpc_calls(daemon, "Commit")) == (3, 3)  # 16 + 16 + 8
        assert client.lookup(ns, tokens).matched_tokens == 16 * BLOCKS
        assert client.get(ns, tokens).equal(kv)
        # a second prompt as large pushes the first out, and is stored whole too
        other, other_kv = random_tokens(16 * BLOCKS, seed=4), random_kv(SPEC, 16 * BLOCKS, seed=4)
        assert client.put(ns, other, other_kv, zero_copy=True) == 16 * BLOCKS


async def test_the_async_client_puts_in_pieces_too(small_tier, monkeypatch):
    monkeypatch.setattr(mappings, "PUT_PIECE_BYTES", 16 * SPEC.block_bytes)
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = random_tokens(16 * BLOCKS, seed=5)
    kv = random_kv(SPEC, 16 * BLOCKS, seed=5)
    with DaemonThread(small_tier) as daemon:
        async with AsyncClient(daemon.unix_address) as client:
            assert await client.put(ns, tokens, kv, zero_copy=True) == 16 * BLOCKS
            assert (await client.get(ns, tokens)).equal(kv)
        assert rpc_calls(daemon, "Commit") == 3


def test_pieces_end_with_the_prompt_and_cover_it_once(monkeypatch):
    monkeypatch.setattr(mappings, "PUT_PIECE_BYTES", 16 * SPEC.block_bytes)
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    assert mappings.put_pieces(ns, 10) == [10]  # less than a block: the put as it was
    assert mappings.put_pieces(ns, 16 * 40 + 5) == [256, 512, 645]
    assert mappings.put_pieces(ns, 16 * 32) == [256, 512]
    assert mappings.put_pieces(ns, 16 * 40, first_block=30) == [640]
    assert mappings.put_pieces(ns, 16 * 60, first_block=10) == [416, 672, 928, 960]
