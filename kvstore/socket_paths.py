"""Whether a Unix socket's directory can be trusted: only its owner may change what is in it.

Anyone else who can write in the directory (or who owns it: another local user who created
``/tmp/kvstore-<uid>`` first) could put their own socket there: a daemon binding there would
be replaced, a client connecting there would hand that user its token and its prompts. The
daemon checks the directory before it binds (``kvstore.server.sockets``), the client before
every call and connection (``check_socket_path``), with the same rules: not a symlink, a
directory, owned by a trusted uid, not writable by group or others. The daemon trusts its own
uid; a client its own and root's (a daemon running as root, or a directory an init container
made for it).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Container
from pathlib import Path

from kvstore.errors import ConfigError, Unavailable


def directory_fault(directory: Path | str, owners: Container[int], whose: str) -> str | None:
    """What makes ``directory`` untrustworthy as a socket directory, or None.

    Args:
        directory: the directory (not followed if it is a symlink).
        owners: the uids that may own it.
        whose: how an error names ``owners`` ("this daemon's uid 1000").

    Raises:
        FileNotFoundError: ``directory`` does not exist.
    """
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink; refusing to follow it"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in owners:
        return f"is owned by uid {st.st_uid}, not by {whose}; refusing it"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                "make it 0700")
    return None


def socket_fault(path: str, owners: Container[int], whose: str) -> str | None:
    """What makes the socket file at ``path`` untrustworthy, or None (also when it is missing:
    a connect then fails on its own)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink; refusing to follow it"
    if not stat.S_ISSOCK(st.st_mode):
        return "is not a socket"
    if st.st_uid not in owners:
        return f"is owned by uid {st.st_uid}, not by {whose}; refusing it"
    return None


class SocketPath:
    """A Unix socket path a client connects to, checked before each use (``check``): the
    directory and the trusted uids are worked out once."""

    def __init__(self, path: str) -> None:
        uid = os.geteuid()
        self.path = path
        self.directory = os.path.dirname(os.path.abspath(path))
        self._owners = frozenset((uid, 0))
        self._whose = "root" if uid == 0 else f"this process's uid {uid} or root"

    def check(self) -> None:
        """Make sure the client may connect: the directory and the socket file are as private
        as the daemon would have made them.

        Raises:
            ConfigError: naming the path and the fault (the directory or the socket is a
                symlink or owned by another user, or the directory is writable by group or
                others).
            Unavailable: the directory does not exist: no daemon serves there. Nothing
                connects then, so no one can slip a socket in while a connection is retried.
        """
        try:
            fault = directory_fault(self.directory, self._owners, self._whose)
        except FileNotFoundError:
            raise Unavailable(f"no kvstore daemon serves {self.path}: its directory "
                              f"{self.directory} does not exist") from None
        if fault is not None:
            raise ConfigError(f"not connecting to {self.path}: its socket directory "
                              f"{self.directory} {fault} (another user could have put their "
                              "own socket there)")
        fault = socket_fault(self.path, self._owners, self._whose)
        if fault is not None:
            raise ConfigError(f"not connecting to {self.path}: the socket {fault}")


def check_socket_path(path: str) -> None:
    """``SocketPath(path).check()``: for a connection made once."""
    SocketPath(path).check()
