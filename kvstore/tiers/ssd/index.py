"""The SSD tier's LMDB index: the record kept per page, the journal committed in batches, and
what happens to an index found damaged."""

from __future__ import annotations

import asyncio
import enum
import errno
import json
import logging
import os
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import CapacityError, KVStoreError
from kvstore.keys import KEY_BYTES, NO_PARENT, BlockKey
from kvstore.page import PageMeta
from kvstore.tiers.ssd import index_check
from kvstore.tiers.ssd.segments import (
    PRIVATE_FILE_MODE,
    aligned,
    private_directory,
    sync_directory,
)

log = logging.getLogger("kvstore.tiers.ssd")  # the SSD tier's logger: these are its messages

_RECORD = struct.Struct("<BIQIIHQ16s16s")  # version, segment, offset, length, block, codec, xxh3
_RECORD_VERSION = 1
_DB_NAME = b"pages"
DATA_FILE = "data.mdb"  # LMDB's file in the index directory
# LMDB errors that mean the file's contents are damaged (others: permissions, memory, disk).
_DAMAGE_ERRORS = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError,
                  lmdb.VersionMismatchError, lmdb.IncompatibleError, lmdb.BadValsizeError)
# How long the check of an existing index may take. It reads the file about once, and 20 MB/s
# is far below any disk's sequential reads: a longer run means LMDB went round in circles
# (damaged pages can point back at each other).
CHECK_MIN_TIMEOUT_S = 60.0
CHECK_MIN_BYTES_PER_S = 20e6
# LMDB reports a short write as EIO rather than ENOSPC (tmpfs, LMDB 0.9.36): a failed commit
# with less than this free on the index's file system is taken for a full disk. A commit that
# runs out writes what fits, so what is left after it is a few blocks at most.
FULL_DISK_SLACK_BYTES = 1 << 20


class IndexState(enum.Enum):
    """What ``LmdbIndex.open`` found."""

    OPENED = "opened"  # a committed index, read whole by the check
    CREATED = "created"  # none: a new, empty one
    RESET = "reset"  # a damaged one, moved aside: a new, empty one


@dataclass(frozen=True, slots=True)
class IndexOpen:
    """The outcome of ``LmdbIndex.open``; ``damage`` and ``moved_to`` are set for RESET."""

    state: IndexState
    damage: str | None = None
    moved_to: Path | None = None


