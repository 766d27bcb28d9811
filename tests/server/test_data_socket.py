"""The socket data path against a real daemon: Put and Get bytes over the data socket under
one-time tickets, and what hostile clients of that socket can and cannot make the daemon do."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

from kvstore.client import NO_RETRY, AsyncClient
from kvstore.errors import PermissionDenied
from kvstore.keys import Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.framing import encode_hello
from kvstore.rpc.tensors import tensor_header
from kvstore.server.daemon import serve
from kvstore.spec import KVSpec

from .helpers import MiB, small_config
from .hostile import SC, eventually

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16)  # 16 KiB blocks
NS = Namespace(model_id="datapath/m", spec=SPEC, tenant="acme")
IDLE_S = 0.5  # stream_idle_timeout_s: how long the daemon waits on a silent data connection
TOKENS = {"acme": "tok-acme", "umbrella": "tok-umbrella"}


def kv_for(num_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.shape(num_tokens), generator=gen).to(torch.bfloat16)


def tokens_for(num_tokens: int, base: int = 0) -> list[int]:
    return list(range(base, base + num_tokens))


def put_header(tokens: list[int], kv: torch.Tensor, ns: Namespace = NS) -> pb.PutHeader:
    return pb.PutHeader(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                        tensor=tensor_header(kv))


def kv_bytes(kv: torch.Tensor) -> bytes:
    return kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
async def daemon(root):
    d = await serve(small_config(root, dram_bytes=64 * MiB, stream_idle_timeout_s=IDLE_S))
    yield d
    await d.stop(1.0)


@pytest.fixture
async def auth_daemon(root):
    d = await serve(small_config(root, dram_bytes=64 * MiB, stream_idle_timeout_s=IDLE_S,
                                 tenant_tokens=TOKENS, require_auth_on_unix=True,
                                 tcp_address="127.0.0.1:0"))
    yield d
    await d.stop(1.0)


@pytest.fixture
async def stub(daemon):
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        yield pbg.KVStoreStub(channel)


def metadata(tenant: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),) if tenant else ()


async def finish_put(stub, ticket: pb.DataTicket, tenant: str | None = None
                     ) -> tuple[SC, str, int]:
    """Complete a data-socket Put: (status, details, tokens written)."""
    async def one():
        yield pb.PutRequest(header=pb.PutHeader(ticket=ticket.ticket))
    try:
        response = await stub.Put(one(), metadata=metadata(tenant), timeout=30)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or "", 0
    return SC.OK, "", response.tokens_written


async def send(path: str, data: bytes, close: bool = True):
    """Open a data connection, write ``data``, half-close unless told not to; the streams."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(data)
    await writer.drain()
    if close:
        writer.write_eof()
    return reader, writer


async def closed_by_daemon(reader: asyncio.StreamReader) -> bool:
    """Whether the daemon closes the connection (without sending anything) in time; closing
    with the client's bytes unread resets it."""
    try:
        return await asyncio.wait_for(reader.read(), 10 * IDLE_S) == b""
    except ConnectionResetError:
        return True


def settled(daemon) -> bool:
    """No ticket left and no byte of the budget held."""
    return daemon.datapath.num_transfers == 0 and daemon.datapath.pending_bytes == 0


# ---------------------------------------------------------------------------- what works


async def test_put_and_get_move_their_bytes_over_the_data_socket(daemon):
    kv, tokens = kv_for(64), tokens_for(64)
    async with AsyncClient(daemon.unix_address, zero_copy=False, retry=NO_RETRY) as client:
        assert await client.put(NS, tokens, kv) == 64
        got = await client.get(NS, tokens + [7, 7, 7])
    assert torch.equal(got, kv)
    assert daemon.datapath.bytes_moved == 2 * kv.numel() * 2
    assert settled(daemon)


