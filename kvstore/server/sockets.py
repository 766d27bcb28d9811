"""The daemon's side sockets beside the gRPC one (the descriptor channel, the data socket):
bound private from their first instant, replacing only what a dead daemon left."""

from __future__ import annotations

import os
import socket
import stat

from kvstore.errors import ConfigError


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
