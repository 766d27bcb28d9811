"""Status mapping and wire conversions shared by the server and the clients."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from kvstore import errors
from kvstore.api import (
    BlockLocation,
    Counters,
    Lease,
    LookupResult,
    Medium,
    Reservation,
    SlotGrant,
    StoreStats,
    TierStats,
)
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError
from kvstore.keys import BlockKey, Namespace, token_array
from kvstore.server import kvstore_pb2 as pb
from kvstore.server.base import (
    ChunkAssembler,
    chunk_limit,
    error_from_status,
    error_metadata,
    expected_tensor,
    key_from_bytes,
    lease_from_proto,
    lease_to_proto,
    lookup_from_proto,
    lookup_to_proto,
    namespace_from_proto,
    namespace_to_proto,
    reservation_from_proto,
    reservation_to_proto,
    stats_from_proto,
    stats_to_proto,
    status_for,
    tensor_from_buffer,
    tensor_header,
    tensor_view,
    tokens_from_bytes,
    tokens_to_bytes,
)

from ..conftest import random_kv

SC = grpc.StatusCode


@pytest.mark.parametrize("exc, code", [
    (errors.InvalidArgument("x"), SC.INVALID_ARGUMENT),
    (errors.ConfigError("x"), SC.INVALID_ARGUMENT),
    (errors.CodecError("x"), SC.INVALID_ARGUMENT),
    (errors.NotFound("x"), SC.NOT_FOUND),
    (errors.LeaseNotFound("x"), SC.NOT_FOUND),
    (errors.CapacityError("x"), SC.RESOURCE_EXHAUSTED),
    (errors.PermissionDenied("x"), SC.PERMISSION_DENIED),
    (errors.Unauthenticated("x"), SC.UNAUTHENTICATED),
    (errors.CorruptPage("x"), SC.DATA_LOSS),
    (errors.Unavailable("x"), SC.UNAVAILABLE),
    (errors.KVStoreError("x"), SC.INTERNAL),
    (RuntimeError("x"), SC.INTERNAL),
])
def test_status_for_every_exception(exc, code):
    assert status_for(exc) == code


@pytest.mark.parametrize("cls", [errors.InvalidArgument, errors.CodecError, errors.LeaseNotFound,
                                 errors.CapacityError, errors.CorruptPage,
                                 errors.PermissionDenied, errors.Unauthenticated])
def test_error_class_survives_the_wire(cls):
    exc = cls("what went wrong")
    back = error_from_status(status_for(exc), str(exc), error_metadata(exc))
    assert type(back) is cls and str(back) == "what went wrong"


def test_error_from_status_without_metadata_uses_the_code():
    assert type(error_from_status(SC.NOT_FOUND, "gone")) is errors.NotFound
    assert type(error_from_status(SC.UNAVAILABLE, "down")) is errors.Unavailable
    unknown = error_from_status(SC.INTERNAL, "boom")
    assert type(unknown) is KVStoreError and "INTERNAL" in str(unknown)
    # a class name that is not a kvstore error is ignored, not imported
    forged = error_from_status(SC.INVALID_ARGUMENT, "x", (("kvstore-error", "SystemExit"),))
    assert type(forged) is errors.InvalidArgument


def test_tokens_wire_form():
    data = tokens_to_bytes([1, 2, 2**32 - 1])
    assert len(data) == 12
    assert tokens_from_bytes(data).tolist() == [1, 2, 2**32 - 1]
    with pytest.raises(InvalidArgument, match="multiple of 4"):
        tokens_from_bytes(b"\x01\x02\x03")
    with pytest.raises(InvalidArgument, match="empty"):
        tokens_from_bytes(b"")
    with pytest.raises(InvalidArgument):
        tokens_to_bytes([-1])


def test_namespace_round_trip(ns):
    back = namespace_from_proto(namespace_to_proto(ns))
    assert back == ns and back.fingerprint == ns.fingerprint


def test_namespace_from_proto_rejects_malformed(ns):
    msg = namespace_to_proto(ns)
    msg.ClearField("spec")
    with pytest.raises(InvalidArgument, match="spec is required"):
        namespace_from_proto(msg)
    for field, value in [("tp_size", 0), ("model_id", ""), ("tenant", "x" * 1000)]:
        bad = namespace_to_proto(ns)
        setattr(bad, field, value)
        with pytest.raises(InvalidArgument):
            namespace_from_proto(bad)
    bad = namespace_to_proto(ns)
    bad.spec.dtype = "int8"
    with pytest.raises(InvalidArgument, match="dtype"):
        namespace_from_proto(bad)


def test_expected_tensor_checks_dtype_shape_and_size(spec):
    kv = random_kv(spec, 32)
    assert expected_tensor(spec, 32, tensor_header(kv)) == kv.numel() * 2
    for change, match in [({"dtype": "float16"}, "dtype"), ({"dtype": "qint8"}, "unknown"),
                          ({"shape": [2, 2, 31, 2, 16]}, "shape"),
                          ({"total_bytes": 5}, "declares")]:
        header = tensor_header(kv)
        for name, value in change.items():
            if name == "shape":
                del header.shape[:]
                header.shape.extend(value)
            else:
                setattr(header, name, value)
        with pytest.raises(InvalidArgument, match=match):
            expected_tensor(spec, 32, header)


def test_tensor_bytes_round_trip_bit_exact(spec):
    kv = random_kv(spec, 48)
    buf = bytearray(tensor_view(kv))
    back = tensor_from_buffer(buf, tensor_header(kv))
    assert back.dtype == kv.dtype and torch.equal(back, kv)


def test_chunk_assembler_refuses_short_long_and_oversized():
    with pytest.raises(CapacityError):
        ChunkAssembler(100, max_bytes=99)
    a = ChunkAssembler(4, max_bytes=4)
    a.add(b"ab")
    with pytest.raises(InvalidArgument, match="ended after 2"):
        a.finish()
    a.add(b"cd")
    with pytest.raises(InvalidArgument, match="more than"):
        a.add(b"e")
    assert a.finish() == bytearray(b"abcd")


def test_chunk_limit_stays_under_the_message_limit():
    assert chunk_limit(256 << 20) == 4 << 20
    assert chunk_limit(1 << 20) < 1 << 20


def test_key_from_bytes():
    assert key_from_bytes(b"k" * 16) == b"k" * 16
    with pytest.raises(InvalidArgument, match="16"):
        key_from_bytes(b"short")


def test_stats_round_trip():
    stats = StoreStats(
        tiers={"dram": TierStats(name="dram", capacity_bytes=10, used_bytes=4, num_blocks=2,
                                 hits=3, extra={"chunks": 1.0})},
        counters=Counters(lookups=5, lookup_hit_tokens=64, puts=2),
        active_leases=1, active_reservations=2, num_blocks=2,
    )
    back = stats_from_proto(stats_to_proto(stats))
    assert back.as_dict() == stats.as_dict()


def test_unknown_counters_from_a_newer_server_are_dropped():
    msg = pb.StatsResponse(counters={"lookups": 3, "a_future_counter": 9})
    assert stats_from_proto(msg).counters.lookups == 3


def test_tokens_from_lists_match_the_hashed_form():
    """Lists take a faster conversion than arrays; both must give the bytes keys hash."""
    tokens = np.random.default_rng(1).integers(0, 2**32, 4096).tolist()
    assert tokens_to_bytes(tokens) == token_array(tokens).tobytes()
    assert tokens_to_bytes(tuple(tokens)) == token_array(np.array(tokens)).tobytes()
    for bad in ([1, -1], [2**32], [1, 2.5], ["7"], [[1]]):
        with pytest.raises(InvalidArgument):
            tokens_to_bytes(bad)


def test_tokens_accept_numpy_and_torch():
    arr = np.arange(5, dtype=np.int64)
    assert tokens_to_bytes(arr) == tokens_to_bytes(torch.arange(5)) == tokens_to_bytes(range(5))


def test_namespace_fields_all_travel(spec):
    ns = Namespace(model_id="m", spec=spec, revision="r", adapter_id="lora", tenant="t",
                   tp_rank=1, tp_size=2, extra_salt="img")
    assert namespace_from_proto(namespace_to_proto(ns)).to_dict() == ns.to_dict()


@pytest.mark.parametrize("advised", [None, 0, 48])
def test_lookup_round_trip_keeps_the_advice(advised):
    """No advice and an advice of zero tokens are different answers and must stay so."""
    result = LookupResult(num_tokens=70, matched_tokens=64, tokens_per_tier={"dram": 32, "ssd": 32},
                          keys=(BlockKey(bytes(16)),), advised_tokens=advised)
    assert lookup_from_proto(lookup_to_proto(result)) == result


def test_locations_and_grants_round_trip_with_their_medium():
    key = BlockKey(b"k" * 16)
    lease = Lease("l1", 5.0, 16, (BlockLocation(key, Medium.DEVICE, "pool0", 4096, 100),))
    grant = SlotGrant(key, 0, None, Medium.HOST, "/dev/shm/a", 8192, 65536)
    reservation = Reservation("r1", 6.0, "raw", (grant,))
    assert lease_from_proto(lease_to_proto(lease)) == lease
    assert reservation_from_proto(reservation_to_proto(reservation)) == reservation
