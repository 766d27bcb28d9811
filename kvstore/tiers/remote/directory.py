"""The cluster directory: which host holds which block in its local tiers, in the shared store.

Layout: one hash per block and tenant, ``<prefix>:<tenant tag>:d:<block key hex>``, a field per
host: ``<incarnation>|<tiers>|<block index>|<model id>``; and one liveness key per host,
``<prefix>:h:<host>``, holding the host's incarnation (random per start) with a TTL the host
renews every third of ``host_ttl_s``. A reader believes a field only while that host's
liveness key exists and names the same incarnation, so a host that disappears (or restarts and
forgets what its memory held) takes all its entries with it within ``host_ttl_s``, without
anyone deleting them; the hashes themselves expire after ``ttl_s`` unless renewed.

Changes are queued without I/O (``note``) and written in one pipeline every
``directory_flush_s``; a flush that cannot reach the store is kept for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import RemoteConfig
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from kvstore.page import PageMeta
from kvstore.tiers.base import ClusterEntry
from kvstore.tiers.remote.link import RedisLink, result_ok, tenant_tag

log = logging.getLogger("kvstore.tiers.remote")
LIST_TIMEOUT_S = 10.0  # listing scans every node: an admin command, not a request path
SCAN_COUNT = 1000  # keys a SCAN step asks for


@dataclass(slots=True)
class _Local:
    meta: PageMeta
    tiers: list[str] = field(default_factory=list)  # fastest first, as the store placed them


class ClusterDirectory:
    """This host's entries in the shared directory, and reads of every live host's entries.

    Args:
        link: the remote tier's connection.
        config: key prefix, host id, TTLs and the flush interval.
    """

    def __init__(self, link: RedisLink, config: RemoteConfig) -> None:
        self._link = link
        self._config = config
        self.host = config.host_id or f"{socket.gethostname()}-{os.getpid()}"
        self._incarnation = secrets.token_hex(4)
        self._held: dict[BlockKey, _Local] = {}
        self._dirty: dict[BlockKey, PageMeta] = {}
        self._task: asyncio.Task[None] | None = None
        self._is_stopping = False
        self._flushes = 0

    def dir_key(self, key: BlockKey, tenant: str) -> str:
        return f"{self._config.key_prefix}:{tenant_tag(tenant)}:d:{key.hex()}"

    def host_key(self, host: str) -> str:
        return f"{self._config.key_prefix}:h:{host}"

    # ------------------------------------------------------------------------------ writes

    def note(self, meta: PageMeta, tier: str, is_held: bool) -> None:
        """Queue a change of what this host holds (no I/O)."""
        local = self._held.get(meta.key)
        if is_held:
            if local is None:
                local = self._held[meta.key] = _Local(meta)
            if tier not in local.tiers:
                local.tiers.append(tier)
        elif local is not None:
            if tier in local.tiers:
                local.tiers.remove(tier)
            if not local.tiers:
                del self._held[meta.key]
        self._dirty[meta.key] = meta

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop renewing; withdraw this host's entries at once (best effort)."""
        if self._task is None:
            return
        self._is_stopping = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        with contextlib.suppress(KVStoreError):
            await self._link.call("withdraw", lambda c: c.delete(self.host_key(self.host)))

    async def _run(self) -> None:
        beat_every = self._config.host_ttl_s / 3
        renew_every = self._config.ttl_s / 2
        next_beat = next_renew = time.monotonic()
        while not self._is_stopping:
            now = time.monotonic()
            try:
                if now >= next_beat and await self._beat():
                    next_beat = now + beat_every
                if now >= next_renew:  # rewrite every entry before its hash expires
                    self._dirty.update({k: local.meta for k, local in self._held.items()})
                    next_renew = now + renew_every
                await self.flush()
            except KVStoreError as exc:
                log.warning("cluster directory: %s", exc)
            await asyncio.sleep(self._config.directory_flush_s)

    async def _beat(self) -> bool:
        ttl_ms = int(self._config.host_ttl_s * 1000)
        name = self.host_key(self.host)
        return await self._link.call(
            "heartbeat", lambda c: c.set(name, self._incarnation, px=ttl_ms)) is not None

    async def flush(self) -> None:
        """Write the queued changes in one pipeline (kept for later if it fails)."""
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, {}
        ttl_ms = int(self._config.ttl_s * 1000)
        commands = []
        for key, meta in dirty.items():
            name = self.dir_key(key, meta.tenant)
            local = self._held.get(key)
            if local is None:
                commands.append(lambda p, n=name: p.hdel(n, self.host))
                continue
            value = f"{self._incarnation}|{','.join(local.tiers)}|{meta.block_index}|" \
                    f"{meta.model_id}"
            commands.append(lambda p, n=name, v=value: p.hset(n, self.host, v))
            commands.append(lambda p, n=name: p.pexpire(n, ttl_ms))
        results = await self._link.pipeline("directory", commands)
        if results is None:
            self._dirty = {**dirty, **self._dirty}
            return
        self._flushes += 1

    # ------------------------------------------------------------------------------ reads

    async def holders(self, keys: Sequence[BlockKey], tenant: str
                      ) -> list[dict[str, tuple[str, ...]]]:
        """For each of the first ``max_probe_keys`` keys, the live hosts other than this one
        that hold it: host -> tiers."""
        keys = keys[:self._config.max_probe_keys]
        if not keys:
            return []
        names = [self.dir_key(key, tenant) for key in keys]
        rows = await self._link.pipeline("directory", [lambda p, n=n: p.hgetall(n)
                                                       for n in names])
        if rows is None:
            return [{} for _ in keys]
        fields = [row if result_ok(row) else {} for row in rows]
        live = await self._live({h.decode() for row in fields for h in row} - {self.host})
        out = []
        for row in fields:
            held = {}
            for host_b, value in row.items():
                host = host_b.decode()
                parts = value.decode().split("|", 3)
                if host in live and live[host][0] == parts[0]:
                    held[host] = tuple(t for t in parts[1].split(",") if t)
            out.append(held)
        return out

    async def _live(self, hosts: set[str], timeout_s: float | None = None
                    ) -> dict[str, tuple[str, float]]:
        """Live hosts among ``hosts``: host -> (incarnation, seconds its entries still live)."""
        order = sorted(hosts)
        if not order:
            return {}
        commands: list[Any] = []
        for host in order:
            name = self.host_key(host)
            commands += [lambda p, n=name: p.get(n), lambda p, n=name: p.pttl(n)]
        results = await self._link.pipeline("directory", commands, timeout_s)
        if results is None:
            return {}
        live = {}
        for host, value, pttl in zip(order, results[::2], results[1::2]):
            if isinstance(value, bytes) and isinstance(pttl, int) and pttl > 0:
                live[host] = (value.decode(), pttl / 1000)
        return live

    async def entries(self, tenant: str, limit: int) -> list[ClusterEntry]:
        """What live hosts (this one included) hold of ``tenant``'s blocks."""
        await self.flush()
        pattern = f"{self._config.key_prefix}:{tenant_tag(tenant)}:d:*"

        async def scan(client: Any) -> list[bytes]:
            found = []
            async for name in client.scan_iter(match=pattern, count=SCAN_COUNT):
                found.append(name)
                if len(found) >= limit:
                    break
            return found

        names = await self._link.call("list", scan, LIST_TIMEOUT_S) or []
        rows = await self._link.pipeline("list", [lambda p, n=n: p.hgetall(n) for n in names],
                                         LIST_TIMEOUT_S) if names else []
        fields = [row if result_ok(row) else {} for row in rows or []]
        live = await self._live({h.decode() for row in fields for h in row}, LIST_TIMEOUT_S)
        out = []
        for name, row in zip(names, fields):
            key = BlockKey(bytes.fromhex(name.decode().rsplit(":", 1)[1]))
            for host_b, value in row.items():
                host = host_b.decode()
                incarnation, tiers, index, model = value.decode().split("|", 3)
                if host in live and live[host][0] == incarnation:
                    out.append(ClusterEntry(key, host, tuple(tiers.split(",")), int(index),
                                            model, live[host][1]))
        out.sort(key=lambda e: (e.host, e.model_id, e.block_index))
        return out[:limit]

    def stats(self) -> dict[str, float]:
        return {"directory_entries": len(self._held), "directory_pending": len(self._dirty),
                "directory_flushes": self._flushes}
