"""Hostile requests against a real daemon on a real socket: declared sizes are checked before
anything is allocated, buffers grow only as bytes arrive and go when a put fails, nothing of an
unauthenticated caller's body is read, token counts are capped, zero-copy grants stay on the
Unix socket, and error messages quote client strings only in part.

Memory is measured on a daemon subprocess through /proc/<pid>/status (VmRSS now, VmHWM peak),
with bounds far from both the attack's size and the process's own noise.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvstore.client import NO_RETRY, AsyncClient
from kvstore.errors import FailedPrecondition
from kvstore.keys import Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.tensors import tensor_header
from kvstore.server.daemon import serve
from kvstore.spec import KVSpec

from ..conftest import random_kv, random_tokens
from ..server.helpers import rpc_calls, small_config
from ..server.hostile import (
    HEAVY_NS,
    SC,
    MiB,
    Stream,
    daemon_process,
    eventually,
    free_port,
    heavy_header,
    method,
    outcome,
    put_call,
    rpc_errors,
    status_line,
)

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}
NOISE_BYTES = 64 * MiB  # what a daemon's peak may grow by for reasons of its own
# After a big put the daemon stays this much above where it started: glibc keeps freed heap
# chunks (the daemon raises M_TRIM_THRESHOLD, daemon.tune_malloc), so the 4 MiB chunk
# messages stay resident; the put's buffer itself is mmapped and goes back whole.
RETAINED_HEAP_BYTES = 128 * MiB


async def test_declared_size_over_the_bound_is_refused_naming_both(root):
    """A header declaring 1 TiB is refused from the header alone (allocating it would kill
    the daemon), RESOURCE_EXHAUSTED with the declared size and the bound in the details."""
    spec = KVSpec(num_layers=1024, num_kv_heads=64, head_dim=1024, block_tokens=16,
                  dtype="float32")  # 512 MiB per token
    ns = Namespace(model_id="m", spec=spec, tenant="acme")
    daemon = await serve(small_config(root))
    try:
        header = pb.PutRequest(header=pb.PutHeader(
            namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(random_tokens(2048)),
            tensor=pb.TensorHeader(dtype="float32", shape=list(spec.shape(2048)),
                                   total_bytes=2048 * (512 * MiB))))
        async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
            stream = Stream()
            stream.send(header)
            code, details = await outcome(put_call(channel, stream))
            assert code == SC.RESOURCE_EXHAUSTED
            assert str(1 << 40) in details and str(256 * MiB) in details, details
            assert (await AsyncClient(daemon.unix_address).health()).status == "SERVING"
    finally:
        await daemon.stop(1.0)


async def test_declared_gigabytes_with_no_bytes_cost_nothing(root):
    """Four streams each declare a 1 GiB tensor and send nothing else for a second: the
    daemon's peak memory stays within noise (a preallocated buffer would add 4 GiB). A second
    header then proves each declaration was accepted and read before the stream was refused."""
    with daemon_process(root, dram_bytes=2 << 30) as proc:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = pbg.KVStoreStub(channel)
            await stub.Health(pb.HealthRequest())
            base = status_line(proc.proc.pid, "VmHWM")
            streams = [Stream() for _ in range(4)]
            calls = []
            for i, stream in enumerate(streams):
                stream.send(heavy_header(8192, seed=i))  # 8192 tokens x 128 KiB = 1 GiB
                calls.append(asyncio.ensure_future(outcome(put_call(channel, stream))))
            await asyncio.sleep(1.0)
            for i, stream in enumerate(streams):
                stream.send(heavy_header(16, seed=i))
            results = await asyncio.gather(*calls)
            assert all(code == SC.INVALID_ARGUMENT and "only chunks" in details
                       for code, details in results), results
            grown = status_line(proc.proc.pid, "VmHWM") - base
            assert grown < NOISE_BYTES, f"peak grew by {grown >> 20} MiB"
            assert (await stub.Health(pb.HealthRequest())).status == "SERVING"


async def test_failed_put_gives_its_buffer_back_at_once(root):
    """320 MiB of a declared 512 MiB arrive (resident memory rises by them), then a malformed
    message fails the put: within seconds the daemon has given the buffer back (it is
    under RETAINED_HEAP_BYTES above where it started, far below the 320 MiB)."""
    with daemon_process(root, dram_bytes=1 << 30) as proc:
        pid = proc.proc.pid
        async with grpc.aio.insecure_channel(proc.address) as channel:
            await pbg.KVStoreStub(channel).Health(pb.HealthRequest())
            base = status_line(pid, "VmRSS")
            stream = Stream()
            stream.send(heavy_header(4096))  # 512 MiB declared
            call = asyncio.ensure_future(outcome(put_call(channel, stream)))
            for _ in range(80):
                stream.send(pb.PutRequest(chunk=bytes(4 * MiB)))
            assert await eventually_rss(pid, lambda rss: rss > base + 256 * MiB, 30.0), \
                "the bytes never arrived"
            stream.send(heavy_header(16))
            code, details = await call
            assert code == SC.INVALID_ARGUMENT and "only chunks" in details
            # a bound on liveness, not a timing: generous, for a box busy with other tests
            assert await eventually_rss(pid, lambda rss: rss < base + RETAINED_HEAP_BYTES, 20.0), \
                f"still {(status_line(pid, 'VmRSS') - base) >> 20} MiB above the start"


async def eventually_rss(pid: int, predicate, timeout_s: float) -> bool:
    return await eventually(lambda: predicate(status_line(pid, "VmRSS")), timeout_s)


async def test_unauthenticated_bodies_are_never_read(root):
    """Over TCP, a caller without a valid token sends a Put with a 128 MiB chunk and a Lookup
    whose message is 128 MiB: the daemon answers both UNAUTHENTICATED (its own metrics say
    so) and its peak memory does not grow by them. The same Put with a valid token does grow
    it (the probe can see it).

    The Put's client may see INTERNAL instead: the daemon resets the stream it refused while
    the client is still pushing the chunk, and the client's core can report the reset first.
    """
    port = free_port()
    with daemon_process(root, tcp_address="127.0.0.1:0", tenant_tokens=TOKENS,
                        metrics_port=port) as proc:
        pid = proc.proc.pid
        async with grpc.aio.insecure_channel(proc.tcp_address()) as channel:
            stub = pbg.KVStoreStub(channel)
            acme = (("authorization", "Bearer tok-acme"),)
            await stub.Health(pb.HealthRequest(), metadata=acme)  # warm the TCP path
            base = status_line(pid, "VmHWM")

            def big_put(token: str | None):
                stream = Stream()
                stream.send(heavy_header(1536))  # 192 MiB declared
                stream.send(pb.PutRequest(chunk=bytes(128 * MiB)))
                stream.close()
                return outcome(put_call(channel, stream, token))

            lookup = stub.Lookup(pb.LookupRequest(namespace=namespace_to_proto(HEAVY_NS),
                                                  tokens=bytes(128 * MiB)),
                                 metadata=(("authorization", "Bearer wrong"),))
            (put_code, _), lookup_result = await big_put(None), await outcome(lookup)
            assert put_code in (SC.UNAUTHENTICATED, SC.INTERNAL), put_code
            assert lookup_result[0] == SC.UNAUTHENTICATED, lookup_result
            # a refused call is counted just after its status goes out: poll (5 s liveness)
            answered: dict = {}
            for _ in range(50):
                answered = await asyncio.to_thread(rpc_errors, port)
                if {("Put", "UNAUTHENTICATED"), ("Lookup", "UNAUTHENTICATED")} <= set(answered):
                    break
                await asyncio.sleep(0.1)
            assert answered.get(("Put", "UNAUTHENTICATED")) == 1, answered
            assert answered.get(("Lookup", "UNAUTHENTICATED")) == 1, answered
            grown = status_line(pid, "VmHWM") - base
            assert grown < NOISE_BYTES, f"peak grew by {grown >> 20} MiB"

            code, details = await big_put("tok-acme")  # read in full, then short of 192 MiB
            assert code == SC.INVALID_ARGUMENT and "stream ended after" in details
            assert status_line(pid, "VmHWM") - base > 100 * MiB


@pytest.fixture
async def capped_daemon(root):
    """Unix socket and TCP (tokens), at most 1024 tokens per request."""
    daemon = await serve(small_config(root, tcp_address="127.0.0.1:0", tenant_tokens=TOKENS,
                                      max_request_tokens=1024))
    yield daemon
    await daemon.stop(1.0)


async def test_token_count_over_the_cap_is_refused_before_the_store(capped_daemon, ns, spec):
    """1025 tokens: INVALID_ARGUMENT naming the count and the cap, on every RPC that takes
    tokens, and the store never sees the call (its counters stay at zero); 1024 pass. An
    Evict naming more keys than one listing can show is refused the same way."""
    over, at_cap = tokens_to_bytes(random_tokens(1025)), tokens_to_bytes(random_tokens(1024))
    good_ns = namespace_to_proto(ns)
    kv = random_kv(spec, 1025)

    async with grpc.aio.insecure_channel(capped_daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        stream = Stream()
        stream.send(pb.PutRequest(header=pb.PutHeader(namespace=good_ns, tokens=over,
                                                      tensor=tensor_header(kv))))
        stream.close()

        async def drain_get():
            return [m async for m in stub.Get(pb.GetRequest(namespace=good_ns, tokens=over))]

        calls = {
            "Lookup": stub.Lookup(pb.LookupRequest(namespace=good_ns, tokens=over)),
            "Get": drain_get(),
            "Put": put_call(channel, stream),
            "Reserve": stub.Reserve(pb.ReserveRequest(namespace=good_ns, tokens=over)),
            "Acquire": stub.Acquire(pb.AcquireRequest(namespace=good_ns, tokens=over)),
            "Hint": stub.Hint(pb.HintRequest(namespace=good_ns, tokens=over, deadline_s=1)),
        }
        for name, call in calls.items():
            code, details = await outcome(call)
            assert code == SC.INVALID_ARGUMENT, (name, code, details)
            assert "1025 tokens" in details and "1024" in details, (name, details)
            assert "server.max_request_tokens" in details, (name, details)
        counters = capped_daemon.store.stats().counters
        assert (counters.lookups, counters.puts, counters.gets) == (0, 0, 0)
        assert capped_daemon.store.stats().active_reservations == 0
        await stub.Lookup(pb.LookupRequest(namespace=good_ns, tokens=at_cap))
        assert capped_daemon.store.stats().counters.lookups == 1
        code, details = await outcome(stub.Evict(pb.EvictRequest(keys=[bytes(16)] * 100_001)))
        assert code == SC.INVALID_ARGUMENT and "at most 100000" in details, details


def _calls_of(daemon, method_name: str) -> float:
    return float(rpc_calls(daemon, method_name))


async def test_zero_copy_grants_are_refused_over_tcp(capped_daemon, ns, spec):
    """A tenant over TCP asking for arena slots or a lease gets FAILED_PRECONDITION telling
    it to stream instead; the same tenant on the Unix socket gets them. A TCP client in auto
    mode streams and never asks; one that insists on zero-copy gets FailedPrecondition."""
    good_ns, tokens = namespace_to_proto(ns), tokens_to_bytes(random_tokens(32))
    acme = (("authorization", "Bearer tok-acme"),)
    async with grpc.aio.insecure_channel(capped_daemon.tcp_address) as channel:
        stub = pbg.KVStoreStub(channel)
        code, details = await outcome(stub.Reserve(
            pb.ReserveRequest(namespace=good_ns, tokens=tokens), metadata=acme))
        assert code == SC.FAILED_PRECONDITION and "use Put" in details, details
        code, details = await outcome(stub.Acquire(
            pb.AcquireRequest(namespace=good_ns, tokens=tokens), metadata=acme))
        assert code == SC.FAILED_PRECONDITION and "use Get" in details, details
    assert capped_daemon.store.stats().active_reservations == 0
    async with grpc.aio.insecure_channel(capped_daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        reservation = await stub.Reserve(pb.ReserveRequest(namespace=good_ns, tokens=tokens),
                                         metadata=acme)
        await stub.Abort(pb.AbortRequest(reservation_id=reservation.reservation_id),
                         metadata=acme)

    before = {m: _calls_of(capped_daemon, m) for m in ("Reserve", "Acquire")}
    tokens_list, kv = random_tokens(48, seed=3), random_kv(spec, 48, seed=3)
    async with AsyncClient(capped_daemon.tcp_address, token="tok-acme", retry=NO_RETRY) as tcp:
        assert await tcp.put(ns, tokens_list, kv) == 48
        got = await tcp.get(ns, tokens_list)
        assert got is not None and got.equal(kv)
        assert {m: _calls_of(capped_daemon, m) for m in before} == before
        with pytest.raises(FailedPrecondition, match="use Put"):
            await tcp.put(ns, random_tokens(32, seed=4), random_kv(spec, 32), zero_copy=True)


MEGA = "x" * (1 << 20)


def _error_cases(ns) -> dict[str, tuple[SC, object]]:
    """Requests that quote a 1 MB client string if anything does, with their status."""
    def ns_with(**fields) -> pb.Namespace:
        msg = namespace_to_proto(ns)
        for name, value in fields.items():
            target = msg.spec if name.startswith("spec_") else msg
            setattr(target, name.removeprefix("spec_"), value)
        return msg

    tokens = tokens_to_bytes(random_tokens(32))
    huge_shape = pb.TensorHeader(dtype=ns.spec.dtype, shape=[7] * 100_000, total_bytes=1)
    return {
        "model id": (SC.INVALID_ARGUMENT, ("Lookup", pb.LookupRequest(
            namespace=ns_with(model_id=MEGA), tokens=tokens))),
        "tenant": (SC.INVALID_ARGUMENT, ("Lookup", pb.LookupRequest(
            namespace=ns_with(tenant=MEGA), tokens=tokens))),
        "spec dtype": (SC.INVALID_ARGUMENT, ("Lookup", pb.LookupRequest(
            namespace=ns_with(spec_dtype=MEGA), tokens=tokens))),
        "position scheme": (SC.INVALID_ARGUMENT, ("Lookup", pb.LookupRequest(
            namespace=ns_with(spec_position_scheme=MEGA), tokens=tokens))),
        "tensor dtype": (SC.INVALID_ARGUMENT, ("Put", pb.PutHeader(
            namespace=ns_with(), tokens=tokens, tensor=pb.TensorHeader(dtype=MEGA)))),
        "tensor shape": (SC.INVALID_ARGUMENT, ("Put", pb.PutHeader(
            namespace=ns_with(), tokens=tokens, tensor=huge_shape))),
        "stats tenant": (SC.PERMISSION_DENIED, ("Stats", pb.StatsRequest(tenant=MEGA))),
        "listing tier": (SC.INVALID_ARGUMENT, ("ListBlocks", pb.ListBlocksRequest(tier=MEGA))),
        "lease id": (SC.NOT_FOUND, ("Release", pb.ReleaseRequest(lease_id=MEGA))),
        "reservation id": (SC.NOT_FOUND, ("Commit", pb.CommitRequest(reservation_id=MEGA))),
        "abort id": (SC.NOT_FOUND, ("Abort", pb.AbortRequest(reservation_id=MEGA))),
        "block key": (SC.INVALID_ARGUMENT, ("Evict", pb.EvictRequest(keys=[MEGA.encode()]))),
        "undecodable": (SC.INVALID_ARGUMENT, ("Lookup", b"\x0a\xff\xff\xff\x7f" + bytes(1 << 20))),
    }


async def test_error_details_quote_client_strings_only_in_part(capped_daemon, ns):
    """Each of a dozen requests carrying a 1 MB string (model id, tenant, dtypes, shape,
    tier, lease and reservation ids, key, undecodable bytes) gets its status with details
    under 1 KB."""
    acme = (("authorization", "Bearer tok-acme"),)
    async with grpc.aio.insecure_channel(capped_daemon.unix_address) as channel:
        for what, (want, (rpc, request)) in _error_cases(ns).items():
            if rpc == "Put":
                stream = Stream()
                stream.send(pb.PutRequest(header=request))
                stream.close()
                call = put_call(channel, stream, "tok-acme")
            else:
                serializer = None if isinstance(request, bytes) else type(request).SerializeToString
                call = channel.unary_unary(method(rpc), request_serializer=serializer)(
                    request, metadata=acme, timeout=30)
            code, details = await outcome(call)
            assert code == want, (what, code, details[:200])
            assert len(details.encode()) < 1024, (what, len(details), details[:200])