async def test_blocking_client_uses_the_data_socket_and_streams_without_it(daemon):
    from kvstore.client import Client

    kv, tokens = kv_for(32, seed=1), tokens_for(32, base=1000)

    def roundtrip(data_socket: bool) -> torch.Tensor:
        with Client(daemon.unix_address, zero_copy=False, data_socket=data_socket,
                    retry=NO_RETRY) as client:
            client.put(NS, tokens, kv)
            return client.get(NS, tokens)

    assert torch.equal(await asyncio.to_thread(roundtrip, True), kv)
    moved = daemon.datapath.bytes_moved
    assert moved == 2 * kv.numel() * 2
    assert torch.equal(await asyncio.to_thread(roundtrip, False), kv)
    assert daemon.datapath.bytes_moved == moved  # streamed in gRPC messages this time


async def test_client_streams_when_the_daemon_offers_no_data_socket(root):
    d = await serve(small_config(root, dram_bytes=64 * MiB, data_socket=False))
    try:
        assert d.datapath is None
        kv, tokens = kv_for(32, seed=2), tokens_for(32)
        async with AsyncClient(d.unix_address, zero_copy=False, retry=NO_RETRY) as client:
            assert await client.put(NS, tokens, kv) == 32
            assert torch.equal(await client.get(NS, tokens), kv)
    finally:
        await d.stop(1.0)


async def test_tcp_client_moves_bytes_over_the_data_port(auth_daemon):
    assert auth_daemon.datapath.tcp_port
    kv, tokens = kv_for(48, seed=3), tokens_for(48)
    async with AsyncClient(auth_daemon.tcp_address, token=TOKENS["acme"], zero_copy=False,
                           retry=NO_RETRY) as client:
        assert await client.put(NS, tokens, kv) == 48
        assert torch.equal(await client.get(NS, tokens), kv)
    assert auth_daemon.datapath.bytes_moved == 2 * kv.numel() * 2
    assert settled(auth_daemon)


# ---------------------------------------------------------------------- hostile clients


async def test_connection_that_sends_nothing_is_dropped_and_stalls_nobody(daemon, stub):
    reader, writer = await send(daemon.datapath.unix_path, b"", close=False)
    kv, tokens = kv_for(32, seed=4), tokens_for(32)
    async with AsyncClient(daemon.unix_address, zero_copy=False, retry=NO_RETRY) as client:
        assert await client.put(NS, tokens, kv) == 32  # while the silent one is connected
        assert torch.equal(await client.get(NS, tokens), kv)
    assert await closed_by_daemon(reader)
    writer.close()
    assert settled(daemon)


async def test_ticket_never_presented_expires_and_gives_its_bytes_back(daemon, stub):
    kv, tokens = kv_for(256), tokens_for(256)
    ticket = await stub.OpenPut(put_header(tokens, kv))
    assert daemon.datapath.pending_bytes == kv.numel() * 2
    assert await eventually(lambda: settled(daemon), 20 * IDLE_S)
    code, details, _ = await finish_put(stub, ticket)
    assert code == SC.NOT_FOUND and "data ticket" in details


async def test_put_waiting_on_a_ticket_nobody_presents_fails_in_time(daemon, stub):
    kv, tokens = kv_for(32), tokens_for(32)
    ticket = await stub.OpenPut(put_header(tokens, kv))
    code, details, _ = await finish_put(stub, ticket)
    assert code == SC.DEADLINE_EXCEEDED and "not presented" in details
    assert settled(daemon)


