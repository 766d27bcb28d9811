"""1,000 malformed requests of many kinds, each answered with the right status; the daemon
keeps serving good requests afterwards."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import grpc
import pytest

from kvstore.client import AsyncClient
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.tensors import tensor_header
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from .helpers import sample_total, small_config

SC = grpc.StatusCode
NUM_REQUESTS = 1000
BATCH = 50


@pytest.fixture
async def strict_daemon(root):
    """Small message limit (1 MiB) so oversize checks are cheap; one tenant token."""
    config = small_config(root, max_message_bytes=1 << 20, tenant_tokens={"acme": "tok-acme"})
    d = await serve(config)
    yield d
    await d.stop(1.0)


def make_cases(ns, spec) -> list[tuple[str, SC, Callable[[pbg.KVStoreStub], Awaitable]]]:
    good_ns = namespace_to_proto(ns)
    tokens32 = tokens_to_bytes(random_tokens(32))
    kv32 = random_kv(spec, 32)

    def ns_with(**fields) -> pb.Namespace:
        msg = namespace_to_proto(ns)
        for name, value in fields.items():
            if name.startswith("spec_"):
                setattr(msg.spec, name[5:], value)
            else:
                setattr(msg, name, value)
        return msg

    def lookup(namespace=good_ns, tokens=tokens32, metadata=()):
        return lambda stub: stub.Lookup(pb.LookupRequest(namespace=namespace, tokens=tokens),
                                        metadata=metadata)

    def put(*messages):
        async def stream():
            for m in messages:
                yield m
        return lambda stub: stub.Put(stream())

    def header(tensor=None, tokens=tokens32, namespace=good_ns):
        return pb.PutRequest(header=pb.PutHeader(namespace=namespace, tokens=tokens,
                                                 tensor=tensor or tensor_header(kv32)))

    def tensor(**fields):
        t = tensor_header(kv32)
        for name, value in fields.items():
            if name == "shape":
                del t.shape[:]
                t.shape.extend(value)
            else:
                setattr(t, name, value)
        return t

    def get(namespace):
        async def drain(stub):
            return [m async for m in stub.Get(pb.GetRequest(namespace=namespace,
                                                            tokens=tokens32))]
        return drain

    chunk = pb.PutRequest(chunk=bytes(64))
    no_spec = pb.Namespace(model_id="m", tenant="acme", tp_size=1)
    many_tokens = tokens_to_bytes(random_tokens(70_000))  # 17 MiB of K/V > the 16 MiB bound
    kv_bytes = kv32.numel() * 2
    IA, NF, RE, UA, PD = (SC.INVALID_ARGUMENT, SC.NOT_FOUND, SC.RESOURCE_EXHAUSTED,
                          SC.UNAUTHENTICATED, SC.PERMISSION_DENIED)
    return [
        ("lookup: no spec", IA, lookup(namespace=no_spec)),
        ("lookup: tokens not uint32", IA, lookup(tokens=b"\x01\x02\x03")),
        ("lookup: empty tokens", IA, lookup(tokens=b"")),
        ("lookup: tp_size 0", IA, lookup(namespace=ns_with(tp_size=0))),
        ("lookup: tp_rank >= tp_size", IA, lookup(namespace=ns_with(tp_rank=3, tp_size=2))),
        ("lookup: empty model", IA, lookup(namespace=ns_with(model_id=""))),
        ("lookup: empty tenant", IA, lookup(namespace=ns_with(tenant=""))),
        ("lookup: tenant too long", IA, lookup(namespace=ns_with(tenant="t" * 300))),
        ("lookup: spec dtype", IA, lookup(namespace=ns_with(spec_dtype="int8"))),
        ("lookup: block_tokens 0", IA, lookup(namespace=ns_with(spec_block_tokens=0))),
        ("lookup: block_tokens huge", IA, lookup(namespace=ns_with(spec_block_tokens=5000))),
        ("lookup: zero layers", IA, lookup(namespace=ns_with(spec_num_layers=0))),
        ("lookup: malformed auth", UA, lookup(metadata=(("authorization", "Basic abc"),))),
        ("lookup: unknown token", UA, lookup(metadata=(("authorization", "Bearer nope"),))),
        ("lookup: foreign tenant", PD,
         lookup(namespace=ns_with(tenant="zeta"),
                metadata=(("authorization", "Bearer tok-acme"),))),
        ("put: empty stream", IA, put()),
        ("put: chunk first", IA, put(chunk)),
        ("put: two headers", IA, put(header(), header())),
        ("put: dtype mismatch", IA, put(header(tensor(dtype="float16")))),
        ("put: unknown dtype", IA, put(header(tensor(dtype="qint4")))),
        ("put: wrong shape", IA, put(header(tensor(shape=[2, 2, 32, 2, 8])))),
        ("put: wrong byte count", IA, put(header(tensor(total_bytes=7)))),
        ("put: short stream", IA, put(header(), chunk)),
        ("put: long stream", IA, put(header(), pb.PutRequest(chunk=bytes(kv_bytes + 1)))),
        ("put: bad namespace", IA, put(header(namespace=ns_with(spec_head_dim=0)))),
        ("put: too large for DRAM", RE,
         put(header(tokens=many_tokens, tensor=tensor(shape=list(spec.shape(70_000)),
                                                      total_bytes=70_000 * 256)))),
        ("get: no spec", IA, get(no_spec)),
        ("get: bad dtype", IA, get(ns_with(spec_dtype="float64"))),
        ("evict: no filter", IA, lambda s: s.Evict(pb.EvictRequest())),
        ("evict: short key", IA, lambda s: s.Evict(pb.EvictRequest(keys=[b"abc"]))),
        ("ls: unknown tier", IA, lambda s: s.ListBlocks(pb.ListBlocksRequest(tier="tape"))),
        ("ls: limit too big", IA,
         lambda s: s.ListBlocks(pb.ListBlocksRequest(limit=10_000_000))),
        ("release: unknown lease", NF,
         lambda s: s.Release(pb.ReleaseRequest(lease_id="nope"))),
        ("commit: unknown reservation", NF,
         lambda s: s.Commit(pb.CommitRequest(reservation_id="nope"))),
        ("acquire: negative lease", IA, lambda s: s.Acquire(
            pb.AcquireRequest(namespace=good_ns, tokens=tokens32, lease_s=-1))),
        ("acquire: nan lease", IA, lambda s: s.Acquire(
            pb.AcquireRequest(namespace=good_ns, tokens=tokens32, lease_s=float("nan")))),
        ("reserve: endless lease", IA, lambda s: s.Reserve(
            pb.ReserveRequest(namespace=good_ns, tokens=tokens32, lease_s=1e12))),
        ("hint: zero deadline", IA, lambda s: s.Hint(
            pb.HintRequest(namespace=good_ns, tokens=tokens32, deadline_s=0))),
        ("hint: infinite deadline", IA, lambda s: s.Hint(
            pb.HintRequest(namespace=good_ns, tokens=tokens32, deadline_s=float("inf")))),
    ]


def oversized_cases(ns) -> list[tuple[str, SC, Callable[[pbg.KVStoreStub], Awaitable]]]:
    """Messages over max_message_bytes; gRPC itself refuses them, which takes a few hundred
    ms per call (the stream is reset mid-transfer), so they run a few times, not hundreds."""
    request = pb.LookupRequest(namespace=namespace_to_proto(ns), tokens=bytes(2 << 20))
    return [("lookup: oversized message", SC.RESOURCE_EXHAUSTED, lambda s: s.Lookup(request))]


async def _code_of(call: Callable[[pbg.KVStoreStub], Awaitable], stub) -> SC:
    try:
        await call(stub)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return SC.OK


async def test_thousand_malformed_requests(strict_daemon, ns, spec):
    cases = make_cases(ns, spec)
    assert len(cases) >= 35
    wrong: dict[str, SC] = {}
    async with grpc.aio.insecure_channel(strict_daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        plan = oversized_cases(ns) * 4
        plan += list(itertools.islice(itertools.cycle(cases), NUM_REQUESTS - len(plan)))
        for start in range(0, NUM_REQUESTS, BATCH):
            batch = plan[start : start + BATCH]
            codes = await asyncio.gather(*(_code_of(call, stub) for _, _, call in batch))
            wrong.update({name: code for (name, want, _), code in zip(batch, codes)
                          if code != want})
    assert not wrong, f"wrong statuses: {wrong}"
    async with AsyncClient(strict_daemon.unix_address, zero_copy=False) as client:
        tokens, kv = random_tokens(32), random_kv(spec, 32)
        assert await client.put(ns, tokens, kv) == 32
        assert (await client.lookup(ns, tokens)).matched_tokens == 32
        assert (await client.health()).status == "SERVING"
    assert sample_total(strict_daemon.metrics.registry, "kvstore_rpc_errors_total",
                        method="Lookup", code="INVALID_ARGUMENT") > 100
