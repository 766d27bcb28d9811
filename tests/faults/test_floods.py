"""Floods and stalls against a real daemon: streams that go quiet or trickle are ended, a flood
of connections or calls from one peer leaves other clients served, and the call cap frees up.

Timings decide nothing here except as generous liveness bounds ("answers within 2 s while
..."), each named in its test's docstring.
"""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import numpy as np
import pytest

from kvstore.client import NO_RETRY, AsyncClient
from kvstore.errors import RateLimited
from kvstore.keys import Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import namespace_to_proto
from kvstore.server.daemon import serve
from kvstore.spec import KVSpec

from ..server.helpers import small_config
from ..server.hostile import (
    SC,
    MiB,
    Stream,
    daemon_process,
    eventually,
    heavy_header,
    method,
    num_sockets,
    outcome,
    put_call,
    status_line,
)

LIVENESS_S = 2.0  # "answers within": far above a healthy daemon's milliseconds
RETAINED_HEAP_BYTES = 128 * MiB  # see tests/security/test_request_limits.py


@pytest.fixture
async def quick_daemon(root):
    """Streams end after 0.5 s without progress."""
    daemon = await serve(small_config(root, stream_idle_timeout_s=0.5))
    yield daemon
    await daemon.stop(1.0)


async def test_silent_streams_are_ended(quick_daemon):
    """A Put that sends its header and then nothing, a Put that sends nothing at all, and a
    unary call whose request message never comes each end with DEADLINE_EXCEEDED naming
    server.stream_idle_timeout_s (liveness bound: 10 s for an idle gap of 0.5 s)."""
    async with grpc.aio.insecure_channel(quick_daemon.unix_address) as channel:
        header_only, nothing, no_message = Stream(), Stream(), Stream()
        header_only.send(heavy_header(64))
        health = channel.stream_unary(method("Health"),
                                      request_serializer=pb.HealthRequest.SerializeToString)
        calls = [put_call(channel, header_only), put_call(channel, nothing),
                 health(aiter(no_message), timeout=30)]
        results = await asyncio.wait_for(asyncio.gather(*map(outcome, calls)), 10.0)
        for code, details in results:
            assert code == SC.DEADLINE_EXCEEDED, results
            assert "server.stream_idle_timeout_s" in details, results
        assert (await pbg.KVStoreStub(channel).Health(pb.HealthRequest())).status == "SERVING"


async def test_trickling_stream_is_ended(quick_daemon):
    """16 bytes every 0.1 s (gaps well inside the 0.5 s idle gap) is no progress: the Put is
    ended with DEADLINE_EXCEEDED (liveness bound: 15 s of trickling)."""
    async with grpc.aio.insecure_channel(quick_daemon.unix_address) as channel:
        stream = Stream()
        stream.send(heavy_header(64))
        call = asyncio.ensure_future(outcome(put_call(channel, stream)))
        sent = 0
        stop_at = time.monotonic() + 15.0
        while not call.done() and time.monotonic() < stop_at:
            stream.send(pb.PutRequest(chunk=bytes(16)))
            sent += 1
            await asyncio.sleep(0.1)
        assert call.done(), f"still open after {sent} chunks of 16 bytes"
        code, details = call.result()
        assert code == SC.DEADLINE_EXCEEDED and "no progress" in details, (code, details)


async def test_stalled_put_gives_its_buffer_back(root):
    """256 MiB of a declared 512 MiB arrive, then the client stalls: after the 2 s idle gap the
    stream is ended and the daemon gives the buffer back (resident memory back under
    RETAINED_HEAP_BYTES above the start; liveness bounds 30 s to receive, 30 s to release: a
    machine busy with other test runs has taken over 10 s)."""
    with daemon_process(root, dram_bytes=1 << 30, stream_idle_timeout_s=2.0) as proc:
        pid = proc.proc.pid
        async with grpc.aio.insecure_channel(proc.address) as channel:
            await pbg.KVStoreStub(channel).Health(pb.HealthRequest())
            base = status_line(pid, "VmRSS")
            stream = Stream()
            stream.send(heavy_header(4096))
            for _ in range(64):
                stream.send(pb.PutRequest(chunk=bytes(4 * MiB)))
            call = asyncio.ensure_future(outcome(put_call(channel, stream)))
            assert await eventually(lambda: status_line(pid, "VmRSS") > base + 200 * MiB, 30.0)
            code, details = await asyncio.wait_for(call, 10.0)
            assert code == SC.DEADLINE_EXCEEDED, (code, details)
            assert await eventually(
                lambda: status_line(pid, "VmRSS") < base + RETAINED_HEAP_BYTES, 30.0)


