"""A client process loads the client and the wire layer, never the store, its tiers, the
server or their libraries: an engine links the client and must not pay for the daemon."""

from __future__ import annotations

from ..conftest import modules_loaded_by, under

DAEMON_SIDE = ("kvstore.store", "kvstore.tiers", "kvstore.server", "kvstore.index",
               "kvstore.leases", "lmdb", "aiofiles")


def test_client_imports_nothing_of_the_daemon():
    loaded = modules_loaded_by("import kvstore.client\n"
                               "from kvstore.client import AsyncClient, Client\n"
                               "Client('unix:///nonexistent').close()")
    assert "kvstore.client" in loaded and "kvstore.rpc.convert" in loaded
    assert under(loaded, *DAEMON_SIDE) == []
