"""Store.get_in_place: a stored prefix's raw DRAM pages handed out where they lie (what the data
socket sends from), pinned until released."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvstore.config import DramConfig, KVStoreConfig, SsdConfig
from kvstore.store import Store
from kvstore.store.reads import canonical_pieces

from ..conftest import random_kv, random_tokens

MiB = 1 << 20


def _config(tmp_path, codec: str = "raw") -> KVStoreConfig:
    return KVStoreConfig(dram=DramConfig(capacity_bytes=32 * MiB, chunk_bytes=MiB, codec=codec),
                         ssd=SsdConfig(path=str(tmp_path / "ssd"), enabled=False))


def _joined(pieces: list[memoryview], shape, dtype) -> torch.Tensor:
    data = bytearray(b"".join(bytes(piece) for piece in pieces))
    return torch.frombuffer(data, dtype=dtype).view(shape)


def _inside_published(store: Store, tenant: str, piece: memoryview) -> bool:
    dram = store.tiers["dram"]
    address = np.frombuffer(piece, dtype=np.uint8).ctypes.data
    for region in dram.published_regions(tenant):
        memory = dram._regions[region][1]
        if memory.base_address() <= address < memory.base_address() + memory.nbytes:
            return True
    return False


async def test_pieces_are_the_stored_pages_in_place_in_tensor_order(tmp_path, ns, spec):
    """Three blocks come back as their pages' K/V in published memory (no copy), cut and
    ordered so that, sent one after another, they are the canonical tensor of the prefix; a
    prefix with a miss in it ends there."""
    tokens, kv = random_tokens(48), random_kv(spec, 48)
    async with Store(_config(tmp_path)) as store:
        await store.put(ns, tokens, kv)
        pinned = await store.get_in_place(ns, tokens + random_tokens(16, seed=9))
        try:
            assert pinned.shape == tuple(kv.shape) and pinned.dtype == kv.dtype
            assert len(pinned.pieces) == 3 * spec.num_layers * 2
            assert pinned.nbytes == kv.numel() * kv.element_size()
            assert torch.equal(_joined(pinned.pieces, pinned.shape, pinned.dtype), kv)
            assert all(_inside_published(store, ns.tenant, piece) for piece in pinned.pieces)
        finally:
            pinned.release()
        assert store.stats().counters.gets == 1
        assert await store.get_in_place(ns, random_tokens(16, seed=10)) is None


async def test_the_blocks_stay_pinned_until_released(tmp_path, ns, spec):
    """While a sender holds the pages no eviction can take them (their memory could be lent
    again under the socket); once released they go as usual."""
    tokens, kv = random_tokens(32), random_kv(spec, 32)
    async with Store(_config(tmp_path)) as store:
        await store.put(ns, tokens, kv)
        pinned = await store.get_in_place(ns, tokens)
        assert await store.evict(model_id=ns.model_id) == 0
        assert torch.equal(_joined(pinned.pieces, pinned.shape, pinned.dtype), kv)
        pinned.release()
        assert await store.evict(model_id=ns.model_id) == 2


async def test_pages_that_are_not_raw_are_left_to_get(tmp_path, ns, spec):
    """fp8 pages must be decoded: get_in_place declines (None, nothing left pinned) and get
    serves them."""
    tokens, kv = random_tokens(32), random_kv(spec, 32)
    async with Store(_config(tmp_path, codec="fp8_e4m3")) as store:
        await store.put(ns, tokens, kv)
        assert await store.get_in_place(ns, tokens) is None
        assert await store.evict(model_id=ns.model_id) == 2  # nothing stayed pinned
        await store.put(ns, tokens, kv)
        got = await store.get(ns, tokens)
        assert ((got.float() - kv.float()).norm() / kv.float().norm()).item() < 0.1


def test_canonical_pieces_follow_the_layout_of_the_joined_tensor(spec):
    """For every layer and K/V, each block's run of tokens in block order: the bytes of
    torch.cat along the token axis."""
    blocks = [random_kv(spec, spec.block_tokens, seed=i) for i in range(3)]
    sections = [memoryview(b.view(-1).view(torch.uint8).numpy()) for b in blocks]
    pieces = canonical_pieces(sections, spec)
    joined = torch.cat(blocks, dim=2)
    assert torch.equal(_joined(pieces, joined.shape, joined.dtype), joined)
    one = canonical_pieces(sections[:1], dataclasses.replace(spec))
    assert len(one) == 1 and bytes(one[0]) == bytes(sections[0])

