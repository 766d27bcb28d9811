"""Call channels against a real daemon: small calls in frames on a data connection, under the
same checks as their gRPC twins, and what hostile clients of a channel cannot make the daemon
do."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvstore.client import NO_RETRY, AsyncClient, Client
from kvstore.errors import FailedPrecondition, LeaseNotFound, PermissionDenied, RateLimited
from kvstore.keys import Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.framing import (
    FRAME,
    MAX_FRAMES_IN_FLIGHT,
    METADATA_FLAG,
    OPENED_ID,
    encode_call,
    encode_frame,
    encode_hello,
    method_byte,
)
from kvstore.server.channel import BODY_PIECE_BYTES, _read_body
from kvstore.server.daemon import serve
from kvstore.server.data_socket import MAX_CHANNELS_PER_TENANT
from kvstore.spec import KVSpec

from .helpers import DaemonThread, MiB, rpc_calls, sample_total, small_config
from .hostile import eventually

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16)
NS = Namespace(model_id="channel/m", spec=SPEC, tenant="acme")
IDLE_S = 0.5
TOKENS = {"acme": "tok-acme", "umbrella": "tok-umbrella"}
SC = grpc.StatusCode


def kv_for(num_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.shape(num_tokens), generator=gen).to(torch.bfloat16)


@pytest.fixture
async def daemon(root):
    d = await serve(small_config(root, dram_bytes=64 * MiB, stream_idle_timeout_s=IDLE_S,
                                 tenant_tokens=TOKENS, require_auth_on_unix=True))
    yield d
    await d.stop(1.0)


def metadata(tenant: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),) if tenant else ()


async def open_ticket(daemon, tenant: str = "acme") -> pb.DataTicket:
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        return await pbg.KVStoreStub(channel).OpenChannel(pb.OpenChannelRequest(),
                                                          metadata=metadata(tenant))


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """(status, request id, body) of the daemon's next frame."""
    length, status, request_id = FRAME.unpack(await asyncio.wait_for(
        reader.readexactly(FRAME.size), 10 * IDLE_S))
    return status, request_id, await reader.readexactly(length)


async def raw_channel(daemon, tenant: str = "acme", present: str | None = None):
    """A channel opened by hand: its streams and the daemon's answer to the hello."""
    ticket = await open_ticket(daemon, tenant)
    reader, writer = await asyncio.open_unix_connection(ticket.unix_path)
    writer.write(encode_hello(ticket.ticket, TOKENS[present or tenant]))
    return reader, writer, await read_frame(reader)


def lookup_frame(request_id: int, tokens: list[int], ns: Namespace = NS) -> bytes:
    request = pb.LookupRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                               packed=True)
    return encode_frame(method_byte("Lookup"), request_id, request.SerializeToString())


async def closed_by_daemon(reader: asyncio.StreamReader) -> bool:
    try:
        await asyncio.wait_for(reader.read(), 10 * IDLE_S)
        return True
    except ConnectionResetError:
        return True


async def still_serves(daemon) -> None:
    async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as client:
        assert (await client.lookup(NS, list(range(32)))).num_tokens == 32


# ---------------------------------------------------------------------------- what works


async def test_small_calls_go_over_the_channel_with_the_grpc_results(daemon):
    kv, tokens = kv_for(64), list(range(64))
    calls = daemon.datapath.calls
    async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as client, \
            AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY,
                        call_channel=False) as plain:
        assert await client.put(NS, tokens, kv) == 64  # Reserve + Commit
        before = calls.num_calls
        on_channel = await client.lookup(NS, tokens)
        assert calls.num_calls == before + 1 and daemon.datapath.num_channels == 1
        health = await pbg.KVStoreStub(client._channel).Health(pb.HealthRequest(),
                                                               metadata=metadata("acme"))
        assert health.call_channel
        over_grpc = await plain.lookup(NS, tokens)
        assert calls.num_calls == before + 1
        assert on_channel == over_grpc and on_channel.matched_tokens == 64
        assert torch.equal(await client.get(NS, tokens), kv)  # Acquire + Release
        await client.flush_releases()
        assert calls.num_calls == before + 3
        with pytest.raises(LeaseNotFound):  # the error its gRPC twin raises
            await client.release("no-such-lease")
        with pytest.raises(LeaseNotFound):
            await plain.release("no-such-lease")
        assert (await client.stats()).active_leases == 0


