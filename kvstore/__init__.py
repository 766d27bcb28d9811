"""kvstore: a tiered KV-cache store for LLM serving (HBM, DRAM, SSD, Redis/Valkey).

The light names (keys, specs, errors) import at once; ``Store``, ``KVStoreConfig``, ``Client``
and ``AsyncClient`` load on first use, so ``import kvstore.client`` never pulls in the store,
its tiers or their libraries.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey, Namespace, block_keys
from kvstore.spec import KVSpec

if TYPE_CHECKING:
    from kvstore.client import AsyncClient, Client
    from kvstore.config import KVStoreConfig
    from kvstore.store import Store

__version__ = "0.1.0"

_LAZY = {"Store": "kvstore.store", "KVStoreConfig": "kvstore.config",
         "Client": "kvstore.client", "AsyncClient": "kvstore.client"}

__all__ = ["AsyncClient", "BlockKey", "Client", "KVSpec", "KVStoreConfig", "KVStoreError",
           "Namespace", "Store", "__version__", "block_keys"]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
