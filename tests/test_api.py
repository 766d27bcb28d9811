"""The engine-facing surface: top-level names, torch dtypes in specs, the lookup advice."""

from __future__ import annotations

import torch

import kvstore
from kvstore.api import LookupResult, TierStats
from kvstore.keys import BlockKey
from kvstore.spec import KVSpec


def test_top_level_names_import() -> None:
    from kvstore import AsyncClient, Client, KVSpec, KVStoreConfig, Namespace, Store

    assert Store.__module__.startswith("kvstore.store")
    assert KVStoreConfig().dram.capacity_bytes > 0
    assert {Client.__name__, AsyncClient.__name__, Namespace.__name__, KVSpec.__name__} == {
        "Client", "AsyncClient", "Namespace", "KVSpec"}


def test_unknown_top_level_name_is_an_attribute_error() -> None:
    try:
        kvstore.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("kvstore.NoSuchThing resolved")


def test_spec_takes_torch_dtypes() -> None:
    """Engines hand their cache's torch dtype; a spec built from it equals the named one."""
    by_dtype = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_tokens=16,
                      dtype=torch.float16)
    by_name = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_tokens=16, dtype="float16")
    assert by_dtype == by_name and by_dtype.torch_dtype is torch.float16


def test_lookup_advice_defaults_to_the_whole_match() -> None:
    keys = (BlockKey(bytes(16)),)
    plain = LookupResult(num_tokens=40, matched_tokens=32, tokens_per_tier={"dram": 32},
                         keys=keys)
    advised = LookupResult(num_tokens=40, matched_tokens=32, tokens_per_tier={"dram": 32},
                           keys=keys, advised_tokens=16)
    assert plain.tokens_to_fetch == 32 and advised.tokens_to_fetch == 16


def test_tier_stats_dict_flattens_extra_gauges() -> None:
    stats = TierStats(name="dram", capacity_bytes=10, extra={"arena_bytes": 4.0})
    assert stats.as_dict()["arena_bytes"] == 4.0 and stats.as_dict()["name"] == "dram"