def _free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system (None if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class _Damaged(Exception):
    """LMDB found the index's contents damaged (internal to this module)."""


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
                             m.parent or NO_PARENT)
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
                        parent=None if parent == NO_PARENT else BlockKey(parent),
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
        self.is_behind = False  # the last commit failed; the journal holds what it had

    @property
    def is_open(self) -> bool:
        return self._env is not None

    def put(self, key: bytes, record: IndexRecord) -> None:
        self.journal[key] = record.pack()

    def forget(self, key: bytes) -> None:
        self.journal[key] = None

    async def open(self) -> IndexOpen:
        """Open the environment, creating it if there is none.

        An existing index is first read whole in a child process (``index_check``). If it
        is damaged (the check fails or dies, or LMDB here calls it damaged) it is moved aside
        to ``index.corrupt-<time>``, kept for inspection, and a new, empty index is opened:
        the caller rebuilds it from the segments. KVStoreError if LMDB refuses for another
        reason (permissions, memory).
        """
        path = self._dir / "index"
        existed = (path / DATA_FILE).exists()
        damage = await self._check(path) if existed else None
        if damage is None:
            try:
                self._env, self._db = await asyncio.to_thread(self._open_env)
                return IndexOpen(IndexState.OPENED if existed else IndexState.CREATED)
            except _Damaged as exc:
                damage = str(exc)
        moved_to = await asyncio.to_thread(self._move_aside, path)
        self._env, self._db = await asyncio.to_thread(self._open_env)
        return IndexOpen(IndexState.RESET, damage, moved_to)

    async def _check(self, path: Path) -> str | None:
        """Why the index at ``path`` is damaged, or None: read whole by a child process."""
        size = os.path.getsize(path / DATA_FILE)
        timeout_s = max(CHECK_MIN_TIMEOUT_S, size / CHECK_MIN_BYTES_PER_S)
        # The child finds lmdb where this process did, whatever installed it.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            child = await asyncio.create_subprocess_exec(
                sys.executable, index_check.__file__, str(path), _DB_NAME.decode(),
                env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE)
        except OSError as exc:  # no interpreter to run, no process to spare
            return self._unchecked(path, str(exc))
        try:
            _, err = await asyncio.wait_for(child.communicate(), timeout_s)
        except TimeoutError:
            child.kill()
            await child.wait()
            return f"reading it took longer than {timeout_s:.0f} s"
        reason = err.decode(errors="replace").strip()[-500:]
        if child.returncode == 0:
            return None
        if child.returncode == index_check.UNREADABLE:
            raise KVStoreError(f"cannot read the ssd index in {path}: {reason}")
        if child.returncode == index_check.UNAVAILABLE:
            return self._unchecked(path, reason)
        if child.returncode < 0:
            return f"reading it was killed by signal {-child.returncode}"
        return reason or f"reading it failed with exit status {child.returncode}"

    @staticmethod
    def _unchecked(path: Path, why: str) -> None:
        log.warning("ssd index in %s: cannot check it in a child process (%s); opening it "
                    "unchecked", path, why)

    @staticmethod
    def _move_aside(path: Path) -> Path:
        """Rename the damaged index out of the way; where it is lost: ``index.corrupt-<time>``,
        or ``index/data.mdb.corrupt-<time>`` if ``index/`` cannot be renamed (a mount point)."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = path.with_name(f"index.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = path.with_name(f"index.corrupt-{stamp}-{n}")
            n += 1
        try:
            os.rename(path, target)
        except OSError:  # EBUSY, EXDEV: keep the damaged file on its own file system
            target = path / f"{DATA_FILE}.corrupt-{stamp}-{n}"
            os.rename(path / DATA_FILE, target)
            (path / "lock.mdb").unlink(missing_ok=True)
            sync_directory(path)
        sync_directory(path.parent)
        return target

    async def load(self) -> list[tuple[bytes, bytes]]:
        """Every committed (key, record) pair."""
        return await asyncio.to_thread(self._load_records)

    async def commit(self) -> None:
        """Apply the journal to LMDB in one write transaction (one at a time).

        Raises:
            CapacityError: the map is full (``ssd.index_map_bytes``) or the file system is;
                the journal is kept for the next commit, and ``is_behind`` stays True until
                one succeeds.
            KVStoreError: LMDB refused the commit for another reason (kept the same way).
        """
        async with self._lock:
            if not self.journal:
                self.is_behind = False
                return
            journal, self.journal = self.journal, {}
            try:
                await asyncio.to_thread(self._apply, journal)
            except lmdb.Error as exc:
                for key, value in journal.items():
                    self.journal.setdefault(key, value)  # retried with the next commit
                self.is_behind = True
                raise self._commit_error(exc) from None
            self.is_behind = False

    def _commit_error(self, exc: lmdb.Error) -> KVStoreError:
        path = self._dir / "index"
        if isinstance(exc, lmdb.MapFullError):
            return CapacityError(f"ssd index {path} is full ({self._map_bytes} bytes mapped): "
                                 "raise ssd.index_map_bytes")
        free_bytes = _free_bytes(path)
        if getattr(exc, "code", None) in (errno.ENOSPC, errno.EDQUOT) or (
                free_bytes is not None and free_bytes < FULL_DISK_SLACK_BYTES):
            return CapacityError(f"ssd index commit in {path} failed: its file system is full "
                                 f"({free_bytes} bytes free): {exc}")
        return KVStoreError(f"ssd index commit in {path} failed: {exc}")

    async def close(self) -> None:
        if self._env is not None:
            await asyncio.to_thread(self._env.close)
            self._env = None

    def _open_env(self) -> tuple[lmdb.Environment, Any]:
        path = self._dir / "index"
        private_directory(path, "ssd index directory")
        env = None
        try:
            env = lmdb.open(str(path), map_size=self._map_bytes, max_dbs=1, lock=True,
                            subdir=True, readahead=False, sync=self._sync,
                            mode=PRIVATE_FILE_MODE)
            for name in (DATA_FILE, "lock.mdb"):  # LMDB's mode is subject to the umask
                os.chmod(path / name, PRIVATE_FILE_MODE)
            return env, env.open_db(_DB_NAME)
        except lmdb.Error as exc:
            if env is not None:
                env.close()
            if isinstance(exc, _DAMAGE_ERRORS):
                raise _Damaged(str(exc)) from None
            raise KVStoreError(f"cannot open the ssd index in {path}: {exc}") from None

    def _load_records(self) -> list[tuple[bytes, bytes]]:
        try:
            with self._env.begin(db=self._db) as txn:
                return list(txn.cursor())
        except lmdb.Error as exc:  # the check read it whole a moment ago: not for damage
            raise KVStoreError(f"cannot read the ssd index in {self._dir / 'index'}: "
                               f"{exc}") from None

    def _apply(self, journal: dict[bytes, bytes | None]) -> None:
        with self._env.begin(write=True, db=self._db) as txn:
            for key, value in journal.items():
                if value is None:
                    txn.delete(key)
                else:
                    txn.put(key, value)
