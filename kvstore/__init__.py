"""kvstore: a tiered KV-cache store for LLM serving (HBM, DRAM, SSD, Redis/Valkey)."""

from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey, Namespace, block_keys
from kvstore.spec import KVSpec

__version__ = "0.1.0"

__all__ = ["BlockKey", "KVSpec", "KVStoreError", "Namespace", "__version__", "block_keys"]
