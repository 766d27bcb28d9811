"""The RPC benchmark runs end to end on a small budget and reports every measurement."""

from __future__ import annotations

import pytest

from kvstore.bench.rpc.common import python_lookup_floor
from kvstore.bench.rpc.run import redis_available, run_rpc_bench
from kvstore.errors import InvalidArgument


def test_rpc_bench_smoke():
    report = run_rpc_bench(total_bytes=32 << 20, lookup_repeats=5, small_call_s=0.2,
                           concurrency=4, redis_repeats=1)
    rows = {row["measurement"]: row for row in report.rows}
    assert len(rows) == 20 + (8 if redis_available() else 0)
    channel_rows = [r for name, r in rows.items() if name.endswith("channel vs gRPC")]
    assert len(channel_rows) == 7  # Lookup p50/p99 at 8k and 32k, one-block put/get, calls/s
    for row in channel_rows:
        assert row["value"] > 0 and row["grpc"] > 0 and row["vs_grpc"] > 0
    for row in channel_rows[:4]:
        assert row["floor"] > 0 and row["vs_floor"] > 0 and row["grpc_vs_floor"] > 0
    for name in ("Lookup 8k-token prefix p50", "Lookup 32k-token prefix p99",
                 "put 2 MiB blocks, socket", "get 2 MiB blocks, shared memory"):
        assert rows[name]["value"] > 0 and rows[name]["echo"] > 0
        assert rows[name]["vs_echo"] == pytest.approx(rows[name]["value"] / rows[name]["echo"])
    for name in ("Lookup 8k-token prefix p50", "Lookup 32k-token prefix p99"):
        assert rows[name]["floor"] > 0
        assert rows[name]["vs_floor"] == pytest.approx(rows[name]["value"] / rows[name]["floor"])
    copy_rows = [r for name, r in rows.items()
                 if name.startswith(("put 2 MiB blocks x16, shared memory, vs one copy",
                                     "get 2 MiB blocks x16, shared memory, vs one copy"))]
    assert len(copy_rows) == 3  # put; get into a warm out= and into a fresh result
    ceiling = next(r for name, r in rows.items() if name.startswith(
        "get 2 MiB blocks x16, shared memory, vs that copy on"))  # the client's copy threads
    assert ceiling["copy_threads"] >= 1 and ceiling["aim"] is None
    for row in (*copy_rows, ceiling):
        assert row["value"] > 0 and row["copy"] > 0
        assert row["vs_copy"] == pytest.approx(row["value"] / row["copy"])
    assert report.as_dict()["params"]["total_bytes"] == 32 << 20
    if redis_available():
        for transport in ("unix", "tcp"):
            for op in ("put", "get"):
                for path in ("data socket", "streamed"):
                    row = rows[f"{op} 2 MiB blocks x16, {path}, {transport}"]
                    assert row["value"] > 0 and row["redis"] > 0 and row["vs_redis"] > 0
                    assert row["cpu_s_per_gb"] > 0 and row["redis_cpu_s_per_gb"] > 0
    else:
        assert any("Redis section was skipped" in note for note in report.notes)


def test_rpc_bench_rejects_bad_parameters():
    with pytest.raises(InvalidArgument):
        run_rpc_bench(total_bytes=0)
    with pytest.raises(InvalidArgument, match="redis_repeats"):
        run_rpc_bench(redis_repeats=-1)


def test_python_lookup_floor_walks_the_recorded_prefix():
    """The floor matches what it recorded and stops at the first block it did not."""
    tokens = list(range(16 * 5 + 3))
    index: dict[bytes, None] = {}
    assert python_lookup_floor(bytes(16), tokens[:48], index, 16, record=True) == 3
    assert len(index) == 3
    assert python_lookup_floor(bytes(16), tokens, index, 16) == 3
    assert python_lookup_floor(bytes(16), [7] + tokens[1:], index, 16) == 0