async def test_a_draining_daemon_runs_no_new_channel_call(daemon):
    """Once the daemon drains, gRPC refuses new calls; a channel opened before refuses them
    too, with Unavailable, instead of running them against a store about to close."""
    reader, writer, opened = await raw_channel(daemon)
    assert opened[:2] == (0, OPENED_ID)
    writer.write(lookup_frame(1, list(range(32))))
    status, request_id, _ = await read_frame(reader)
    assert (status, request_id) == (0, 1)
    daemon.draining = True
    try:
        writer.write(lookup_frame(2, list(range(32))))
        status, request_id, body = await read_frame(reader)
        assert (status, request_id) == (SC.UNAVAILABLE.value[0], 2)
        assert "shutting down" in pb.CallError.FromString(body).details
    finally:
        daemon.draining = False
        writer.close()


async def test_metrics_count_channel_calls_per_method(daemon):
    async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as client:
        for _ in range(3):
            await client.lookup(NS, list(range(32)))
        with pytest.raises(LeaseNotFound):
            await client.release("nope")
    registry = daemon.metrics.registry
    assert sample_total(registry, "kvstore_rpc_latency_seconds_count", method="Lookup") >= 3
    assert sample_total(registry, "kvstore_rpc_errors_total", method="Release",
                        code="NOT_FOUND") == 1


def test_blocking_client_uses_the_channel_and_its_off_switch(root):
    config = small_config(root, dram_bytes=64 * MiB)
    with DaemonThread(config) as daemon:
        calls = daemon.datapath.calls
        with Client(daemon.unix_address, retry=NO_RETRY) as client:
            client.put(NS, list(range(32)), kv_for(32))
            assert torch.equal(client.get(NS, list(range(32))), kv_for(32))
            client.flush_releases()
            used = calls.num_calls
            assert client.health().call_channel  # Health itself is a gRPC call
            assert used >= 4 and client.lookup(NS, list(range(32))).matched_tokens == 32
            assert calls.num_calls == used + 1
        with Client(daemon.unix_address, retry=NO_RETRY, call_channel=False) as client:
            assert client.lookup(NS, list(range(32))).matched_tokens == 32
            assert calls.num_calls == used + 1


def test_gets_acquire_on_a_channel_while_the_last_release_is_on_the_other(root):
    """A blocking client's get leaves its Release to ride on the next Acquire, or to a worker
    that sends it on the client's second channel once no Acquire came for a while: never over
    gRPC. Every one of the gets' calls is a channel call, and the client holds two channels
    at most."""
    config = small_config(root, dram_bytes=64 * MiB)
    with DaemonThread(config) as daemon:
        calls = daemon.datapath.calls
        with Client(daemon.unix_address, retry=NO_RETRY, zero_copy=True) as client:
            tokens, kv = list(range(64)), kv_for(64)
            client.put(NS, tokens, kv)
            out = torch.empty_like(kv)
            before = (calls.num_calls, rpc_calls(daemon, "Acquire"), rpc_calls(daemon, "Release"))
            for _ in range(12):
                client.get(NS, tokens, out=out)
            client.flush_releases()
            assert torch.equal(out, kv)
            acquires = rpc_calls(daemon, "Acquire") - before[1]
            releases = rpc_calls(daemon, "Release") - before[2]
            assert acquires == 12 and 1 <= releases <= 12  # the last get's Release, at least
            assert calls.num_calls - before[0] == acquires + releases
            assert 1 <= len(client._transport.channels) <= 2
            assert client.stats().active_leases == 0


