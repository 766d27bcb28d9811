"""Reads a whole LMDB index in a throwaway process, so that damage which would crash a reader
kills this process and not the daemon.

LMDB maps its file and trusts what it finds there: pages past the end of a truncated file
raise SIGBUS when touched, and damaged page pointers can send it anywhere. Run by
``kvstore.tiers.ssd.index`` as ``python index_check.py INDEX_DIR DB_NAME`` before it opens
an existing index. Exit status: 0 if every page of the database was read, ``DAMAGED`` if LMDB
(or the file size) says it is damaged, ``UNREADABLE`` if it cannot be read for another reason
(permissions, memory), ``UNAVAILABLE`` if this process cannot import lmdb (nothing was
checked); the reason goes to stderr. A death by a signal also means damage. It imports nothing
of kvstore, so it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import errno
import os
import sys

DAMAGED = 3
UNREADABLE = 4
UNAVAILABLE = 5

try:
    import lmdb
except ImportError as exc:
    if __name__ != "__main__":  # imported by kvstore.tiers.ssd.index for the constants
        raise
    print(f"cannot import lmdb: {exc}", file=sys.stderr)
    sys.exit(UNAVAILABLE)

# errno values that say nothing about the file's contents
_ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOMEM, errno.EMFILE, errno.ENFILE,
                       errno.EAGAIN}


def check(path: str, db_name: bytes) -> str | None:
    """Why the index at ``path`` is damaged, or None once all of it was read."""
    env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=1, readahead=False)
    try:
        size = os.path.getsize(os.path.join(path, "data.mdb"))
        end = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        if size < end:
            return f"data.mdb is {size} bytes but its pages reach {end}"
        with env.begin() as txn:
            for _ in txn.cursor():  # the main database: the names of the sub-databases
                pass
        try:
            db = env.open_db(db_name, create=False)
        except lmdb.NotFoundError:
            return None  # created, then closed before the first commit
        with env.begin(db=db) as txn:
            for _ in txn.cursor():  # copies every key and value out of the map
                pass
        return None
    finally:
        env.close()


def main(argv: list[str]) -> int:
    try:
        damage = check(argv[1], argv[2].encode())
    except lmdb.Error as exc:
        print(exc, file=sys.stderr)
        return UNREADABLE if getattr(exc, "code", None) in _ENVIRONMENT_ERRNOS else DAMAGED
    if damage is not None:
        print(damage, file=sys.stderr)
        return DAMAGED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