async def test_call_cap_refuses_more_and_frees_when_stalled_calls_end(root):
    """With max_concurrent_rpcs=8, eight stalled Puts fill the daemon: a further call gets
    RESOURCE_EXHAUSTED; once the idle gap (1 s) ends them, Health answers again (liveness
    bounds: 5 s to see the refusal, 10 s to recover)."""
    daemon = await serve(small_config(root, max_concurrent_rpcs=8, stream_idle_timeout_s=1.0))
    try:
        async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
            stub = pbg.KVStoreStub(channel)
            stalled = []
            for i in range(8):
                stream = Stream()
                stream.send(heavy_header(16, seed=i))
                stalled.append(asyncio.ensure_future(outcome(put_call(channel, stream))))
            codes: list[SC] = []

            async def health_code() -> SC:
                return (await outcome(stub.Health(pb.HealthRequest(), timeout=LIVENESS_S)))[0]

            async def refused() -> bool:
                codes.append(await health_code())
                return codes[-1] == SC.RESOURCE_EXHAUSTED

            deadline = time.monotonic() + 5.0
            while not await refused() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert codes[-1] == SC.RESOURCE_EXHAUSTED, codes
            results = await asyncio.wait_for(asyncio.gather(*stalled), 10.0)
            assert {code for code, _ in results} == {SC.DEADLINE_EXCEEDED}, results
            assert await health_code() == SC.OK
    finally:
        await daemon.stop(1.0)


def test_connection_flood_leaves_other_clients_served(root):
    """300 raw TCP connections that never speak HTTP/2, against max_connections=16: the daemon
    holds at most 16 of them, closes the rest at once and the silent ones after the
    handshake timeout (2 s); meanwhile a TCP client connected before the flood and a Unix
    client get Health within 2 s, and afterwards a new TCP client does (liveness bound: every
    flood socket closed within 15 s)."""
    with daemon_process(root, tcp_address="127.0.0.1:0", tenant_tokens={"acme": "tok-acme"},
                        max_connections=16, stream_idle_timeout_s=2.0) as proc:
        pid = proc.proc.pid
        host, port = proc.tcp_address().rsplit(":", 1)

        async def run() -> None:
            async with AsyncClient(proc.tcp_address(), token="tok-acme", retry=NO_RETRY,
                                   timeout_s=LIVENESS_S) as early:
                await early.health()
                base = num_sockets(pid)
                flood = []
                for _ in range(300):
                    sock = socket.socket()
                    try:
                        sock.connect((host, int(port)))
                    except OSError:
                        sock.close()
                        continue
                    sock.setblocking(False)
                    flood.append(sock)
                try:
                    assert len(flood) >= 200
                    async with AsyncClient(proc.address, retry=NO_RETRY,
                                           timeout_s=LIVENESS_S) as local:
                        for _ in range(5):
                            assert (await early.health()).status == "SERVING"
                            assert (await local.health()).status == "SERVING"
                            assert num_sockets(pid) <= base + 16 + 2
                    seen_closed: set[socket.socket] = set()
                    assert await eventually(
                        lambda: all(_closed(sock, seen_closed) for sock in flood), 15.0)
                finally:
                    for sock in flood:
                        sock.close()
            async with AsyncClient(proc.tcp_address(), token="tok-acme", retry=NO_RETRY,
                                   timeout_s=LIVENESS_S) as late:
                assert (await late.health()).status == "SERVING"

        asyncio.run(run())


def _closed(sock: socket.socket, seen: set[socket.socket]) -> bool:
    """Whether the peer closed ``sock`` (remembered in ``seen``); what it sent before, such
    as a settings frame, is read and dropped."""
    if sock in seen:
        return True
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError:
        pass
    seen.add(sock)
    return True


