"""The remote tier: encoded pages in a Redis or Valkey server or cluster that several hosts share.

Keys: ``<prefix>:<tenant tag>:p:<block key hex>``, the tag a 64-bit hash of the tenant, so one
tenant's pages are one key pattern (a Redis ACL ``~<prefix>:<tag>:*`` can confine a tenant's
credentials to it) and no call made for one tenant names another's keys. There is no hash tag:
the block key spreads pages evenly over a cluster's slots, and no command names two keys, so
nothing crosses slots. A batch is one pipeline; a cluster pipeline sends each node its commands
in one round trip, all nodes at once.

A page is one ``SET ... PX <ttl> NX`` of the whole encoded page: Redis applies a command whole
or not at all, so a put cut off by a failure leaves no half page, and every read verifies the
page anyway (checksum, key, tenant, namespace fingerprint) before anything is served.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.config import RemoteConfig
from kvstore.errors import CorruptPage
from kvstore.keys import BlockKey
from kvstore.page import Page, PageMeta, decode_page, parse_page
from kvstore.room import Footprint, RoomNeed
from kvstore.tiers.base import ClusterEntry, SharedTier, TierStats
from kvstore.tiers.remote.directory import ClusterDirectory
from kvstore.tiers.remote.link import RedisLink, result_ok, tenant_tag

# Redis refuses bulk strings above proto-max-bulk-len, 512 MB by default.
MAX_VALUE_BYTES = 512 << 20
# Verifying (xxh3, ~28 GB/s on the 2-core box, ~7 GB/s a core on an H200 host) a batch larger
# than this goes to a thread, so a 64-page read never holds the event loop for milliseconds.
THREAD_VERIFY_BYTES = 8 << 20
_ASSUMED_PAGE_BYTES = 2 << 20  # reads are split into pipelines by count until a page is seen


@dataclass(slots=True)
class _Held:
    """A page this host wrote: what it is charged, until when it lives."""

    meta: PageMeta
    nbytes: int
    expires_at: float  # time.monotonic()


class RemoteTier(SharedTier):
    """Pages in a shared Redis/Valkey store, within a byte budget of what this host wrote.

    Args:
        config: url, codec, ttl, budget, time bounds, breaker and directory settings.
        name: the tier's name in the chain.
    """

    def __init__(self, config: RemoteConfig, name: str = "remote") -> None:
        self.name = name
        self._config = config
        self._link = RedisLink(config)
        self._directory = ClusterDirectory(self._link, config) if config.directory else None
        self._held: OrderedDict[BlockKey, _Held] = OrderedDict()  # oldest (first to expire) first
        self._used_bytes = 0
        self._page_bytes = _ASSUMED_PAGE_BYTES
        self._counts = dict.fromkeys(("hits", "misses", "corrupt", "rejected", "bytes_read",
                                      "bytes_written", "probes", "probe_hits"), 0)

    # ------------------------------------------------------------------------------ keys

    def page_key(self, key: BlockKey, tenant: str) -> str:
        return f"{self._config.key_prefix}:{tenant_tag(tenant)}:p:{key.hex()}"

    # ------------------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        await self._link.open()
        if self._directory is not None:
            self._directory.start()

    async def close(self) -> None:
        if self._directory is not None:
            await self._directory.stop()
        await self._link.aclose()

    # ------------------------------------------------------------------------------ budget

    @property
    def capacity_bytes(self) -> int:
        return self._config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        self._expire()
        return self._used_bytes

    @property
    def max_page_bytes(self) -> int:
        return min(self._config.capacity_bytes, MAX_VALUE_BYTES)

    @property
    def write_batch_bytes(self) -> int:
        return self._config.pipeline_bytes

    def contains(self, key: BlockKey) -> bool:
        self._expire()
        return key in self._held

    def room_for(self, nbytes: int) -> RoomNeed | None:
        over = self.used_bytes + nbytes - self.capacity_bytes
        return None if over <= 0 else RoomNeed(over)

    def footprint(self, key: BlockKey) -> Footprint | None:
        held = self._held.get(key)
        return None if held is None else Footprint(size_class=0, nbytes=held.nbytes)

    def page_size(self, key: BlockKey) -> int | None:
        held = self._held.get(key)
        return None if held is None else held.nbytes

    def entries(self) -> Iterator[PageMeta]:
        self._expire()
        return iter([held.meta for held in self._held.values()])

    def _expire(self) -> None:
        now = time.monotonic()
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.expires_at > now:
                return
            self._forget(key)

    def _forget(self, key: BlockKey) -> _Held | None:
        held = self._held.pop(key, None)
        if held is not None:
            self._used_bytes -= held.nbytes
        return held

    # ------------------------------------------------------------------------------ writes

    async def write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta) -> bool:
        return (await self.write_many([(meta, page)]))[0]

    async def write_many(self, pages: Sequence[tuple[PageMeta, bytes | memoryview]]
                         ) -> list[bool]:
        """``SET key page PX ttl NX`` for each page not held already, in pipelines of about
        ``pipeline_bytes``. A page over the budget's room is refused (``room_for`` says what to
        free first); a page that exists already (another host wrote it) counts as stored."""
        out = [False] * len(pages)
        todo: list[int] = []
        room = self.capacity_bytes - self.used_bytes
        for i, (meta, page) in enumerate(pages):
            if meta.key in self._held:
                out[i] = True
            elif len(page) > room or len(page) > self.max_page_bytes:
                self._counts["rejected"] += 1
            else:
                room -= len(page)
                todo.append(i)
        ttl_ms = int(self._config.ttl_s * 1000)
        for batch in self._batches(todo, lambda i: len(pages[i][1])):
            commands = [self._set(self.page_key(pages[i][0].key, pages[i][0].tenant),
                                  pages[i][1], ttl_ms) for i in batch]
            started = time.monotonic()
            results = await self._link.pipeline("write", commands, self._bound(batch, pages))
            for i, result in zip(batch, results or [None] * len(batch)):
                meta, page = pages[i]
                if results is None or not result_ok(result):
                    self._counts["rejected"] += 1
                    continue
                self._held[meta.key] = _Held(meta, len(page), started + self._config.ttl_s)
                self._used_bytes += len(page)
                self._counts["bytes_written"] += len(page) if result else 0
                out[i] = True
        return out

    @staticmethod
    def _set(name: str, page: bytes | memoryview, ttl_ms: int):
        return lambda pipe: pipe.set(name, page, px=ttl_ms, nx=True)

    # ------------------------------------------------------------------------------ reads

    async def read(self, key: BlockKey, *, verify: bool = True) -> Page | None:
        """A page this host wrote (see ``read_many`` for pages other hosts wrote)."""
        held = self._held.get(key)
        if held is None:
            self._counts["misses"] += 1
            return None
        if verify:
            return (await self.read_many([key], held.meta.tenant, held.meta.namespace))[0]
        name = self.page_key(key, held.meta.tenant)
        data = await self._link.call("read", lambda client: client.get(name))
        if data is None:  # expired, deleted by another host, or unreachable
            self._counts["misses"] += 1
            self._forget(key)
            return None
        try:
            page = parse_page(data, expected_key=key)
        except CorruptPage:  # a damaged header: judged as in a verified read
            await self._drop_corrupt(name, key)
            return None
        self._counts["hits"] += 1
        self._counts["bytes_read"] += len(data)
        return page

    async def read_many(self, keys: Sequence[BlockKey], tenant: str, namespace: bytes
                        ) -> list[Page | None]:
        """GET each key (pipelines of about ``pipeline_bytes``) and verify each page."""
        out: list[Page | None] = [None] * len(keys)
        names = [self.page_key(key, tenant) for key in keys]
        per_batch = max(1, self._config.pipeline_bytes // self._page_bytes)
        for start in range(0, len(keys), per_batch):
            batch = range(start, min(start + per_batch, len(keys)))
            commands = [self._get(names[i]) for i in batch]
            results = await self._link.pipeline("read", commands,
                                                self._config.timeout_s * max(1, len(batch) / 8))
            raw = [r if isinstance(r, bytes) else None for r in results or [None] * len(batch)]
            nbytes = sum(len(r) for r in raw if r is not None)
            if nbytes > THREAD_VERIFY_BYTES:
                checked = await asyncio.to_thread(self._verify_all, keys, batch, raw, tenant,
                                                  namespace)
            else:
                checked = self._verify_all(keys, batch, raw, tenant, namespace)
            for i, (page, fault) in zip(batch, checked):
                out[i] = page
                if fault:
                    await self._drop_corrupt(names[i], keys[i])
                elif page is None:
                    self._counts["misses"] += 1
                    self._forget(keys[i])
                else:
                    self._counts["hits"] += 1
                    self._counts["bytes_read"] += len(page.data)
                    self._page_bytes = max(self._page_bytes // 2, len(page.data))
            if any(page is None for page in out[batch.start:batch.stop]):
                break  # the prefix ends here: later pages would not be used
        return out

    @staticmethod
    def _get(name: str):
        return lambda pipe: pipe.get(name)

    @staticmethod
    def _verify_all(keys: Sequence[BlockKey], batch: range, raw: list[bytes | None],
                    tenant: str, namespace: bytes) -> list[tuple[Page | None, bool]]:
        """Each page verified, or None with whether it was there but failed (pure: may run
        on a thread)."""
        checked: list[tuple[Page | None, bool]] = []
        for i, data in zip(batch, raw):
            if data is None:
                checked.append((None, False))
                continue
            try:
                page = decode_page(data, expected_key=keys[i])
                if page.meta.tenant != tenant or page.meta.namespace != namespace:
                    raise CorruptPage(f"page {keys[i].hex()} belongs to another namespace")
            except CorruptPage:
                checked.append((None, True))
                continue
            checked.append((page, False))
        return checked

    async def _drop_corrupt(self, name: str, key: BlockKey) -> None:
        """A page failed verification: count it, delete it (it would fail every host)."""
        self._counts["corrupt"] += 1
        self._forget(key)
        await self._link.call("delete", lambda c: c.delete(name))

    async def exists_prefix(self, keys: Sequence[BlockKey], tenant: str) -> int:
        """Pipelined EXISTS of at most ``max_probe_keys`` keys: how many lead in a row."""
        keys = keys[:self._config.max_probe_keys]
        if not keys:
            return 0
        self._counts["probes"] += 1
        base = self.page_key(BlockKey(b""), tenant)  # the tenant's prefix, computed once
        commands = [self._exists(base + key.hex()) for key in keys]
        results = await self._link.pipeline("probe", commands)
        count = 0
        for result in results or ():
            if result != 1:
                break
            count += 1
        self._counts["probe_hits"] += count
        return count

    @staticmethod
    def _exists(name: str):
        return lambda pipe: pipe.exists(name)

    async def delete(self, key: BlockKey) -> bool:
        held = self._forget(key)
        if held is None:
            return False
        await self._link.call("delete", lambda c: c.delete(self.page_key(key, held.meta.tenant)))
        return True

    # ------------------------------------------------------------------------------ batching

    def _batches(self, todo: list[int], size: Any) -> Iterator[list[int]]:
        batch, nbytes = [], 0
        for i in todo:
            if batch and nbytes + size(i) > self._config.pipeline_bytes:
                yield batch
                batch, nbytes = [], 0
            batch.append(i)
            nbytes += size(i)
        if batch:
            yield batch

    def _bound(self, batch: list[int], pages: Sequence[tuple[PageMeta, Any]]) -> float:
        """A batch's time bound: ``timeout_s`` per 8 pages of 2 MiB (16 MiB at 1 GB/s is
        16 ms, so the bound only bites on a store that has stopped answering)."""
        nbytes = sum(len(pages[i][1]) for i in batch)
        return self._config.timeout_s * max(1.0, nbytes / (16 << 20))

    # ------------------------------------------------------------------------------ directory

    def note_local(self, meta: PageMeta, tier: str, is_held: bool) -> None:
        if self._directory is not None:
            self._directory.note(meta, tier, is_held)

    async def holders(self, keys: Sequence[BlockKey], tenant: str
                      ) -> list[dict[str, tuple[str, ...]]]:
        if self._directory is None:
            return [{} for _ in keys]
        return await self._directory.holders(keys, tenant)

    async def cluster_entries(self, tenant: str, limit: int) -> list[ClusterEntry]:
        if self._directory is None:
            return []
        return await self._directory.entries(tenant, limit)

    # ------------------------------------------------------------------------------ health

    def health(self) -> str:
        link = self._link
        if link.is_available:
            return ""
        state = "breaker open" if link.breaker_open else "failing"
        return f"{self._config.safe_url} {state}: {link.last_error}"

    def stats(self) -> TierStats:
        c, link = self._counts, self._link
        return TierStats(
            name=self.name, capacity_bytes=self.capacity_bytes, used_bytes=self.used_bytes,
            num_blocks=len(self._held), hits=c["hits"], misses=c["misses"],
            corrupt=c["corrupt"], rejected=c["rejected"], bytes_read=c["bytes_read"],
            bytes_written=c["bytes_written"],
            extra={"available": float(link.is_available),
                   "breaker_open": float(link.breaker_open),
                   "cluster": float(link.is_cluster), "errors": link.counts["errors"],
                   "timeouts": link.counts["timeouts"],
                   "short_circuits": link.counts["short_circuits"], "probes": c["probes"],
                   "probe_hits": c["probe_hits"],
                   **(self._directory.stats() if self._directory is not None else {})})
