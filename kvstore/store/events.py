"""The store's KV events: a bounded queue of what each tier gained or lost, for a publisher.

Every time the directory records that a tier stored or dropped a block (``BlockDirectory``'s
observer: ``place``/``unplace``, which every write, demotion, promotion, eviction and restore
goes through) the sink queues a ``BlockEvent``. A put tells the sink the tokens of the blocks
it writes first (``expect``), so those blocks' stored events carry their token ids; a block
that moves between tiers later is known by its key alone and its event carries none (as
vLLM's offloading connector sends for blocks it moves to CPU). The sink never blocks and never
grows past its bound: when the queue is full an event is dropped and counted.

The store knows nothing of who reads these: the server's publisher (``server/kv_events.py``)
drains the queue on the store's event loop when the sink says it is no longer empty.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.keys import BlockKey, Namespace
from kvstore.page import PageMeta

# What each tier kind's blocks are called in events: vLLM's media (MEDIUM_GPU, MEDIUM_CPU,
# MEDIUM_STORAGE in vllm/distributed/kv_events.py) where it has one.
KIND_MEDIA = {"hbm": "GPU", "dram": "CPU", "ssd": "STORAGE", "remote": "REMOTE"}

# Keys whose tokens the sink holds for puts and reservations in progress: a reservation that
# expires unused is never forgotten one by one, so past this the sink forgets them all (later
# stored events of those blocks then carry no tokens; nothing else changes).
MAX_EXPECTED_KEYS = 1 << 18

# Namespaces whose block size the sink remembers (one per model and tenant in use; cleared
# whole past this, then learned again from the next puts).
MAX_KNOWN_NAMESPACES = 4096


class EventKind(enum.Enum):
    STORED = "stored"  # a tier now holds the block
    REMOVED = "removed"  # a tier no longer holds it
    CLEARED = "cleared"  # the store holds no blocks at all any more


# Not frozen: one is made per block a tier gains or loses, on the store's loop, and a frozen
# dataclass's __init__ (object.__setattr__ per field) made that 7 us of a put's time per block
# (2-core box, 2026-12-05; 2048-block puts). Treat it as a value all the same.
@dataclass(slots=True)
class BlockEvent:
    """One tier gained or lost one block (or, CLEARED, the store was emptied)."""

    kind: EventKind
    tier: str  # the chain's name of the tier ("" for CLEARED)
    medium: str  # what routers call that tier's memory: "GPU", "CPU", "STORAGE", ...
    meta: PageMeta | None  # the block's (its key, parent, namespace, tenant); None: CLEARED
    block_tokens: int = 0  # tokens per block of its namespace (0: not known here)
    # The block's token ids, where the store has them (a put): tokens[token_start:][:block_tokens]
    tokens: np.ndarray | None = None
    token_start: int = 0

    @property
    def key(self) -> BlockKey | None:
        return None if self.meta is None else self.meta.key

    @property
    def parent(self) -> BlockKey | None:
        return None if self.meta is None else self.meta.parent

    @property
    def tenant(self) -> str | None:
        """The block's tenant; None: every tenant's (CLEARED)."""
        return None if self.meta is None else self.meta.tenant

    @property
    def namespace(self) -> bytes:
        return b"" if self.meta is None else self.meta.namespace


class EventSink:
    """The bounded queue of the store's events.

    Args:
        media: tier name -> medium its events name.
        capacity: events queued at most; more are dropped and counted (``num_dropped``).
    """

    def __init__(self, media: Mapping[str, str], capacity: int) -> None:
        self._media = dict(media)
        self._queue: deque[BlockEvent] = deque()
        self._capacity = capacity
        self._listener: Callable[[], None] | None = None
        # key -> (the put's token array, the block's first token, tokens per block)
        self._expected: dict[BlockKey, tuple[np.ndarray, int, int]] = {}
        self._block_tokens: dict[bytes, int] = {}  # namespace fingerprint -> tokens per block
        self.num_events = 0  # queued since start
        self.num_dropped = 0  # dropped because the queue was full

    def set_listener(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener()`` (on the store's loop, from inside the store's own calls: it must
        only schedule work) whenever an event lands in an empty queue."""
        self._listener = listener

    def __len__(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------------- the store's side

    def expect(self, ns: Namespace, keys: Sequence[BlockKey], tokens: np.ndarray) -> None:
        """A put or reservation is about to write the blocks of ``keys`` (``tokens``: the
        prompt's token ids): their stored events carry their tokens until ``forget``."""
        bt = ns.spec.block_tokens
        self._learn(ns.fingerprint, bt)
        if len(self._expected) + len(keys) > MAX_EXPECTED_KEYS:
            self._expected.clear()
        for i, key in enumerate(keys):
            self._expected[key] = (tokens, i * bt, bt)

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """The put or reservation that ``expect``-ed ``keys`` is over. (Two puts of one key carry the same
        tokens, so either one's entry serves both while it lasts.)"""
        for key in keys:
            self._expected.pop(key, None)

    def observe(self, meta: PageMeta, tier: str, is_held: bool) -> None:
        """The directory's observer: ``tier`` now holds (``is_held``) or no longer holds the
        block of ``meta``."""
        expected = self._expected.get(meta.key) if is_held else None
        kind = EventKind.STORED if is_held else EventKind.REMOVED
        medium = self._media.get(tier) or tier.upper()
        if expected is None:
            self._push(BlockEvent(kind, tier, medium, meta,
                                  self._block_tokens.get(meta.namespace, 0)))
        else:
            array, start, bt = expected
            self._push(BlockEvent(kind, tier, medium, meta, bt, array, start))

    def cleared(self) -> None:
        """The store was emptied (an evict of everything left no block in any tier)."""
        self._push(BlockEvent(EventKind.CLEARED, "", "", None))

    # --------------------------------------------------------------------- the publisher's side

    def drain(self, limit: int | None = None) -> list[BlockEvent]:
        """Take up to ``limit`` (default: all) queued events, oldest first."""
        queue = self._queue
        count = len(queue) if limit is None else min(limit, len(queue))
        return [queue.popleft() for _ in range(count)]

    # ------------------------------------------------------------------------------ internals

    def _learn(self, namespace: bytes, block_tokens: int) -> None:
        if namespace not in self._block_tokens:
            if len(self._block_tokens) >= MAX_KNOWN_NAMESPACES:
                self._block_tokens.clear()
            self._block_tokens[namespace] = block_tokens

    def _push(self, event: BlockEvent) -> None:
        if len(self._queue) >= self._capacity:
            self.num_dropped += 1
            return
        was_empty = not self._queue
        self._queue.append(event)
        self.num_events += 1
        if was_empty and self._listener is not None:
            self._listener()


def tier_media(chain: Sequence[tuple[str, str]], overrides: Mapping[str, str]) -> dict[str, str]:
    """Tier name -> medium for a chain of (name, kind): the kind's unless ``overrides`` names
    the tier."""
    return {name: overrides.get(name, KIND_MEDIA.get(kind, name.upper()))
            for name, kind in chain}
