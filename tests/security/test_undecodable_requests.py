"""Request bytes that are no protobuf message: INVALID_ARGUMENT on every method, logged as a
client error (no traceback, nothing at ERROR), and the daemon keeps serving."""

from __future__ import annotations

import logging

import grpc
import pytest

from kvstore.client import AsyncClient
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from ..server.helpers import small_config

# A tag cut short, a varint field without its value, a string field longer than the message.
UNDECODABLE = (b"\xff", b"\x08", b"\x0a\x05ab")


def _call(channel: grpc.aio.Channel, method) -> object:
    path = f"/{method.containing_service.full_name}/{method.name}"
    if method.client_streaming:
        def put(payload: bytes):
            async def messages():
                yield payload
            return channel.stream_unary(path)(messages())
        return put
    if method.server_streaming:
        async def drain(payload: bytes):
            return [m async for m in channel.unary_stream(path)(payload)]
        return drain
    return channel.unary_unary(path)


async def test_undecodable_requests_are_invalid_argument_without_traceback(root, ns, spec,
                                                                            caplog):
    caplog.set_level(logging.DEBUG)
    daemon = await serve(small_config(root))
    methods = pb.DESCRIPTOR.services_by_name["KVStore"].methods
    try:
        async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
            for method in methods:
                for payload in UNDECODABLE:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await _call(channel, method)(payload)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                        method.name, payload, info.value.details())
                    assert "does not parse" in info.value.details()
        async with AsyncClient(daemon.unix_address, zero_copy=False) as client:
            tokens, kv = random_tokens(32), random_kv(spec, 32)
            assert await client.put(ns, tokens, kv) == 32
            assert (await client.lookup(ns, tokens)).matched_tokens == 32
    finally:
        await daemon.stop(1.0)
    assert len(methods) >= 13
    loud = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not loud, [(r.name, r.getMessage()) for r in loud]
