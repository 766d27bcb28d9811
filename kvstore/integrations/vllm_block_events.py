"""The vLLM connector's KV events: a ``BlockStored`` (medium ``kvstore``) for each range of
blocks whose put landed, under vLLM's own block hashes, through vLLM's event path.

The scheduler side knows vLLM's hashes of the blocks it plans to save (``StoredBlocks``, sent
with the save); the worker side knows which puts landed, and reports their events from
``get_kv_connector_kv_cache_events``; vLLM hands every worker's report to the scheduler side's
``update_connector_output``, and ``take_events`` yields those every worker reported (each
rank's shard landed: ``KVEventAggregator``), which vLLM publishes with its own prefix-cache
events (``kv_events_config``). A save that fails or is dropped reports nothing. Routers that
read kvstore's daemon directly get its events per tier instead (``kvstore.server.kv_events``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

MEDIUM = "kvstore"


@dataclass(slots=True)
class StoredBlocks:
    """vLLM's view of blocks ``first .. first + len(hashes)`` of a request, planned to be
    saved: their hashes, the hash before them, their token ids and the LoRA adapter."""

    first: int
    hashes: list[Any]
    parent: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None

    @classmethod
    def of(cls, request: Any, first: int, end: int, block_size: int) -> StoredBlocks | None:
        """Blocks ``first .. end`` of ``request``; None where vLLM has not hashed them (no
        prefix caching, or a request without a block hasher)."""
        hashes = getattr(request, "block_hashes", None) or []
        if len(hashes) < end or end <= first:
            return None
        lora = request.lora_request
        return cls(first, [maybe_convert_block_hash(h) for h in hashes[first:end]],
                   maybe_convert_block_hash(hashes[first - 1]) if first else None,
                   list(request.all_token_ids[first * block_size:end * block_size]),
                   block_size, lora.adapter_id if lora else None, lora.name if lora else None)

    def event(self, lo: int, hi: int) -> BlockStored | None:
        """The event of blocks ``lo .. hi`` (request block indices) of these, or None where
        they hold none of them."""
        lo, hi = max(lo, self.first), min(hi, self.first + len(self.hashes))
        if hi <= lo:
            return None
        a, b = lo - self.first, hi - self.first
        bs = self.block_size
        return BlockStored(block_hashes=self.hashes[a:b],
                           parent_block_hash=self.hashes[a - 1] if a else self.parent,
                           token_ids=self.token_ids[a * bs:b * bs], block_size=bs,
                           lora_id=self.lora_id, medium=MEDIUM, lora_name=self.lora_name)


class KVStoreKVEvents(KVConnectorKVEvents):
    """Events of one or more workers, kept once all of them reported each."""

    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> KVStoreKVEvents:
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()