async def test_disconnect_mid_transfer_fails_the_put_and_frees_its_buffer(daemon, stub):
    kv, tokens = kv_for(128), tokens_for(128)
    ticket = await stub.OpenPut(put_header(tokens, kv))
    data = kv_bytes(kv)
    _reader, writer = await send(daemon.datapath.unix_path,
                                 encode_hello(ticket.ticket, None) + data[: len(data) // 3])
    code, details, _ = await finish_put(stub, ticket)
    writer.close()
    assert code == SC.INVALID_ARGUMENT and f"of {len(data)} declared bytes" in details
    assert settled(daemon)
    assert (await stub.Lookup(pb.LookupRequest(namespace=namespace_to_proto(NS),
                                               tokens=tokens_to_bytes(tokens)))
            ).matched_tokens == 0


async def test_more_bytes_than_declared_fail_the_put(daemon, stub):
    kv, tokens = kv_for(32), tokens_for(32)
    ticket = await stub.OpenPut(put_header(tokens, kv))
    _, writer = await send(daemon.datapath.unix_path,
                           encode_hello(ticket.ticket, None) + kv_bytes(kv) + b"and more")
    code, details, _ = await finish_put(stub, ticket)
    writer.close()
    assert code == SC.INVALID_ARGUMENT and "more than" in details
    assert settled(daemon)


async def test_a_ticket_is_good_for_one_connection_and_one_put(daemon, stub):
    kv, tokens = kv_for(32), tokens_for(32)
    ticket = await stub.OpenPut(put_header(tokens, kv))
    hello = encode_hello(ticket.ticket, None)
    _, first = await send(daemon.datapath.unix_path, hello + kv_bytes(kv))
    assert (await finish_put(stub, ticket))[0::2] == (SC.OK, 32)
    again, second = await send(daemon.datapath.unix_path, hello + kv_bytes(kv))
    assert await closed_by_daemon(again)  # spent: nothing is read into anything
    first.close(), second.close()
    code, _, _ = await finish_put(stub, ticket)
    assert code == SC.NOT_FOUND
    assert settled(daemon)


async def test_garbage_on_the_data_socket_is_dropped(daemon, stub):
    reader, writer = await send(daemon.datapath.unix_path, b"GET / HTTP/1.1\r\n" * 8)
    assert await closed_by_daemon(reader)
    writer.close()
    guessed = encode_hello(bytes(32), None) + b"x" * 1024  # a ticket nobody was given
    reader, writer = await send(daemon.datapath.unix_path, guessed)
    assert await closed_by_daemon(reader)
    writer.close()
    assert (await stub.Health(pb.HealthRequest())).status == "SERVING"


async def test_ticket_is_bound_to_the_tenant_it_went_to(auth_daemon):
    kv, tokens = kv_for(32), tokens_for(32)
    async with grpc.aio.insecure_channel(auth_daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        ticket = await stub.OpenPut(put_header(tokens, kv), metadata=metadata("acme"))
        # another tenant may neither complete it nor present it on the data socket
        assert (await finish_put(stub, ticket, "umbrella"))[0] == SC.PERMISSION_DENIED
        _, writer = await send(auth_daemon.datapath.unix_path,
                               encode_hello(ticket.ticket, TOKENS["umbrella"]) + kv_bytes(kv))
        code, details, _ = await finish_put(stub, ticket, "acme")
        writer.close()
    assert code == SC.PERMISSION_DENIED and "another caller" in details
    assert settled(auth_daemon)


async def test_ticket_asked_for_over_tcp_is_refused_on_the_unix_data_socket(auth_daemon):
    kv, tokens = kv_for(32), tokens_for(32)
    async with grpc.aio.insecure_channel(auth_daemon.tcp_address) as channel:
        stub = pbg.KVStoreStub(channel)
        ticket = await stub.OpenPut(put_header(tokens, kv), metadata=metadata("acme"))
        assert ticket.tcp_port == auth_daemon.datapath.tcp_port and not ticket.unix_path
        _, writer = await send(auth_daemon.datapath.unix_path,
                               encode_hello(ticket.ticket, TOKENS["acme"]) + kv_bytes(kv))
        code, details, _ = await finish_put(stub, ticket, "acme")
        writer.close()
    assert code == SC.PERMISSION_DENIED and "issued over" in details


async def test_tenant_client_is_refused_a_foreign_namespace_before_any_ticket(auth_daemon):
    foreign = Namespace(model_id="datapath/m", spec=SPEC, tenant="umbrella")
    async with AsyncClient(auth_daemon.unix_address, token=TOKENS["acme"], zero_copy=False,
                           retry=NO_RETRY) as client:
        with pytest.raises(PermissionDenied):
            await client.put(foreign, tokens_for(32), kv_for(32))
    assert settled(auth_daemon)


async def _get_ticket(stub, tokens: list[int]):
    call = stub.Get(pb.GetRequest(namespace=namespace_to_proto(NS),
                                  tokens=tokens_to_bytes(tokens), data_socket=True))
    first = await call.read()
    assert first.header.HasField("data")
    return call, first.header.data


async def test_get_reader_that_never_reads_is_dropped(daemon, stub):
    # 32 MiB: more than a widened Unix socket holds (datapath.UNIX_BUFFER_BYTES)
    kv, tokens = kv_for(32768), tokens_for(32768)
    async with AsyncClient(daemon.unix_address, zero_copy=False, retry=NO_RETRY) as client:
        await client.put(NS, tokens, kv)
    call, ticket = await _get_ticket(stub, tokens)
    _reader, writer = await send(daemon.datapath.unix_path, encode_hello(ticket.ticket, None),
                                 close=False)
    try:
        await call.read()
    except grpc.aio.AioRpcError as err:
        assert err.code() == SC.DEADLINE_EXCEEDED
    else:
        pytest.fail("a Get whose reader never read completed")
    writer.close()
    assert await eventually(lambda: settled(daemon), 20 * IDLE_S)
    # its pages were sent from where they lie, pinned: a dropped reader unpins them
    assert await daemon.store.evict(model_id=NS.model_id) == 2048


async def test_get_cancelled_by_its_caller_gives_its_tensor_back(daemon, stub):
    kv, tokens = kv_for(64), tokens_for(64)
    async with AsyncClient(daemon.unix_address, zero_copy=False, retry=NO_RETRY) as client:
        await client.put(NS, tokens, kv)
    call, ticket = await _get_ticket(stub, tokens)
    assert daemon.datapath.num_transfers == 1
    call.cancel()
    assert await eventually(lambda: settled(daemon), 20 * IDLE_S)
    reader, writer = await send(daemon.datapath.unix_path, encode_hello(ticket.ticket, None))
    assert await closed_by_daemon(reader)  # nothing left to send
    writer.close()
    assert await daemon.store.evict(model_id=NS.model_id) == 4  # its pages are unpinned


async def test_pages_that_must_be_decoded_are_sent_from_a_decoded_tensor(root):
    """Raw DRAM pages go out from where they lie; fp8 pages cannot: the daemon decodes them
    into a tensor and sends that over the data socket."""
    config = small_config(root, dram_bytes=64 * MiB, stream_idle_timeout_s=IDLE_S)
    config = dataclasses.replace(config, dram=dataclasses.replace(config.dram, codec="fp8_e4m3"))
    d = await serve(config)
    try:
        kv, tokens = kv_for(64, seed=3), tokens_for(64, base=500)
        async with AsyncClient(d.unix_address, zero_copy=False, retry=NO_RETRY) as client:
            assert await client.put(NS, tokens, kv) == 64
            got = await client.get(NS, tokens)
        assert ((got.float() - kv.float()).norm() / kv.float().norm()).item() < 0.1
        assert d.datapath.bytes_moved == 2 * kv.numel() * 2
        assert settled(d)
    finally:
        await d.stop(1.0)


async def test_client_streams_a_put_while_every_ticket_is_taken(root):
    d = await serve(small_config(root, dram_bytes=64 * MiB, stream_idle_timeout_s=5.0,
                                 max_data_transfers=1))
    try:
        async with grpc.aio.insecure_channel(d.unix_address) as channel:
            hog = await pbg.KVStoreStub(channel).OpenPut(put_header(tokens_for(16), kv_for(16)))
            assert hog.ticket and d.datapath.num_transfers == 1
            kv, tokens = kv_for(32, seed=5), tokens_for(32, base=500)
            async with AsyncClient(d.unix_address, zero_copy=False, retry=NO_RETRY) as client:
                assert await client.put(NS, tokens, kv) == 32  # streamed instead
                assert torch.equal(await client.get(NS, tokens), kv)  # streamed as well
        assert d.datapath.bytes_moved == 0
    finally:
        await d.stop(1.0)


async def test_pooled_put_buffers_never_mix_puts(daemon, stub):
    """A Put buffer is reused by the next Put of its size: each stores its own bytes, and a
    transfer that failed halfway leaves nothing of itself in a later one."""
    first, second, third, fourth = (kv_for(64, seed=s) for s in (10, 11, 12, 13))
    async with AsyncClient(daemon.unix_address, zero_copy=False, retry=NO_RETRY) as client:
        await client.put(NS, tokens_for(64, base=0), first)
        ticket = await stub.OpenPut(put_header(tokens_for(64, base=100), second))
        _, writer = await send(daemon.datapath.unix_path, encode_hello(ticket.ticket, None)
                               + kv_bytes(second)[: 1000])
        assert (await finish_put(stub, ticket))[0] == SC.INVALID_ARGUMENT
        writer.close()
        await client.put(NS, tokens_for(64, base=200), third)
        assert daemon.datapath.pooled_bytes == third.numel() * 2  # kept for the next one
        await client.put(NS, tokens_for(64, base=300), fourth)  # into third's buffer
        assert torch.equal(await client.get(NS, tokens_for(64, base=0)), first)
        assert torch.equal(await client.get(NS, tokens_for(64, base=200)), third)
        assert torch.equal(await client.get(NS, tokens_for(64, base=300)), fourth)
        assert await client.get(NS, tokens_for(64, base=100)) is None
    assert settled(daemon)


async def test_one_tenant_hogging_tickets_never_shuts_another_out(root):
    """acme opens Put tickets and never presents them, as many as the daemon lets it: it is
    refused (RESOURCE_EXHAUSTED) at its share, about half of server.max_data_transfers, so
    umbrella still gets tickets, and its client puts and gets over the data socket while
    acme's tickets are held; a third tenant-sized share is left after both hog."""
    d = await serve(small_config(root, dram_bytes=64 * MiB, stream_idle_timeout_s=30.0,
                                 tenant_tokens=TOKENS, require_auth_on_unix=True,
                                 max_data_transfers=8))
    umbrella_ns = Namespace(model_id="datapath/m", spec=SPEC, tenant="umbrella")
    try:
        async with grpc.aio.insecure_channel(d.unix_address) as channel:
            stub = pbg.KVStoreStub(channel)

            async def hog(tenant: str, ns: Namespace) -> int:
                for i in range(8):
                    try:
                        await stub.OpenPut(put_header(tokens_for(16, base=100 * i), kv_for(16),
                                                      ns), metadata=metadata(tenant))
                    except grpc.aio.AioRpcError as err:
                        assert err.code() == SC.RESOURCE_EXHAUSTED and "share" in err.details()
                        return i
                return 8

            assert await hog("acme", NS) == 4
            kv, tokens = kv_for(32, seed=8), tokens_for(32, base=900)
            moved = d.datapath.bytes_moved
            async with AsyncClient(d.unix_address, token=TOKENS["umbrella"], zero_copy=False,
                                   retry=NO_RETRY) as umbrella:
                assert await umbrella.put(umbrella_ns, tokens, kv) == 32
                assert torch.equal(await umbrella.get(umbrella_ns, tokens), kv)
            assert d.datapath.bytes_moved == moved + 2 * kv.numel() * 2  # not streamed
            assert await hog("umbrella", umbrella_ns) == 2  # half of the 4 acme left
            assert d.datapath.num_transfers == 6  # 2 still free for a tenant holding none
    finally:
        await d.stop(1.0)
