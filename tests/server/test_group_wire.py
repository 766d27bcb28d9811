"""A grouped namespace on the wire: a malformed or oversized cache_spec is refused by name with
INVALID_ARGUMENT, verbs that take one group refuse a grouped namespace, and the daemon keeps
serving; a good grouped Lookup answers in one call."""

from __future__ import annotations

import json

import grpc
import pytest

from kvstore.groups import CacheGroup, CacheSpec
from kvstore.keys import Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.spec import KVSpec

from ..conftest import random_tokens

SPEC = CacheSpec((CacheGroup.attention(2, 2, 8), CacheGroup.state(2, {"s": ((4, 4), "float32")})),
                 16)
GOOD = Namespace("m", SPEC)


def with_cache(raw: bytes) -> pb.Namespace:
    msg = namespace_to_proto(GOOD)
    msg.cache_spec = raw
    return msg


def group_dict(**changes) -> bytes:
    data = SPEC.to_dict()
    data["groups"][0].update(changes)
    return json.dumps(data).encode()


BAD = [
    ("not json", b"{nope", "not JSON"),
    ("a list", b"[]", "JSON object"),
    ("unknown field", json.dumps({**SPEC.to_dict(), "x": 1}).encode(), "unknown CacheSpec"),
    ("no groups", json.dumps({"groups": [], "block_tokens": 16}).encode(), "1-64 CacheGroups"),
    ("bad kind", group_dict(kind="ring"), "kind"),
    ("zero layers", group_dict(num_layers=0), "num_layers"),
    ("huge part", group_dict(parts=[{"name": "k", "shape": [1 << 20, 1 << 20]},
                                    {"name": "v", "shape": [1, 1]}]), "elements"),
    ("part not a mapping", group_dict(parts=[7]), "CachePart"),
    ("oversized", json.dumps({**SPEC.to_dict(), "pad": "x" * 70_000}).encode(), "over"),
]


@pytest.mark.parametrize("name, raw, match", BAD, ids=[b[0] for b in BAD])
async def test_a_malformed_cache_spec_is_refused_and_the_daemon_serves_on(daemon, name, raw,
                                                                          match):
    tokens = tokens_to_bytes(random_tokens(64))
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Lookup(pb.LookupRequest(namespace=with_cache(raw), tokens=tokens))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in err.value.details()
        reply = await stub.Lookup(pb.LookupRequest(namespace=namespace_to_proto(GOOD),
                                                   tokens=tokens))
        assert reply.num_tokens == 64 and reply.matched_tokens == 0


async def test_spec_and_cache_spec_together_are_refused(daemon):
    msg = namespace_to_proto(GOOD)
    msg.spec.CopyFrom(namespace_to_proto(Namespace("m", KVSpec(2, 2, 8, 16))).spec)
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pbg.KVStoreStub(channel).Lookup(pb.LookupRequest(
                namespace=msg, tokens=tokens_to_bytes(random_tokens(32))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "both spec and cache_spec" in err.value.details()


async def test_one_group_verbs_refuse_a_grouped_namespace(daemon):
    tokens = tokens_to_bytes(random_tokens(32))
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        for call in (lambda: stub.Acquire(pb.AcquireRequest(namespace=namespace_to_proto(GOOD),
                                                            tokens=tokens)),
                     lambda: stub.Reserve(pb.ReserveRequest(namespace=namespace_to_proto(GOOD),
                                                            tokens=tokens))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Namespace.group" in err.value.details()
