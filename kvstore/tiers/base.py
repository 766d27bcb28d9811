"""The Tier contract: where encoded pages live (HBM, DRAM, SSD, remote).

A tier stores whole encoded pages (``kvstore.page``) by ``BlockKey``. It knows nothing about
prefixes, namespaces or policy: the store (``kvstore.store``) decides what goes where, and a tier
only admits, holds, returns and forgets pages within its capacity.

Threading: every method is called from the store's event loop. Async methods may await file or
device I/O (through threads); sync methods must return quickly and never block on I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from kvstore.api import TierStats
from kvstore.keys import BlockKey
from kvstore.page import Page, PageMeta


class Tier(ABC):
    """One storage tier. Implementations own their memory or files and their counters.

    Contract:
    - ``write`` stores a complete encoded page under ``key`` or returns False (not admitted,
      no room); it never leaves a partial page readable. Writing a key already present is a
      no-op that returns True.
    - ``read`` returns the verified, parsed page, or None on a miss. A page that fails
      verification is removed, counted in ``stats().corrupt`` and reported as a miss: a tier
      never returns bytes that fail their checksum.
    - ``read(key, verify=False)`` returns the page parsed but with its checksum unchecked, so a
      caller can verify it where it uses it (``kvstore.page.verify_page`` on a worker thread,
      just before decoding it while it is in cache). Such a caller must not use or pass on a
      byte before ``verify_page`` accepted the page; when it refuses, the caller reads the key
      again with ``verify=True``, and the tier's own check removes and counts the page (a tier
      is the only judge of its pages: a caller never deletes one for being corrupt). A header
      or meta that does not parse is handled as in a verified read.
    - ``delete`` forgets a key (idempotent). ``close`` flushes what must persist.
    - ``used_bytes`` never exceeds ``capacity_bytes``.
    """

    name: str = "tier"

    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """Configured bound on stored bytes."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes currently charged against capacity (slot or segment space)."""

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is stored (no I/O)."""

    @abstractmethod
    def can_write(self, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits now without evicting anything."""

    @abstractmethod
    async def write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta) -> bool:
        """Store an encoded page; True if stored (or already present)."""

    @abstractmethod
    async def read(self, key: BlockKey, *, verify: bool = True) -> Page | None:
        """The verified page for ``key`` (``kvstore.page.decode_page``), or None (miss or
        corrupt); with ``verify=False`` the parsed page whose checksum the caller checks (see
        the class docstring). The payload may be a view into tier memory: it stays valid until
        the key is deleted, and the store never deletes a block while a reader holds it."""

    @abstractmethod
    async def delete(self, key: BlockKey) -> bool:
        """Forget ``key``; True if it was stored."""

    @abstractmethod
    def entries(self) -> Iterator[PageMeta]:
        """Meta of every stored page (for rebuilding the directory after a restart)."""

    @abstractmethod
    def page_size(self, key: BlockKey) -> int | None:
        """Bytes of the stored page for ``key`` (no I/O), or None if absent."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of this tier's counters."""

    async def open(self) -> None:
        """Acquire files, memory and indexes. Called once before use."""

    async def close(self) -> None:
        """Flush what must persist and release resources."""
