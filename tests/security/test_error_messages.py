"""Error messages repeat at most a bounded head of any string a caller sent (a tenant, dtype,
tier or lease id of 100,000 characters comes back as its first 64 and its length)."""

from __future__ import annotations

import grpc
import pytest

from kvstore.errors import SHOWN_CHARS, shown
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.tensors import tensor_header
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from ..server.helpers import small_config

LONG_CHARS = 100_000
MAX_DETAILS_CHARS = 400  # the fixed text of any of these messages plus one shown value
ACME = (("authorization", "Bearer tok-acme"),)


def test_shown_keeps_short_values_and_cuts_long_ones():
    assert shown("acme") == repr("acme") and shown(7) == repr("7")
    long = "x" * 1000
    assert shown(long) == f"{'x' * SHOWN_CHARS!r}... (1000 chars)"


@pytest.fixture
async def stub(root):
    daemon = await serve(small_config(root, tenant_tokens={"acme": "tok-acme"}))
    try:
        async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
            yield pbg.KVStoreStub(channel)
    finally:
        await daemon.stop(1.0)


def _cases(ns, spec, long: str):
    good = namespace_to_proto(ns)
    tokens = tokens_to_bytes(random_tokens(32))
    bad_dtype_ns = namespace_to_proto(ns)
    bad_dtype_ns.spec.dtype = long
    header = tensor_header(random_kv(spec, 32))
    header.dtype = long

    async def put_with_long_dtype(stub):
        async def messages():
            yield pb.PutRequest(header=pb.PutHeader(namespace=good, tokens=tokens,
                                                    tensor=header))
        return await stub.Put(messages())

    return [
        ("ListBlocks tier", grpc.StatusCode.INVALID_ARGUMENT,
         lambda s: s.ListBlocks(pb.ListBlocksRequest(tier=long))),
        ("Stats of another tenant", grpc.StatusCode.PERMISSION_DENIED,
         lambda s: s.Stats(pb.StatsRequest(tenant=long), metadata=ACME)),
        ("Evict of another tenant", grpc.StatusCode.PERMISSION_DENIED,
         lambda s: s.Evict(pb.EvictRequest(tenant=long), metadata=ACME)),
        ("Lookup spec dtype", grpc.StatusCode.INVALID_ARGUMENT,
         lambda s: s.Lookup(pb.LookupRequest(namespace=bad_dtype_ns, tokens=tokens))),
        ("Put tensor dtype", grpc.StatusCode.INVALID_ARGUMENT, put_with_long_dtype),
        ("Release lease id", grpc.StatusCode.NOT_FOUND,
         lambda s: s.Release(pb.ReleaseRequest(lease_id=long))),
        ("Commit reservation id", grpc.StatusCode.NOT_FOUND,
         lambda s: s.Commit(pb.CommitRequest(reservation_id=long))),
        ("Abort reservation id", grpc.StatusCode.NOT_FOUND,
         lambda s: s.Abort(pb.AbortRequest(reservation_id=long))),
    ]


async def test_long_client_strings_are_cut_in_error_messages(stub, ns, spec):
    long = "q" * LONG_CHARS
    for name, code, call in _cases(ns, spec, long):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(stub)
        details = info.value.details()
        assert info.value.code() == code, (name, details[:200])
        assert len(details) < MAX_DETAILS_CHARS, (name, len(details))
        assert "q" * SHOWN_CHARS in details and "q" * (SHOWN_CHARS + 1) not in details, name
        assert f"({LONG_CHARS} chars)" in details, name
