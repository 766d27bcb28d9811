"""Block-wise client calls: ``read_blocks`` hands stored blocks to a visitor (in place in the arena
through shared memory) and ``put(first_block=...)`` adds blocks to a stored prefix."""

from __future__ import annotations

import pytest
import torch

from kvstore.client import Client
from kvstore.errors import InvalidArgument, NotFound
from tests.server.helpers import DaemonThread

from ..conftest import random_kv, random_tokens


def visited(client: Client, ns, tokens, first_block: int = 0, zero_copy: bool | None = None
            ) -> tuple[int, dict[int, torch.Tensor]]:
    blocks: dict[int, torch.Tensor] = {}
    count = client.read_blocks(ns, tokens, lambda i, kv: blocks.__setitem__(i, kv.clone()),
                               first_block=first_block, zero_copy=zero_copy)
    return count, blocks


@pytest.mark.parametrize("zero_copy", [False, True])
def test_read_blocks_visits_the_stored_prefix_from_first_block(config, ns, spec, zero_copy):
    tokens, kv = random_tokens(80), random_kv(spec, 80)
    bt = spec.block_tokens
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        client.put(ns, tokens[:48], kv[:, :, :48], zero_copy=zero_copy)
        count, blocks = visited(client, ns, tokens, first_block=1, zero_copy=zero_copy)
        assert count == 3 and sorted(blocks) == [1, 2]
        for i, block in blocks.items():
            assert torch.equal(block, kv[:, :, i * bt : (i + 1) * bt])
        assert visited(client, ns, random_tokens(32, seed=9), zero_copy=zero_copy) == (0, {})


@pytest.mark.parametrize("zero_copy", [False, True])
def test_put_from_first_block_adds_to_a_stored_prefix(config, ns, spec, zero_copy):
    tokens, kv = random_tokens(64, seed=2), random_kv(spec, 64, seed=2)
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        assert client.put(ns, tokens[:32], kv[:, :, :32], zero_copy=zero_copy) == 32
        assert client.put(ns, tokens, kv[:, :, 32:], first_block=2, zero_copy=zero_copy) == 32
        assert torch.equal(client.get(ns, tokens, zero_copy=False), kv)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_put_from_first_block_needs_the_prefix_stored(config, ns, spec, zero_copy):
    tokens, kv = random_tokens(64, seed=3), random_kv(spec, 64, seed=3)
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        client.put(ns, tokens[:16], kv[:, :, :16], zero_copy=zero_copy)
        with pytest.raises(NotFound, match="block 1 of the prefix is not stored"):
            client.put(ns, tokens, kv[:, :, 32:], first_block=2, zero_copy=zero_copy)
        assert client.lookup(ns, tokens).matched_tokens == 16  # nothing half-written
        assert client.stats().num_blocks == 1


def test_a_negative_first_block_is_refused(config, ns, spec):
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        with pytest.raises(InvalidArgument, match="first_block"):
            client.put(ns, random_tokens(16), random_kv(spec, 16), first_block=-1)
        with pytest.raises(InvalidArgument, match="first_block"):
            client.read_blocks(ns, random_tokens(16), lambda i, kv: None, first_block=-2)
