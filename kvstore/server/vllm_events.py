"""vLLM's KV-event classes, as msgspec structs encoding to the same msgpack, and the encoder
that turns the hub's runs of block events into a ``KVEventBatch`` payload.

The classes follow ``vllm/distributed/kv_events.py`` field for field and in the same order
(the encoding is positional): ``EventBatch`` is ``array_like``; each event is an
``array_like`` struct with ``tag=True``, so it goes on the wire as ``[class name, fields...]``;
``omit_defaults`` drops trailing fields left at their defaults, as vLLM's do. Only vLLM's
fields that have no default are sent (through ``lora_name``), which every consumer of any vLLM
version decodes. Needs msgspec (the ``events`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvstore.config import EventsConfig
from kvstore.server.event_runs import EventRun, run_tokens
from kvstore.store.events import EventKind

ExternalBlockHash = bytes | int  # vLLM's name: an int, or the hash's bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of the tagged union: the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def run_to_vllm(run: EventRun, to_hash: Callable[[bytes], ExternalBlockHash]) -> KVCacheEvent:
    """One run of block events as vLLM's event."""
    first = run.first
    if first.kind is EventKind.CLEARED:
        return AllBlocksCleared()
    hashes = [to_hash(key) for key in run.keys]
    if first.kind is EventKind.REMOVED:
        return BlockRemoved(block_hashes=hashes, medium=first.medium)
    tokens = run_tokens(run)
    # Without tokens, block_size 0, as vLLM's placeholder events for blocks it moved: what a
    # consumer may check, len(token_ids) == len(block_hashes) * block_size, always holds.
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if first.parent is None else to_hash(first.parent),
        token_ids=[] if tokens is None else tokens.tolist(),
        block_size=0 if tokens is None else first.block_tokens,
        lora_id=None, medium=first.medium, lora_name=None)


class BatchEncoder:
    """Encodes runs of block events as one ``KVEventBatch`` msgpack payload."""

    def __init__(self, config: EventsConfig, to_hash: Callable[[bytes], ExternalBlockHash]
                 ) -> None:
        self._rank = config.data_parallel_rank
        self._to_hash = to_hash
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, runs: Sequence[EventRun]) -> bytes:
        events = [run_to_vllm(run, self._to_hash) for run in runs]
        return self._encoder.encode(KVEventBatch(ts=ts, events=events,
                                                 data_parallel_rank=self._rank))
