"""The RPC benchmark runs end to end on a small budget and reports every measurement."""

from __future__ import annotations

import pytest

from kvstore.bench.rpc import run_rpc_bench
from kvstore.errors import InvalidArgument


def test_rpc_bench_smoke():
    report = run_rpc_bench(total_bytes=32 << 20, lookup_repeats=5, small_call_s=0.2,
                           concurrency=4)
    rows = {row["measurement"]: row for row in report.rows}
    assert len(rows) == 9
    for name in ("Lookup 8k-token prefix p50", "Lookup 32k-token prefix p99",
                 "put 2 MiB blocks, socket", "get 2 MiB blocks, shared memory"):
        assert rows[name]["value"] > 0 and rows[name]["echo"] > 0
        assert rows[name]["vs_echo"] == pytest.approx(rows[name]["value"] / rows[name]["echo"])
    assert report.as_dict()["params"]["total_bytes"] == 32 << 20


def test_rpc_bench_rejects_bad_parameters():
    with pytest.raises(InvalidArgument):
        run_rpc_bench(total_bytes=0)