def test_a_daemon_without_channels_is_called_over_grpc(root):
    config = small_config(root, dram_bytes=64 * MiB, call_channel=False)
    with DaemonThread(config) as daemon, Client(daemon.unix_address, retry=NO_RETRY) as client:
        assert daemon.datapath.calls is None
        with grpc.insecure_channel(daemon.unix_address) as channel:
            assert not pbg.KVStoreStub(channel).Health(pb.HealthRequest()).call_channel
        assert not client.health().call_channel
        client.put(NS, list(range(32)), kv_for(32))
        assert client.lookup(NS, list(range(32))).matched_tokens == 32
        assert torch.equal(client.get(NS, list(range(32))), kv_for(32))
        assert daemon.datapath.num_channels == 0


def test_a_restarted_daemon_is_reached_again_and_its_channel_reopened(root):
    config = small_config(root, dram_bytes=64 * MiB)
    with Client(f"unix://{config.server.socket_path}") as client:
        with DaemonThread(config) as first:
            client.put(NS, list(range(32)), kv_for(32))
            assert client.lookup(NS, list(range(32))).matched_tokens == 32
            assert first.datapath.num_channels == 1
        with DaemonThread(config) as second:
            # the old channel is gone: this call goes over gRPC (which reconnects) ...
            assert client.lookup(NS, list(range(32))).num_tokens == 32
            # ... and the next opens a channel to the new daemon
            used = second.datapath.calls.num_calls
            assert client.lookup(NS, list(range(32))).matched_tokens == 32  # the SSD kept it
            assert second.datapath.num_channels == 1
            assert second.datapath.calls.num_calls > used


# ---------------------------------------------------------------------------- the checks


async def test_another_tenants_namespace_is_refused_on_the_channel(daemon):
    other = Namespace(model_id="channel/m", spec=SPEC, tenant="umbrella")
    async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as client:
        await client.lookup(NS, list(range(16)))
        before = daemon.datapath.calls.num_calls
        with pytest.raises(PermissionDenied, match="may not look up"):
            await client.lookup(other, list(range(16)))
        with pytest.raises(PermissionDenied):
            await client.acquire(other, list(range(16)))
        assert daemon.datapath.calls.num_calls == before + 2


async def test_a_ticket_presented_with_another_token_is_refused(daemon):
    reader, writer, (status, request_id, body) = await raw_channel(daemon, "acme", "umbrella")
    assert (status, request_id) == (SC.PERMISSION_DENIED.value[0], OPENED_ID)
    assert "another caller" in pb.CallError.FromString(body).details
    assert await closed_by_daemon(reader)
    writer.close()
    assert daemon.datapath.num_channels == 0


async def test_a_wrong_token_gets_no_ticket(daemon):
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pbg.KVStoreStub(channel).OpenChannel(
                pb.OpenChannelRequest(), metadata=(("authorization", "Bearer wrong"),))
    assert info.value.code() == SC.UNAUTHENTICATED


async def test_rate_limits_hold_on_the_channel(root):
    d = await serve(small_config(root, dram_bytes=64 * MiB, rate_limit_rps=0.5,
                                 rate_limit_burst=4))
    try:
        async with AsyncClient(d.unix_address, retry=NO_RETRY) as client:
            with pytest.raises(RateLimited) as info:
                for _ in range(10):
                    await client.lookup(NS, list(range(16)))
            assert info.value.retry_after_s > 0
            assert d.datapath.num_channels == 1
    finally:
        await d.stop(1.0)


async def test_zero_copy_calls_on_a_tcp_channel_are_refused_as_over_grpc(root):
    d = await serve(small_config(root, dram_bytes=64 * MiB, tenant_tokens=TOKENS,
                                 tcp_address="127.0.0.1:0"))
    try:
        async with AsyncClient(d.tcp_address, token="tok-acme", retry=NO_RETRY) as client:
            assert (await client.lookup(NS, list(range(16)))).num_tokens == 16
            assert d.datapath.num_channels == 1
            with pytest.raises(FailedPrecondition, match="over TCP"):
                await client.acquire(NS, list(range(16)))
    finally:
        await d.stop(1.0)


# ---------------------------------------------------------------------------- hostile clients


