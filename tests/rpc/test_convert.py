"""Value types <-> proto messages: tokens, keys, namespaces, lookups, stats, leases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.api import (
    BlockLocation,
    Counters,
    KVEventKind,
    Lease,
    LookupResult,
    Medium,
    Reservation,
    SlotGrant,
    StoreStats,
    TierStats,
)
from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, Namespace, token_array
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.convert import (
    event_batch_from_proto,
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
    tokens_from_bytes,
    tokens_to_bytes,
)


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


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("advised", [None, 0, 48])
def test_lookup_round_trip_keeps_the_advice(advised, packed):
    """No advice and an advice of zero tokens are different answers and must stay so."""
    result = LookupResult(num_tokens=70, matched_tokens=64, tokens_per_tier={"dram": 32, "ssd": 32},
                          keys=(BlockKey(bytes(16)),), advised_tokens=advised,
                          cluster_tokens={"host-b": 128} if advised else {})
    assert lookup_from_proto(lookup_to_proto(result, packed=packed)) == result


@pytest.mark.parametrize("num_keys", [0, 1, 3, 2048])
def test_packed_lookup_keys_arrive_as_the_same_tuple_of_keys(num_keys):
    keys = tuple(BlockKey(i.to_bytes(16, "little")) for i in range(num_keys))
    result = LookupResult(num_tokens=16 * num_keys + 5, matched_tokens=16 * num_keys,
                          tokens_per_tier={"dram": 16 * num_keys} if num_keys else {}, keys=keys)
    packed = lookup_to_proto(result, packed=True)
    assert not packed.keys and packed.packed_keys == b"".join(keys)
    assert list(lookup_to_proto(result).keys) == list(keys) and not lookup_to_proto(
        result).packed_keys  # an older client, which does not ask, gets the repeated field
    back = lookup_from_proto(pb.LookupResponse.FromString(packed.SerializeToString()))
    assert back == result and all(type(k) is bytes for k in back.keys)


def test_malformed_packed_lookup_keys_are_refused():
    with pytest.raises(InvalidArgument, match="not a whole number of 16-byte keys"):
        lookup_from_proto(pb.LookupResponse(packed_keys=bytes(24)))
    with pytest.raises(InvalidArgument, match="keys and packed_keys"):
        lookup_from_proto(pb.LookupResponse(packed_keys=bytes(16), keys=[bytes(16)]))


def test_a_namespace_built_once_is_reused_and_a_bad_one_never_remembered(ns):
    """The daemon reuses the Namespace of a message it has seen; a message that fails
    validation fails every time, and the same fields with another value give another one."""
    first = namespace_from_proto(namespace_to_proto(ns))
    assert namespace_from_proto(namespace_to_proto(ns)) is first
    other = namespace_to_proto(ns)
    other.tenant = "someone-else"
    assert namespace_from_proto(other).tenant == "someone-else"
    bad = namespace_to_proto(ns)
    bad.tp_size = 0
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="tp_size"):
            namespace_from_proto(bad)


def test_locations_and_grants_round_trip_with_their_medium():
    key = BlockKey(b"k" * 16)
    lease = Lease("l1", 5.0, 16, (BlockLocation(key, Medium.DEVICE, "pool0", 4096, 100),))
    grant = SlotGrant(key, 0, None, Medium.HOST, "/dev/shm/a", 8192, 65536)
    reservation = Reservation("r1", 6.0, "raw", (grant,))
    assert lease_from_proto(lease_to_proto(lease)) == lease
    assert reservation_from_proto(reservation_to_proto(reservation)) == reservation


def _many_locations(n: int = 40) -> tuple[BlockLocation, ...]:
    return tuple(BlockLocation(BlockKey(bytes([i]) * 16), Medium.HOST, f"region{i % 3}",
                               4096 * (i + 1), 1000 + i) for i in range(n))


def test_a_packed_lease_is_one_table_and_reads_back_the_same():
    lease = Lease("l2", 7.0, 640, _many_locations(), "fp8_e4m3")
    msg = lease_to_proto(lease, packed=True)
    assert msg.HasField("table") and not msg.blocks and list(msg.table.regions) == [
        "region0", "region1", "region2"]
    back = lease_from_proto(pb.AcquireResponse.FromString(msg.SerializeToString()))
    assert back == lease and tuple(back.blocks) == _many_locations()
    assert back.blocks[-1] == _many_locations()[-1] and back.blocks[1:3] == _many_locations()[1:3]
    assert back.blocks.offsets.tolist() == [4096 * (i + 1) for i in range(40)]
    assert lease_from_proto(lease_to_proto(lease)) == lease  # the message-per-block form


def test_a_packed_reservation_keeps_positions_and_parents():
    keys = [BlockKey(bytes([i + 1]) * 16) for i in range(5)]
    grants = tuple(SlotGrant(keys[i], i + 2, keys[i - 1] if i else BlockKey(b"p" * 16),
                             Medium.DEVICE, "pool0", 8192 * i, 8192) for i in range(5))
    first = (SlotGrant(BlockKey(b"f" * 16), 0, None, Medium.DEVICE, "pool0", 65536, 8192),)
    reservation = Reservation("r2", 9.0, "raw", first + grants)
    back = reservation_from_proto(reservation_to_proto(reservation, packed=True))
    assert back == reservation and back.blocks[0].parent is None
    assert back.blocks[1].parent == BlockKey(b"p" * 16)
    assert back.blocks.block_index.tolist() == [0, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(("field", "value", "named"), [
    ("offsets", b"\0" * 7, "offsets"),
    ("lengths", b"\0" * 8, "lengths"),
    ("region_index", b"\0" * 12, "region_index"),
    ("keys", b"k" * 15, "keys"),
])
def test_a_malformed_block_table_names_its_field(field, value, named):
    msg = lease_to_proto(Lease("l3", 1.0, 32, _many_locations(2)), packed=True)
    setattr(msg.table, field, value)
    with pytest.raises(InvalidArgument, match=named):
        lease_from_proto(msg)


def test_a_block_table_naming_a_region_it_lacks_is_refused():
    msg = lease_to_proto(Lease("l4", 1.0, 32, _many_locations(2)), packed=True)
    msg.table.region_index = np.array([0, 5], dtype="<u4").tobytes()
    with pytest.raises(InvalidArgument, match="region 5 of 2"):
        lease_from_proto(msg)


def test_an_event_batch_reads_back_as_typed_values():
    keys = [bytes([i]) * 16 for i in range(3)]
    msg = pb.KVEventBatch(ts=1.5, seq=7, host="node-a", num_dropped=2, events=[
        pb.KVEvent(kind=pb.KV_EVENT_STORED, keys=keys[1:], parent=keys[0],
                   tokens=tokens_to_bytes(range(32)), block_tokens=16, first_block_index=1,
                   tier="dram", medium="CPU", tenant="acme", model_id="m", namespace=b"ns"),
        pb.KVEvent(kind=pb.KV_EVENT_REMOVED, keys=keys[:1], tier="ssd", medium="STORAGE"),
        pb.KVEvent(kind=pb.KV_EVENT_ALL_CLEARED)])
    batch = event_batch_from_proto(msg)
    assert (batch.seq, batch.ts, batch.host, batch.num_dropped) == (7, 1.5, "node-a", 2)
    stored, removed, cleared = batch.events
    assert stored.kind is KVEventKind.STORED and stored.keys == tuple(keys[1:])
    assert stored.parent == keys[0] and stored.tokens.dtype == np.uint32
    assert stored.tokens.tolist() == list(range(32))
    assert (stored.block_tokens, stored.first_block_index, stored.namespace) == (16, 1, b"ns")
    assert removed.kind is KVEventKind.REMOVED and removed.parent is None
    assert removed.tokens is None and removed.medium == "STORAGE"
    assert cleared.kind is KVEventKind.ALL_CLEARED and cleared.keys == ()


@pytest.mark.parametrize(("event", "named"), [
    (pb.KVEvent(keys=[b"short"]), "event key"),
    (pb.KVEvent(keys=[b"k" * 16], parent=b"p" * 15), "event parent"),
    (pb.KVEvent(keys=[b"k" * 16], tokens=b"12345"), "multiple of 4"),
    (pb.KVEvent(kind=9), "unknown KV event kind 9"),
])
def test_a_malformed_event_names_what_is_wrong(event, named):
    with pytest.raises(InvalidArgument, match=named):
        event_batch_from_proto(pb.KVEventBatch(events=[event]))
