"""Fuzzing every RPC of one real daemon (a subprocess on its Unix socket) with random bytes,
mutated valid messages and structured-but-wrong messages drawn by hypothesis.

Each hypothesis example sends a batch of calls at once through a raw channel. Every call must
end within its timeout (no hang: no DEADLINE_EXCEEDED), with a status other than INTERNAL or
UNKNOWN (no unexpected exception), and the daemon must keep answering Health and log no
traceback. The file stops sending after about a minute (FUZZ_BUDGET_S) whatever the number of
examples, and prints what it sent.
"""

from __future__ import annotations

import collections
import random
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.convert import namespace_to_proto

from ..server.helpers import DaemonProcess, short_tmpdir, small_config
from ..server.hostile import HEAVY_NS, method

FUZZ_BUDGET_S = 50.0  # sending stops after this, for the whole file
CALL_TIMEOUT_S = 10.0  # a call still running then is a hang
BATCH = 16  # calls per hypothesis example, sent together
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
       grpc.StatusCode.UNAVAILABLE}

UNARY = {"Lookup": pb.LookupRequest, "Evict": pb.EvictRequest, "Stats": pb.StatsRequest,
         "Health": pb.HealthRequest, "ListBlocks": pb.ListBlocksRequest,
         "Reserve": pb.ReserveRequest, "Commit": pb.CommitRequest, "Abort": pb.AbortRequest,
         "Acquire": pb.AcquireRequest, "Release": pb.ReleaseRequest, "Hint": pb.HintRequest,
         "ReportPrefill": pb.ReportPrefillRequest}
ALL_METHODS = [*UNARY, "Put", "Get"]

sent: collections.Counter[str] = collections.Counter()
codes: collections.Counter[str] = collections.Counter()
failures: list[str] = []
_started = time.monotonic()
_test_started: dict[str, float] = {}
NUM_FUZZ_TESTS = 2 * len(ALL_METHODS)


def _over_budget(test: str) -> bool:
    """Whether ``test`` has used its share of FUZZ_BUDGET_S (each test gets an equal one)."""
    now = time.monotonic()
    return now - _test_started.setdefault(test, now) > FUZZ_BUDGET_S / NUM_FUZZ_TESTS


@pytest.fixture(scope="module")
def fuzz_daemon() -> Iterator[DaemonProcess]:
    """Small limits so wrong sizes are cheap: 1 MiB messages, 4096 tokens, 2 s idle gap."""
    global _started
    root = short_tmpdir()
    config = small_config(root, max_message_bytes=1 << 20, max_request_tokens=4096,
                          stream_idle_timeout_s=2.0, tenant_tokens={"acme": "tok-acme"},
                          log_level="INFO")
    proc = DaemonProcess(config, root)
    try:
        proc.wait_ready()
        _started = time.monotonic()
        yield proc
    finally:
        proc.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def channel(fuzz_daemon) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(fuzz_daemon.address) as ch:
        yield ch


# ------------------------------------------------------------------------------ strategies

u32 = st.one_of(st.integers(0, 4), st.sampled_from([16, 64, 1024, 1025, 65536, 65537]),
                st.integers(0, 2**32 - 1))
u64 = st.one_of(u32, st.integers(0, 2**64 - 1))
names = st.one_of(st.sampled_from(["", "acme", "zeta", "m", "dram", "ssd", "bfloat16"]),
                  st.text(max_size=24), st.integers(250, 300).map(lambda n: "n" * n))
seconds = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 30.0])


def _token_bytes(num_tokens: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 2**32, num_tokens, dtype="<u4").tobytes()


# Token ids drawn by numpy from a drawn seed: drawing 5000 integers one by one would make
# hypothesis, not the daemon, the bottleneck.
tokens = st.one_of(st.binary(max_size=64),
                   st.builds(_token_bytes, st.sampled_from([1, 3, 4, 15, 16, 17, 4096, 4097]),
                             st.integers(0, 2**32 - 1)),
                   st.builds(_token_bytes, st.integers(0, 5000), st.integers(0, 2**32 - 1)))
specs = st.builds(pb.KVSpec, num_layers=u32, num_kv_heads=u32, head_dim=u32, block_tokens=u32,
                  dtype=st.sampled_from(["bfloat16", "float16", "float32", "", "int8"]) | names,
                  position_scheme=names)
