"""The call plans both clients share: each names a method of the service with the request type
that method takes, and a streamed Put can be sent again whole when a call is retried."""

from __future__ import annotations

import math

import pytest

from kvstore.client import requests
from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.tensors import tensor_view

from ..conftest import random_kv, random_tokens

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]


def test_every_unary_call_matches_its_method(ns):
    tokens = random_tokens(32)
    calls = [requests.lookup(ns, tokens),
             requests.evict("acme", None, [BlockKey(bytes(16))], False),
             requests.stats(None), requests.list_blocks(None, "m", "dram", 10),
             requests.hint(ns, tokens, 0.5), requests.hint(ns, tokens, 0.5, "wait"),
             requests.cancel_hint(ns, tokens), requests.health(),
             requests.acquire(ns, tokens, None), requests.release("l1"),
             requests.reserve(ns, tokens, 30.0), requests.commit("r1"), requests.abort("r1")]
    for call in calls:
        method = SERVICE.methods_by_name[call.method]
        assert call.request.DESCRIPTOR is method.input_type, call.method
        assert not method.client_streaming and not method.server_streaming
    assert requests.commit("r1").parse(pb.CommitResponse(tokens_published=48)) == 48
    assert requests.release("l1").parse(pb.ReleaseResponse()) is None
    assert requests.hint(ns, tokens, 0.5, "wait").request.policy == "wait"
    assert requests.cancel_hint(ns, tokens).parse(pb.CancelHintResponse(num_hints=2)) == 2


def test_put_stream_starts_over_on_each_iteration(ns, spec):
    kv = random_kv(spec, 48)
    stream = requests.PutStream(ns, random_tokens(48), kv, chunk_bytes=4096)
    first, second = list(stream), list(stream)
    assert first == second and first[0].WhichOneof("part") == "header"
    data = bytes(tensor_view(kv))
    assert len(first) == 1 + math.ceil(len(data) / 4096)
    assert b"".join(m.chunk for m in first[1:]) == data


def test_put_stream_checks_the_tensor_against_the_spec(ns, spec):
    with pytest.raises(InvalidArgument, match="16 tokens but 32"):
        requests.PutStream(ns, random_tokens(32), random_kv(spec, 16), chunk_bytes=4096)
    with pytest.raises(InvalidArgument, match="dtype"):
        requests.PutStream(ns, random_tokens(16), random_kv(spec, 16).half(), chunk_bytes=4096)