async def test_an_oversize_frame_is_refused_naming_the_limit(daemon):
    reader, writer, (status, _, _) = await raw_channel(daemon)
    assert status == 0
    writer.write(FRAME.pack(1 << 30, method_byte("Lookup"), 7))
    status, request_id, body = await read_frame(reader)
    assert (status, request_id) == (SC.INVALID_ARGUMENT.value[0], 7)
    assert "byte limit" in pb.CallError.FromString(body).details
    assert await closed_by_daemon(reader)
    writer.close()
    await still_serves(daemon)


@pytest.mark.parametrize("garbage", [b"\xff" * 64, b"GET / HTTP/1.1\r\n\r\n"])
async def test_garbage_closes_the_channel_and_the_daemon_serves_on(daemon, garbage):
    reader, writer, (status, _, _) = await raw_channel(daemon)
    assert status == 0
    writer.write(garbage)
    assert await closed_by_daemon(reader)
    writer.close()
    assert await eventually(lambda: daemon.datapath.num_channels == 0, 5.0)
    await still_serves(daemon)


async def test_a_body_that_does_not_parse_is_invalid_argument(daemon):
    reader, writer, _ = await raw_channel(daemon)
    writer.write(encode_frame(method_byte("Lookup"), 3, b"\xff\xff\xff"))
    status, request_id, body = await read_frame(reader)
    assert (status, request_id) == (SC.INVALID_ARGUMENT.value[0], 3)
    assert "does not parse" in pb.CallError.FromString(body).details
    writer.write(lookup_frame(4, list(range(16))))  # the channel serves on
    status, request_id, _ = await read_frame(reader)
    assert (status, request_id) == (0, 4)
    writer.close()


@pytest.mark.parametrize("prefix", [b"\x01", b"\xff\x00abc", b"\x03\x00\xff\xfe\xfd",
                                    b"\x05\x00nokey"])
async def test_malformed_call_metadata_is_invalid_argument(daemon, prefix):
    """A frame flagged with metadata whose prefix is short, overlong, not ASCII or not
    key=value is refused by name; the channel serves on."""
    reader, writer, _ = await raw_channel(daemon)
    writer.write(encode_frame(method_byte("Lookup") | METADATA_FLAG, 3, prefix))
    status, request_id, body = await read_frame(reader)
    assert (status, request_id) == (SC.INVALID_ARGUMENT.value[0], 3)
    assert "metadata" in pb.CallError.FromString(body).details
    writer.write(lookup_frame(4, list(range(16))))
    status, request_id, _ = await read_frame(reader)
    assert (status, request_id) == (0, 4)
    writer.close()


async def test_a_frame_with_metadata_is_answered_like_one_without(daemon):
    reader, writer, _ = await raw_channel(daemon)
    request = pb.LookupRequest(namespace=namespace_to_proto(NS),
                               tokens=tokens_to_bytes(list(range(32))), packed=True)
    writer.write(encode_call("Lookup", 5, request.SerializeToString(),
                             (("x-kvstore-request-id", "req-1"),)))
    status, request_id, body = await read_frame(reader)
    assert (status, request_id) == (0, 5)
    assert pb.LookupResponse.FromString(body).num_tokens == 32
    writer.close()


async def test_a_half_sent_frame_blocks_no_other_channel_and_is_dropped(daemon):
    reader, writer, _ = await raw_channel(daemon)
    writer.write(lookup_frame(1, list(range(16)))[:FRAME.size + 3])
    await writer.drain()
    await still_serves(daemon)  # meanwhile
    assert await closed_by_daemon(reader)  # within the idle bound
    writer.close()


async def test_frames_in_flight_are_bounded_per_channel(daemon):
    reader, writer, _ = await raw_channel(daemon)
    num_frames = 3 * MAX_FRAMES_IN_FLIGHT
    writer.write(b"".join(lookup_frame(i + 1, list(range(16))) for i in range(num_frames)))
    await writer.drain()
    ids = {(await read_frame(reader))[1] for _ in range(num_frames)}
    assert ids == set(range(1, num_frames + 1))
    assert daemon.datapath.calls.most_in_flight == MAX_FRAMES_IN_FLIGHT
    writer.close()


