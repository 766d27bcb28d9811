"""The daemon's Unix socket files: claimed private, replacing only what a dead daemon left.

The gRPC socket's path is claimed first (``claim_socket_path``: a directory only we can
change, a lock held for the daemon's lifetime, a stale socket file cleared); the side sockets
beside it (the descriptor socket, the data socket) are bound private from their first instant
(``bind_unix``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path
from typing import IO

from kvstore.errors import AlreadyRunning, ConfigError
from kvstore.socket_paths import directory_fault

_log = logging.getLogger("kvstore.server.sockets")
_PROBE_TIMEOUT_S = 1.0  # how long a connect to an existing socket may take to count as live


def bind_unix(path: str, mode: int, what: str) -> socket.socket:
    """A stream socket bound at ``path`` with file mode ``mode`` (0600 while it is created: the
    bind makes the file). A stale socket file is replaced; anything else there is an error
    naming ``what``. The caller holds the gRPC socket's lock, so no live daemon serves it."""
    clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind the {what} {path}: {exc}") from None
    finally:
        os.umask(old)
    os.chmod(path, mode)
    return sock


def clear_stale(path: str) -> None:
    """Remove a socket file a dead daemon left at ``path``; refuse anything that is not one."""
    try:
        file_mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(file_mode):
        raise ConfigError(f"{path} exists and is not a socket; refusing to replace it")
    os.unlink(path)


def _socket_is_live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()


def claim_socket_path(path: str) -> IO[str]:
    """Check the socket's directory, lock ``path`` for this process and clear a stale socket
    file; return the held lock (``<path>.lock``, mode 0600).

    Raises:
        ConfigError: the directory is not ours alone (see ``check_socket_directory``), or
            the lock file is a symlink.
        AlreadyRunning: another daemon holds the lock or a process answers on the socket.
    """
    check_socket_directory(Path(path).parent)
    lock = _open_lock(f"{path}.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise AlreadyRunning(f"another kvstore daemon already serves {path} (it holds "
                             f"{path}.lock); stop it or choose another server.socket_path")
    try:
        _clear_stale_socket(path)
    except BaseException:
        lock.close()
        raise
    return lock


def check_socket_directory(directory: Path) -> None:
    """Create ``directory`` with mode 0700 if it is missing; else make sure only we can change
    what is in it (``kvstore.socket_paths``, the clients' check too). Anyone else who can
    write there could replace the socket with their own (clients would hand it their tokens)
    or plant a symlink at the lock file.

    Raises:
        ConfigError: naming the directory and the fault: a symlink, not a directory, owned by
            another user, or writable by group or others.
    """
    what = f"socket directory {directory} (server.socket_path)"
    if not os.path.lexists(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # someone else's: the checks below decide
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)  # whatever the umask took away or left
    fault = directory_fault(directory, (os.geteuid(),), f"this daemon's uid {os.geteuid()}")
    if fault is not None:
        raise ConfigError(f"{what} {fault}")


def _open_lock(path: str) -> IO[str]:
    """Open (or create) the lock file with mode 0600, never through a symlink."""
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"lock file {path} is a symlink; refusing to follow it") from None
        raise ConfigError(f"cannot open lock file {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # the umask may have taken bits; an old file may have more
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"cannot make lock file {path} private: {exc.strerror}") from None
    return os.fdopen(fd, "a+")  # held for the daemon's lifetime


def _clear_stale_socket(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"server.socket_path {path} exists and is not a socket; "
                          "refusing to replace it")
    if _socket_is_live(path):
        raise AlreadyRunning(f"a process already answers on {path}; stop it or choose "
                             "another server.socket_path")
    os.unlink(path)
    _log.warning("removed stale socket %s left by a previous daemon", path,
                 extra={"socket": path})
