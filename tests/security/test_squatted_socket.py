"""A client never talks to a socket in a directory someone else controls: another user who
created the default socket directory first (no XDG_RUNTIME_DIR: /tmp/kvstore-<uid>), a
directory group or others may write, a symlink. The client checks the path as the daemon
does before binding (owner, mode, not a symlink) before every gRPC call and before connecting
to the data, call-channel and descriptor sockets, and refuses naming the path and the fault.

Regression: the daemon refused such a directory, but the client connected to the socket the
other user put there and sent it its request (the prompt's token ids were captured).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import NO_RETRY, AsyncClient, Client
from kvstore.client.channels import AsyncChannel
from kvstore.client.mappings import fetch_region_fd
from kvstore.errors import ConfigError, Unavailable
from kvstore.rpc.framing import DataAddress, connect
from kvstore.socket_paths import check_socket_path

from ..conftest import random_tokens
from ..server.helpers import short_tmpdir

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
OTHER_UID = 12345


class Squatter:
    """A real listening socket at ``path`` that records every connection and what it was
    sent, in a thread."""

    def __init__(self, path: Path) -> None:
        self.received = b""
        self.connections = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._done.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.settimeout(0.5)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        self._sock.close()


def _squatted_owner(base: Path) -> Path:
    directory = base / "kvstore-victim"
    directory.mkdir(mode=0o755)
    os.chown(directory, OTHER_UID, OTHER_UID)
    return directory


def _squatted_writable(base: Path) -> Path:
    directory = base / "kvstore-victim"
    directory.mkdir()
    directory.chmod(0o777)
    return directory


def _squatted_symlink(base: Path) -> Path:
    target = base / "elsewhere"
    target.mkdir(mode=0o700)
    (base / "kvstore-victim").symlink_to(target)
    return base / "kvstore-victim"


CASES = {
    "owned by another uid": (_squatted_owner, f"is owned by uid {OTHER_UID}, not by root"),
    "writable by others": (_squatted_writable, r"is writable by group or others \(mode 0777\)"),
    "a symlink": (_squatted_symlink, "is a symlink; refusing to follow it"),
}


@pytest.fixture(params=list(CASES))
def squatted(request) -> Iterator[tuple[Path, Squatter, str]]:
    make, fault = CASES[request.param]
    if request.param == "owned by another uid" and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    base = short_tmpdir()
    base.chmod(0o755)
    path = make(base) / "kvstore.sock"
    squatter = Squatter(path)
    yield path, squatter, fault
    squatter.close()
    subprocess.run(["rm", "-rf", str(base)], check=False)


def _refusal(path: Path, fault: str) -> str:
    return f"not connecting to {path}: its socket directory {path.parent} {fault}"


def test_the_blocking_client_sends_nothing(squatted, ns):
    path, squatter, fault = squatted
    with Client(f"unix://{path}", retry=NO_RETRY) as client:
        with pytest.raises(ConfigError, match=_refusal(path, fault)):
            client.lookup(ns, random_tokens(64))
        with pytest.raises(ConfigError, match=_refusal(path, fault)):
            client.health()
    assert (squatter.connections, squatter.received) == (0, b"")


async def test_the_asyncio_client_sends_nothing(squatted, ns):
    path, squatter, fault = squatted
    async with AsyncClient(str(path), retry=NO_RETRY) as client:
        with pytest.raises(ConfigError, match=_refusal(path, fault)):
            await client.lookup(ns, random_tokens(64))
        with pytest.raises(ConfigError, match=_refusal(path, fault)):
            await client.acquire(ns, random_tokens(64))  # opens a session first
    assert (squatter.connections, squatter.received) == (0, b"")


async def test_side_sockets_are_checked_before_connecting(squatted):
    """The data socket, a call channel and the descriptor socket (paths the daemon names)."""
    path, squatter, fault = squatted
    with pytest.raises(ConfigError, match=_refusal(path, fault)):
        connect(DataAddress(socket.AF_UNIX, str(path)), 5.0)
    with pytest.raises(ConfigError, match=_refusal(path, fault)):
        await AsyncChannel.open(DataAddress(socket.AF_UNIX, str(path)), b"t" * 16, "tok",
                                5.0, 1 << 20)
    with pytest.raises(ConfigError, match=_refusal(path, fault)):
        fetch_region_fd(str(path), "", "tok")
    await asyncio.sleep(0.2)  # anything that slipped through would have been accepted by now
    assert (squatter.connections, squatter.received) == (0, b"")


def test_a_socket_that_is_a_symlink_is_refused(ns):
    base = short_tmpdir()
    try:
        squatter = Squatter(base / "real.sock")
        (base / "kvstore.sock").symlink_to(base / "real.sock")
        with (Client(f"unix://{base / 'kvstore.sock'}", retry=NO_RETRY) as client,
              pytest.raises(ConfigError, match="the socket is a symlink")):
            client.lookup(ns, random_tokens(64))
        squatter.close()
        assert squatter.connections == 0
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_a_missing_directory_is_unavailable_without_a_connection():
    base = short_tmpdir()
    try:
        with pytest.raises(Unavailable, match="its directory .* does not exist"):
            check_socket_path(str(base / "not-yet" / "kvstore.sock"))
    finally:
        base.rmdir()


@needs_root
def test_a_root_owned_directory_is_trusted_by_other_users(monkeypatch):
    """/run/kvstore made by an init container (root, 0755) for a daemon running as root: a
    client of another uid accepts it (as the daemon, as root, does), and no third user's."""
    base = short_tmpdir()
    try:
        run = base / "run"
        run.mkdir(mode=0o755)
        monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)  # the client's uid, not root
        check_socket_path(str(run / "kvstore.sock"))
        os.chown(run, OTHER_UID + 1, OTHER_UID + 1)
        with pytest.raises(ConfigError, match=f"is owned by uid {OTHER_UID + 1}, not by this "
                                              f"process's uid {OTHER_UID} or root"):
            check_socket_path(str(run / "kvstore.sock"))
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