GOOD_NS = namespace_to_proto(HEAVY_NS)
SMALL_NS = pb.Namespace(model_id="fuzz", tenant="acme", tp_size=1,
                        spec=pb.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4,
                                       dtype="float32"))
namespaces = st.one_of(
    st.just(SMALL_NS), st.just(GOOD_NS),
    st.builds(pb.Namespace, model_id=names, revision=names, adapter_id=names, tenant=names,
              spec=st.none() | specs, tp_rank=u32, tp_size=u32, extra_salt=names))
# mostly local trust (the handlers run); sometimes a tenant token or a bad one
METADATA = [()] * 6 + [(("authorization", "Bearer tok-acme"),)] * 2 + [
    (("authorization", "Bearer nope"),), (("authorization", "x"),)]
metadata = st.sampled_from(METADATA)

REQUESTS: dict[str, st.SearchStrategy] = {
    "Lookup": st.builds(pb.LookupRequest, namespace=namespaces, tokens=tokens),
    "Evict": st.builds(pb.EvictRequest, tenant=names, model_id=names, everything=st.booleans(),
                       keys=st.lists(st.binary(min_size=0, max_size=20), max_size=4)),
    "Stats": st.builds(pb.StatsRequest, tenant=names),
    "Health": st.just(pb.HealthRequest()),
    "ListBlocks": st.builds(pb.ListBlocksRequest, tenant=names, model_id=names, tier=names,
                            limit=u32),
    "Reserve": st.builds(pb.ReserveRequest, namespace=namespaces, tokens=tokens, lease_s=seconds),
    "Commit": st.builds(pb.CommitRequest, reservation_id=names),
    "Abort": st.builds(pb.AbortRequest, reservation_id=names),
    "Acquire": st.builds(pb.AcquireRequest, namespace=namespaces, tokens=tokens, lease_s=seconds),
    "Release": st.builds(pb.ReleaseRequest, lease_id=names),
    "Hint": st.builds(pb.HintRequest, namespace=namespaces, tokens=tokens, deadline_s=seconds),
    "Get": st.builds(pb.GetRequest, namespace=namespaces, tokens=tokens, chunk_bytes=u64),
    "ReportPrefill": st.builds(
        pb.ReportPrefillRequest, namespace=namespaces, new_tokens=u64, cached_tokens=u64,
        seconds=seconds, profile=st.none() | st.builds(
            pb.ModelProfile, num_params=seconds, num_layers=u32, hidden_size=u32,
            flops_per_s=seconds)),
}


@st.composite
def put_streams(draw) -> list[pb.PutRequest]:
    """A header (often consistent with its namespace, so the chunks are what is wrong) and
    chunks; or chunks alone; or several headers."""
    ns = draw(namespaces)
    toks = draw(tokens)
    if draw(st.booleans()) and ns is SMALL_NS and len(toks) % 4 == 0 and toks:
        num = len(toks) // 4
        tensor = pb.TensorHeader(dtype="float32", shape=[1, 2, num, 1, 8],
                                 total_bytes=num * 64)
    else:
        tensor = draw(st.builds(pb.TensorHeader, dtype=names, total_bytes=u64,
                                shape=st.lists(u64, max_size=6)))
    header = pb.PutRequest(header=pb.PutHeader(namespace=ns, tokens=toks, tensor=tensor))
    sizes = draw(st.lists(st.sampled_from([0, 1, 63, 64, 4096, tensor.total_bytes % 70_000]),
                          max_size=4))
    chunks = [pb.PutRequest(chunk=bytes(n)) for n in sizes]
    layout = draw(st.sampled_from(["header first", "chunks only", "two headers"]))
    if layout == "chunks only":
        return chunks
    return [header, *chunks, *([header] if layout == "two headers" else [])]


# -------------------------------------------------------------------------------- sending

def _start(channel: grpc.Channel, name: str, message: Any, md) -> Callable[[], None]:
    """Start one call; return what waits for it and records its status."""
    serialize = _serializer(message)
    if name == "Put":
        rpc = channel.stream_unary(method("Put"), request_serializer=serialize)
        future = rpc.future(iter(message), timeout=CALL_TIMEOUT_S, metadata=md)
        return lambda: _record(name, future.exception())
    if name == "Get":
        call = channel.unary_stream(method("Get"), request_serializer=serialize)(
            message, timeout=CALL_TIMEOUT_S, metadata=md)

        def drain() -> None:
            try:
                for _ in call:
                    pass
                _record(name, None)
            except grpc.RpcError as err:
                _record(name, err)
        return drain
    rpc = channel.unary_unary(method(name), request_serializer=serialize)
    future = rpc.future(message, timeout=CALL_TIMEOUT_S, metadata=md)
    return lambda: _record(name, future.exception())


