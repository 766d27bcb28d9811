"""The wire layer sits below both ends of a call: it imports neither the server nor the
client, nor the store and its tiers."""

from __future__ import annotations

from ..conftest import modules_loaded_by, under


def test_rpc_imports_neither_end():
    loaded = modules_loaded_by("import kvstore.rpc.convert, kvstore.rpc.status, "
                               "kvstore.rpc.tensors, kvstore.rpc.kvstore_pb2_grpc")
    assert under(loaded, "kvstore.server", "kvstore.client", "kvstore.store", "kvstore.tiers",
                 "kvstore.index", "kvstore.leases") == []