def test_call_flood_is_rate_limited_per_tenant(root):
    """Tenant "flood" calls as fast as 64 concurrent loops can for 3 s against 50 calls/s
    (burst 10): it is answered RESOURCE_EXHAUSTED with a retry hint beyond its budget, and
    gets no more than the budget allows in the time it flooded; tenant "calm" on the same
    daemon gets every Health answered, each within 2 s."""
    tokens = {"flood": "tok-flood", "calm": "tok-calm"}
    with daemon_process(root, tcp_address="127.0.0.1:0", tenant_tokens=tokens,
                        rate_limit_rps=50.0, rate_limit_burst=10) as proc:
        address = proc.tcp_address()
        served, limited, hints, calm_ok = [0], [0], [], [0]

        async def flood_loop(client: AsyncClient, stop_at: float) -> None:
            while time.monotonic() < stop_at:
                try:
                    await client.health()
                    served[0] += 1
                except RateLimited as exc:
                    limited[0] += 1
                    hints.append(exc.retry_after_s)

        async def calm_loop(stop_at: float) -> None:
            async with AsyncClient(address, token="tok-calm", retry=NO_RETRY,
                                   timeout_s=LIVENESS_S) as calm:
                while time.monotonic() < stop_at:
                    assert (await calm.health()).tenant == "calm"
                    calm_ok[0] += 1
                    await asyncio.sleep(0.05)

        async def run() -> float:
            clients = [AsyncClient(address, token="tok-flood", retry=NO_RETRY)
                       for _ in range(4)]
            started = time.monotonic()
            stop_at = started + 3.0
            try:
                await asyncio.gather(calm_loop(stop_at),
                                     *(flood_loop(c, stop_at) for c in clients for _ in range(16)))
            finally:
                for client in clients:
                    await client.aclose()
            return time.monotonic() - started

        elapsed_s = asyncio.run(run())
    assert limited[0] > 0 and all(0 < h <= 1.0 for h in hints), (limited, hints[:5])
    assert served[0] <= 10 + 50.0 * elapsed_s + 1, (served, elapsed_s)
    assert calm_ok[0] >= 10


def test_health_answers_while_maximal_lookups_run(root):
    """Back-to-back Lookups of max_request_tokens (1 Mi) tokens in one-token blocks, the most
    hashing one request can ask for (about 1 s of blake2b; the store hashes long prefixes on
    a worker thread): Health from another client answers within 1 s throughout. (The target
    is 50 ms; that is measured by the benchmark, not asserted.)"""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=1)
    request = pb.LookupRequest(
        namespace=namespace_to_proto(Namespace(model_id="m", spec=spec, tenant="acme")),
        tokens=np.random.default_rng(0).integers(0, 50_000, 1 << 20, dtype="<u4").tobytes())
    with daemon_process(root) as proc:
        async def run() -> list[float]:
            latencies: list[float] = []
            async with grpc.aio.insecure_channel(proc.address) as heavy, \
                    AsyncClient(proc.address, retry=NO_RETRY, timeout_s=30) as probe:
                stop_at = time.monotonic() + 5.0

                async def lookups() -> int:
                    stub, count = pbg.KVStoreStub(heavy), 0
                    while time.monotonic() < stop_at:
                        response = await stub.Lookup(request, timeout=30)
                        assert response.num_tokens == 1 << 20
                        count += 1
                    return count

                task = asyncio.ensure_future(lookups())
                while time.monotonic() < stop_at:
                    start = time.perf_counter()
                    await probe.health()
                    latencies.append(time.perf_counter() - start)
                    await asyncio.sleep(0.05)
                assert await task >= 1
            return latencies

        latencies = asyncio.run(run())
    assert max(latencies) < 1.0, f"Health took up to {max(latencies):.2f} s"
    print(f"Health while maximal lookups ran: n={len(latencies)}, "
          f"max {max(latencies) * 1e3:.0f} ms, median {sorted(latencies)[len(latencies) // 2] * 1e3:.0f} ms")
