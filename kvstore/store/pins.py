"""TTL pins: a tenant's stored prefix kept in the cache until its time runs out, within a budget.

A pin is not a lease. A lease holds blocks for one read and ends within seconds; a pin keeps a
prefix an operator or engine names (a system prompt) for minutes or hours and survives a
restart. Both keep a block through the same path: ``BlockEntry.pins`` (the directory's
``is_protected``), so eviction orders never pick a pinned block, ``give_up`` leaves it, and an
operator's ordinary evict skips it.

What a pin keeps: every copy of its blocks, where they lie. A pinned block is neither dropped
nor demoted (a copy promoted while pinned is kept too), so a pinned prompt stays as fast as it
was when pinned; the budget bounds what that costs the tiers. Its bytes are those of its pages
in every tier holding it, counted when a new pin is checked against the budget.

Rules:
- ``pin`` covers the blocks of the prefix stored at that moment (a block stored later under
  the same prefix is ordinary). Pinning a prefix again sets its time anew; a pin of a longer
  prefix charges only the blocks not pinned yet.
- ``unpin(tokens)`` ends the tenant's pins of every prefix of ``tokens``; a block stays
  pinned while any pin covers it.
- A pin expires at its deadline (wall-clock, so it means the same after a restart); an
  invalidation that removes a pinned block ends every pin covering it (``forget``).
- Pins are saved to a 0600 JSON file in the persistent tier's directory after every change;
  ``load`` takes back those not expired, over the blocks still stored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.api import PinInfo
from kvstore.errors import CapacityError, InvalidArgument, shown
from kvstore.keys import BlockKey, Namespace
from kvstore.store.directory import BlockDirectory, BlockEntry

log = logging.getLogger("kvstore.pins")

MAX_PIN_TTL_S = 30 * 86400.0  # a month: past that a pin is configuration, not a cache hint
PINS_FILE = "pins.json"
FILE_VERSION = 1


@dataclass(slots=True)
class _Pin:
    tenant: str
    model_id: str
    entries: list[BlockEntry]  # the prefix's stored blocks, in order
    expires_at: float  # time.time() seconds

    @property
    def keys(self) -> list[BlockKey]:
        return [e.meta.key for e in self.entries]


@dataclass(slots=True)
class _Hold:
    entry: BlockEntry
    num_pins: int = 0  # pins covering the block


def entry_bytes(entry: BlockEntry) -> int:
    """What keeping ``entry`` costs: its pages in every tier holding it."""
    return sum(entry.sizes.values())


class PinTable:
    """The store's TTL pins (see the module doc). Used only from the store's event loop.

    Args:
        directory: the store's block directory (``pin`` / ``unpin`` of its entries).
        budget_bytes: bytes of pinned blocks one tenant may hold.
        path: the file pins are saved to; None: they live as long as the store.
    """

    def __init__(self, directory: BlockDirectory, budget_bytes: int, path: Path | None = None
                 ) -> None:
        self.directory = directory
        self.budget_bytes = budget_bytes
        self._file = None if path is None else StateFile(path)
        self._pins: dict[tuple[str, BlockKey], _Pin] = {}  # by (tenant, last block key)
        self._holds: dict[BlockKey, _Hold] = {}  # every pinned block
        self._changed = asyncio.Event()  # a pin was added or ended: new deadline, save
        self._dirty = False

    # ------------------------------------------------------------------------------ verbs

    def pin(self, ns: Namespace, keys: Sequence[BlockKey], ttl_s: float) -> PinInfo:
        """Pin the stored prefix of ``keys`` for ``ttl_s`` seconds. CapacityError naming the
        bytes asked, already pinned and the budget when it does not fit; nothing changes then."""
        if not (isinstance(ttl_s, int | float) and 0 < ttl_s <= MAX_PIN_TTL_S):
            raise InvalidArgument(f"ttl_s must be in (0, {MAX_PIN_TTL_S:g}] seconds, got "
                                  f"{ttl_s!r}")
        entries = [e for e in self.directory.match_prefix(keys) if e.meta.tenant == ns.tenant]
        return self.pin_entries(ns, entries, ttl_s)

    def pin_entries(self, ns: Namespace, entries: list[BlockEntry], ttl_s: float) -> PinInfo:
        """Pin ``entries`` (``ns``'s tenant's) as one pin named by the last one's key: a cache
        of groups pins every page its hit needs, whatever the group (``Store.pin``)."""
        if not (isinstance(ttl_s, int | float) and 0 < ttl_s <= MAX_PIN_TTL_S):
            raise InvalidArgument(f"ttl_s must be in (0, {MAX_PIN_TTL_S:g}] seconds, got "
                                  f"{ttl_s!r}")
        if not entries:
            return PinInfo(ns.tenant, ns.model_id, BlockKey(b""), 0, 0, 0.0)
        asked = sum(entry_bytes(e) for e in entries if e.meta.key not in self._holds)
        pinned = self.pinned_bytes(ns.tenant)
        if asked and pinned + asked > self.budget_bytes:
            raise CapacityError(
                f"pinning {len(entries)} blocks asks {asked} bytes more; tenant "
                f"{shown(ns.tenant)} has {pinned} bytes pinned of its {self.budget_bytes}-byte "
                "pin budget (quota.pin_bytes)")
        self._add(_Pin(ns.tenant, ns.model_id, entries, time.time() + ttl_s))
        return self._info(self._pins[(ns.tenant, entries[-1].meta.key)], time.time())

    def unpin(self, tenant: str, keys: Sequence[BlockKey]) -> int:
        """End ``tenant``'s pins of every prefix of ``keys``; return how many ended."""
        ended = [pin for key in keys if (pin := self._pins.get((tenant, key))) is not None]
        for pin in ended:
            self._remove(pin)
        return len(ended)

    def list(self, tenant: str | None = None) -> list[PinInfo]:
        """Pins of ``tenant`` (None: every tenant's), soonest to expire first."""
        now = time.time()
        pins = [p for p in self._pins.values() if tenant is None or p.tenant == tenant]
        return [self._info(p, now) for p in sorted(pins, key=lambda p: p.expires_at)]

    def pinned_bytes(self, tenant: str) -> int:
        """Bytes ``tenant``'s pinned blocks take now."""
        return sum(entry_bytes(h.entry) for h in self._holds.values()
                   if h.entry.meta.tenant == tenant)

    def forget(self, entries: Iterable[BlockEntry]) -> int:
        """End every pin covering one of ``entries`` (an invalidation is removing them)."""
        gone = {e.meta.key for e in entries if e.meta.key in self._holds}
        if not gone:
            return 0
        ended = [p for p in self._pins.values() if any(e.meta.key in gone for e in p.entries)]
        for pin in ended:
            self._remove(pin)
        return len(ended)

    def expire(self, now: float | None = None) -> int:
        """End the pins whose time ran out; return how many."""
        now = time.time() if now is None else now
        ended = [p for p in self._pins.values() if p.expires_at <= now]
        for pin in ended:
            log.info("pin of %d blocks of tenant %s expired", len(pin.entries), pin.tenant)
            self._remove(pin)
        return len(ended)

    # ------------------------------------------------------------------------------ background

    async def run(self) -> None:
        """Background: end pins at their deadlines and save the table after each change."""
        while True:
            if self._dirty:
                await self.save()
            deadline = min((p.expires_at for p in self._pins.values()), default=None)
            timeout = None if deadline is None else max(0.0, deadline - time.time())
            self._changed.clear()
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            except TimeoutError:
                self.expire()

    async def save(self) -> None:
        """Write the table to ``path`` (atomically: a reader sees the old file or the new)."""
        self._dirty = False
        if self._file is None:
            return
        records = [{"tenant": p.tenant, "model_id": p.model_id, "expires_at": p.expires_at,
                    "keys": [k.hex() for k in p.keys]} for p in self._pins.values()]
        data = json.dumps({"version": FILE_VERSION, "pins": records}).encode()
        await self._file.write(data)

    async def load(self) -> int:
        """Take back the saved pins not expired, over their blocks still stored (the prefix
        up to the first one gone); return how many. A file that cannot be read is logged and
        set aside: pins are a cache hint, never a reason not to start."""
        raw = None if self._file is None else await self._file.read()
        if raw is None:
            return 0
        try:
            data = json.loads(raw)
            records = data["pins"] if data.get("version") == FILE_VERSION else []
            now = time.time()
            for rec in records:
                keys = [BlockKey(bytes.fromhex(k)) for k in rec["keys"]]
                entries = [e for e in self.directory.match_prefix(keys)
                           if e.meta.tenant == rec["tenant"]]
                if entries and float(rec["expires_at"]) > now:
                    self._add(_Pin(str(rec["tenant"]), str(rec["model_id"]), entries,
                                   float(rec["expires_at"])))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("pins in %s not restored: %s", self._file.path, exc)
        self._dirty = True  # the file then says what was taken back
        return len(self._pins)

    # ------------------------------------------------------------------------------ internals

    def _add(self, pin: _Pin) -> None:
        old = self._pins.pop((pin.tenant, pin.entries[-1].meta.key), None)
        if old is not None:
            self._release(old)
        self._pins[(pin.tenant, pin.entries[-1].meta.key)] = pin
        for entry in pin.entries:
            hold = self._holds.get(entry.meta.key)
            if hold is None:
                hold = self._holds[entry.meta.key] = _Hold(entry)
                self.directory.pin([entry])
            elif hold.entry is not entry:  # the block was stored again since: keep the new one
                self.directory.unpin([hold.entry])
                self.directory.pin([entry])
                hold.entry = entry
            hold.num_pins += 1
        self._note_change()

    def _remove(self, pin: _Pin) -> None:
        if self._pins.get((pin.tenant, pin.entries[-1].meta.key)) is pin:
            del self._pins[(pin.tenant, pin.entries[-1].meta.key)]
            self._release(pin)
            self._note_change()

    def _release(self, pin: _Pin) -> None:
        for entry in pin.entries:
            hold = self._holds[entry.meta.key]
            hold.num_pins -= 1
            if hold.num_pins == 0:
                del self._holds[entry.meta.key]
                self.directory.unpin([hold.entry])

    def _note_change(self) -> None:
        self._dirty = True
        self._changed.set()

    def _info(self, pin: _Pin, now: float) -> PinInfo:
        return PinInfo(pin.tenant, pin.model_id, pin.entries[-1].meta.key, len(pin.entries),
                       sum(entry_bytes(e) for e in pin.entries),
                       max(0.0, pin.expires_at - now))


class StateFile:
    """A small file the store rewrites whole, 0600, atomically (a reader sees the old content
    or the new), newest snapshot last: a write still running on a thread after its task was
    cancelled never overwrites a later one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._taken = 0  # snapshots numbered on the loop, in the order taken
        self._written = 0

    async def write(self, data: bytes) -> None:
        self._taken += 1
        await asyncio.to_thread(self._write, data, self._taken)

    def _write(self, data: bytes, number: int) -> None:
        with self._lock:
            if number <= self._written:
                return
            tmp = self.path.with_name(self.path.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # whatever the umask or an older file left
            with open(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
            self._written = number

    async def read(self) -> bytes | None:
        """The file's content, or None if there is none."""
        try:
            return await asyncio.to_thread(self.path.read_bytes)
        except FileNotFoundError:
            return None