def _serializer(message: Any):
    """None for raw bytes (a Put: a list of them), else the message type's serializer."""
    first = message[0] if isinstance(message, list) and message else message
    return None if isinstance(first, (bytes, list)) else type(first).SerializeToString


def _record(name: str, err: BaseException | None) -> None:
    code = err.code() if isinstance(err, grpc.RpcError) else grpc.StatusCode.OK
    sent[name] += 1
    codes[code.name] += 1
    if code in BAD:
        details = err.details() if isinstance(err, grpc.RpcError) else ""
        failures.append(f"{name}: {code.name}: {(details or '')[:300]}")


def send_batch(channel: grpc.Channel, name: str, batch: list[tuple[Any, Any]]) -> None:
    waits = [_start(channel, name, message, md) for message, md in batch]
    for wait in waits:
        wait()
    assert not failures, failures[:5]


# Drawing happens whatever the budget (see test_random_bytes), so these counts bound the time
# the file spends drawing; FUZZ_BUDGET_S bounds the time it spends sending.
FUZZ = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
FUZZ_STRUCTURED = settings(FUZZ, max_examples=60)


def _blobs(rng: random.Random, base: bytes, count: int) -> list[bytes]:
    """``count`` random byte strings: half pure noise, half ``base`` with bytes overwritten,
    cut or appended (cheap to make, so hypothesis draws the base and the seed only)."""
    out = []
    for i in range(count):
        if i % 2 == 0 or not base:
            out.append(rng.randbytes(rng.choice([0, 1, 5, 64, 700, 2048])))
            continue
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            action = rng.randrange(3)
            if action == 0 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif action == 1 and data:
                del data[rng.randrange(len(data)):]
            else:
                data += rng.randbytes(rng.randint(1, 8))
        out.append(bytes(data))
    return out


@pytest.mark.parametrize("name", ALL_METHODS)
@FUZZ
@given(data=st.data())
def test_random_bytes(channel, name, data):
    """Random bytes, and valid messages drawn by hypothesis with random bytes overwritten, cut
    or appended, as each RPC's request (a Put: a stream of such messages)."""
    rng = random.Random(data.draw(st.integers(0, 2**64 - 1), label="seed"))
    if name == "Put":
        base = b"".join(m.SerializeToString() for m in data.draw(put_streams(), label="base"))
        batch = [(_blobs(rng, base, rng.randint(0, 3)), rng.choice(METADATA))
                 for _ in range(BATCH // 2)]
    else:
        base = data.draw(REQUESTS[name], label="base").SerializeToString()
        batch = [(blob, rng.choice(METADATA)) for blob in _blobs(rng, base, 2 * BATCH)]
    # the budget may skip sending, never drawing: hypothesis replays draws and checks them
    if not _over_budget(f"bytes {name}"):
        send_batch(channel, name, batch)


@pytest.mark.parametrize("name", ALL_METHODS)
@FUZZ_STRUCTURED
@given(data=st.data())
def test_structured_messages(channel, name, data):
    """Well-formed messages with wrong, extreme or inconsistent fields."""
    message = put_streams() if name == "Put" else REQUESTS[name]
    batch = data.draw(st.lists(st.tuples(message, metadata), min_size=BATCH // 2,
                               max_size=BATCH // 2))
    if not _over_budget(f"structured {name}"):
        send_batch(channel, name, batch)


def test_daemon_survived(fuzz_daemon, channel, capsys):
    """After the fuzzing: the process is alive, Health answers, the log has no traceback."""
    assert fuzz_daemon.proc.poll() is None
    health = channel.unary_unary(method("Health"),
                                 request_serializer=pb.HealthRequest.SerializeToString,
                                 response_deserializer=pb.HealthResponse.FromString)
    assert health(pb.HealthRequest(), timeout=CALL_TIMEOUT_S).status == "SERVING"
    log = fuzz_daemon.log()
    assert "Traceback" not in log and "raised unexpectedly" not in log, log[-3000:]
    assert not failures, failures[:5]
    with capsys.disabled():
        print(f"\nfuzz: {sum(sent.values())} calls in {time.monotonic() - _started:.0f} s; "
              f"per RPC {dict(sent)}; statuses {dict(codes)}")
