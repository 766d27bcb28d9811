"""The SSD tier's LMDB index: the record kept per page and the journal committed in batches."""

from __future__ import annotations

import asyncio
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import CapacityError, KVStoreError
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.page import PageMeta
from kvstore.tiers.segments import PRIVATE_FILE_MODE, aligned, private_directory

_RECORD = struct.Struct("<BIQIIHQ16s16s")  # version, segment, offset, length, block, codec, xxh3
_RECORD_VERSION = 1
_NO_PARENT = bytes(KEY_BYTES)


@dataclass(slots=True)
class IndexRecord:
    """Where a committed page lives, and its meta (for rebuilding the store's directory)."""

    meta: PageMeta
    segment_id: int
    offset: int
    length: int
    checksum: int

    @property
    def padded(self) -> int:
        return aligned(self.length)

    def pack(self) -> bytes:
        m = self.meta
        fixed = _RECORD.pack(_RECORD_VERSION, self.segment_id, self.offset, self.length,
                             m.block_index, m.codec_id, self.checksum, m.namespace,
                             m.parent or _NO_PARENT)
        names = json.dumps({"t": m.tenant, "m": m.model_id, "c": m.codec}, separators=(",", ":"))
        return fixed + names.encode()

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> IndexRecord:
        """Parse an index record; ValueError (or struct.error) if it is damaged."""
        (version, segment_id, offset, length, block_index, codec_id, checksum, namespace,
         parent) = _RECORD.unpack_from(raw)
        if version != _RECORD_VERSION or len(key) != KEY_BYTES:
            raise ValueError(f"index record version {version}, key of {len(key)} bytes")
        names = json.loads(raw[_RECORD.size:])
        meta = PageMeta(key=BlockKey(key), namespace=namespace,
                        parent=None if parent == _NO_PARENT else BlockKey(parent),
                        block_index=block_index, tenant=names["t"], model_id=names["m"],
                        codec=names["c"], codec_id=codec_id)
        return cls(meta, segment_id, offset, length, checksum)


class LmdbIndex:
    """The LMDB environment in ``<directory>/index`` and the changes not yet committed to it.

    Changes are journalled in memory (``put``, ``forget``) and applied by ``commit`` in one
    write transaction in a worker thread, one commit at a time. Called from one event loop.
    """

    def __init__(self, directory: Path, map_bytes: int, sync: bool) -> None:
        self._dir = directory
        self._map_bytes = map_bytes
        self._sync = sync
        self._env: lmdb.Environment | None = None
        self._db: Any = None
        self._lock = asyncio.Lock()
        self.journal: dict[bytes, bytes | None] = {}  # index changes not yet committed

    @property
    def is_open(self) -> bool:
        return self._env is not None

    def put(self, key: bytes, record: IndexRecord) -> None:
        self.journal[key] = record.pack()

    def forget(self, key: bytes) -> None:
        self.journal[key] = None

    async def open(self) -> None:
        """Open (or create) the environment; KVStoreError if LMDB refuses."""
        self._env, self._db = await asyncio.to_thread(self._open_env)

    async def load(self) -> list[tuple[bytes, bytes]]:
        """Every committed (key, record) pair."""
        return await asyncio.to_thread(self._load_records)

    async def commit(self) -> None:
        """Apply the journal to LMDB in one write transaction (one at a time)."""
        async with self._lock:
            if not self.journal:
                return
            journal, self.journal = self.journal, {}
            try:
                await asyncio.to_thread(self._apply, journal)
            except lmdb.Error as exc:
                for key, value in journal.items():
                    self.journal.setdefault(key, value)  # retried with the next commit
                if isinstance(exc, lmdb.MapFullError):
                    raise CapacityError("ssd index is full: raise ssd.index_map_bytes") from None
                raise KVStoreError(f"ssd index commit failed: {exc}") from None

    async def close(self) -> None:
        if self._env is not None:
            await asyncio.to_thread(self._env.close)
            self._env = None

    def _open_env(self) -> tuple[lmdb.Environment, Any]:
        path = self._dir / "index"
        private_directory(path, "ssd index directory")
        try:
            env = lmdb.open(str(path), map_size=self._map_bytes, max_dbs=1, lock=True,
                            subdir=True, readahead=False, sync=self._sync,
                            mode=PRIVATE_FILE_MODE)
            for name in ("data.mdb", "lock.mdb"):  # LMDB's mode is subject to the umask
                os.chmod(path / name, PRIVATE_FILE_MODE)
            return env, env.open_db(b"pages")
        except lmdb.Error as exc:
            raise KVStoreError(f"cannot open the ssd index in {self._dir}: {exc}") from None

    def _load_records(self) -> list[tuple[bytes, bytes]]:
        with self._env.begin(db=self._db) as txn:
            return list(txn.cursor())

    def _apply(self, journal: dict[bytes, bytes | None]) -> None:
        with self._env.begin(write=True, db=self._db) as txn:
            for key, value in journal.items():
                if value is None:
                    txn.delete(key)
                else:
                    txn.put(key, value)