async def test_channels_per_tenant_are_bounded(daemon):
    held = [await raw_channel(daemon) for _ in range(MAX_CHANNELS_PER_TENANT)]
    assert all(answer[0] == 0 for _, _, answer in held)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await open_ticket(daemon, "acme")
    assert info.value.code() == SC.RESOURCE_EXHAUSTED
    # that tenant's calls go over gRPC; another tenant still opens one
    await still_serves(daemon)
    _, other, (status, _, _) = await raw_channel(daemon, "umbrella")
    assert status == 0
    for _, writer, _ in held:
        writer.close()
    other.close()
    assert await eventually(lambda: daemon.datapath.num_channels == 0, 5.0)


async def test_a_tenants_frames_in_flight_share_one_byte_budget():
    """Bodies in flight are bounded per tenant, across its channels: a body that does not fit
    waits, unread, until earlier calls gave their bytes back; one alone always fits."""
    from kvstore.server.channel import FrameBudget

    budget = FrameBudget(100)
    await budget.take(60)
    second = asyncio.ensure_future(budget.take(60))
    await asyncio.sleep(0.05)
    assert not second.done() and budget.used == 60
    budget.give(60)
    await asyncio.wait_for(second, 1.0)
    assert budget.used == 60
    budget.give(60)
    await asyncio.wait_for(budget.take(250), 1.0)  # larger than the budget, but alone


async def test_each_tenant_has_its_channels_budget(daemon):
    from kvstore.server.data_socket import CHANNEL_FRAMES_PER_TENANT

    a1, a2, b = (await raw_channel(daemon), await raw_channel(daemon),
                 await raw_channel(daemon, "umbrella"))
    budgets = daemon.datapath._budgets
    assert set(budgets) == {"acme", "umbrella"} and budgets["acme"] is not budgets["umbrella"]
    largest = daemon.datapath._max_frame_bytes
    assert budgets["acme"].max_bytes == CHANNEL_FRAMES_PER_TENANT * largest
    for reader, writer, _ in (a1, a2):
        writer.write(lookup_frame(7, list(range(32))))
        assert (await read_frame(reader))[:2] == (0, 7)
    assert budgets["acme"].used == 0  # given back once each call was answered
    for _, writer, _ in (a1, a2, b):
        writer.close()
    assert await eventually(lambda: not daemon.datapath._budgets, 5.0)


async def test_an_async_client_whose_channel_broke_calls_on_and_opens_another(daemon):
    async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as client:
        assert (await client.lookup(NS, list(range(32)))).num_tokens == 32
        first = client._transport.channel
        first._writer.transport.abort()  # the connection goes, as in a daemon restart
        results = await asyncio.gather(*(client.lookup(NS, list(range(32)))
                                         for _ in range(8)))
        assert all(r.num_tokens == 32 for r in results)  # over gRPC, where it broke under them
        assert first.closed
        assert (await client.lookup(NS, list(range(32)))).num_tokens == 32
        assert client._transport.channel is not first and not client._transport.channel.closed
        assert await eventually(lambda: daemon.datapath.num_channels == 1, 5.0)


async def test_a_long_frame_body_is_read_in_pieces_a_turn_apart():
    """Regression (issue 28, item 7): a 4 MB Lookup frame (1M tokens) came out of the stream's
    buffer in one copy, 2-3 ms of one loop turn. Now a body past ``BODY_PIECE_BYTES`` is read
    in pieces with a turn between them, and arrives whole; a stream that ends first raises."""
    length = 5 * BODY_PIECE_BYTES + 123
    data = bytes(range(256)) * (length // 256) + bytes(length % 256)
    reader = asyncio.StreamReader(limit=1 << 30)
    reader.feed_data(data)
    turns = 0

    async def tick() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    ticker = asyncio.get_running_loop().create_task(tick())
    body = await _read_body(reader, length)
    ticker.cancel()
    assert bytes(body) == data and turns >= 4  # 6 pieces
    short = asyncio.StreamReader()
    short.feed_data(data[:BODY_PIECE_BYTES + 1])
    short.feed_eof()
    with pytest.raises(asyncio.IncompleteReadError):
        await _read_body(short, length)
    small = asyncio.StreamReader()
    small.feed_data(b"abc")
    assert await _read_body(small, 3) == b"abc"
