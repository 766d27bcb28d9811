"""``kvstore bench lmcache`` end to end at a tiny size when the LMCache venv is there (it is not
built by the default test run: ``bash scripts/services/lmcache.sh build`` builds it); the
refusal without it always. No timings are asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstore.bench.lmcache import KVSTORE_PATHS, LMCACHE_VERSION, PAIRS, QUICK_CASES
from kvstore.bench.lmcache import lmcache_python as find_lmcache_python
from kvstore.bench.lmcache_server import KVSTORE_PATH, LMCACHE_PATH, OPS, QUICK_SERVER_CASE
from kvstore.cli import app
from kvstore.errors import KVStoreError


def _lmcache_python() -> Path | None:
    try:
        return find_lmcache_python()
    except KVStoreError:
        return None


LMCACHE_PYTHON = _lmcache_python()


@pytest.mark.skipif(LMCACHE_PYTHON is None,
                    reason="no LMCache venv: `bash scripts/services/lmcache.sh build` builds "
                           ".venv-lmcache (or set KVSTORE_LMCACHE_PYTHON)")
def test_bench_lmcache_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "lmcache.json"
    result = CliRunner().invoke(app, ["bench", "lmcache", "--quick", "--total-bytes", "1MiB",
                                      "--repeat", "1", "--lmcache-python", str(LMCACHE_PYTHON),
                                      "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "kvstore/LMCache" in result.stdout
    report = json.loads(out.read_text())
    assert report["bench"] == "lmcache"
    assert report["params"]["lmcache_version"] == LMCACHE_VERSION
    rows = {(r["case"], r["op"], r["path"]): r for r in report["rows"]}
    assert set(rows) == {(c.name, op, p) for c in QUICK_CASES
                         for op in ("put", "get", "lookup") for p in KVSTORE_PATHS}
    for (_, op, path), row in rows.items():
        assert row["lmcache_path"] == PAIRS[path]
        assert row["rate"] > 0 and row["lmcache_rate"] > 0 and row["ratio"] > 0
        if op == "lookup":
            assert row["unit"] == "lookups/s"
            assert len(row["round_rate"]) == len(row["lmcache_round_rate"]) == 1
        else:
            assert row["gbps"] == row["rate"] and row["unit"] == "GB/s"
            assert len(row["round_gbps"]) == len(row["lmcache_round_gbps"]) == 1


@pytest.mark.skipif(LMCACHE_PYTHON is None,
                    reason="no LMCache venv: `bash scripts/services/lmcache.sh build` builds "
                           ".venv-lmcache (or set KVSTORE_LMCACHE_PYTHON)")
def test_bench_lmcache_server_rows_beside_lmcache_bench_server(tmp_path: Path) -> None:
    """The section beside `lmcache server` alone: LMCache's own bench client and kvstore's
    Client ran the same requests (both check what came back), one rate row and one p50 row
    per operation."""
    out = tmp_path / "lmcache-server.json"
    num_requests = 3
    result = CliRunner().invoke(app, ["bench", "lmcache", "--quick", "--no-backends", "--server",
                                      "--total-bytes",
                                      str(num_requests * QUICK_SERVER_CASE.request_bytes),
                                      "--repeat", "1", "--lmcache-python", str(LMCACHE_PYTHON),
                                      "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["params"]["lmcache_version"] == LMCACHE_VERSION
    server = report["params"]["server"]
    assert server["num_requests"] == num_requests and server["concurrency"] == 1
    # one recorded round a side, each timing every request's four operations
    assert len(server["kvstore_rounds"]) == len(server["lmcache_rounds"]) == 1
    for side in (server["kvstore_rounds"][0], server["lmcache_rounds"][0]):
        assert set(side) == set(OPS)
        assert all(t["p50_ms"] > 0 and t["mean_ms"] > 0 for t in side.values())
    rows = {(r["op"], r["unit"]): r for r in report["rows"]}
    units = {op: "lookups/s" if op.startswith("lookup") else "GB/s" for op in OPS}
    assert set(rows) == {(op, unit) for op in OPS for unit in (units[op], "ms p50")}
    for (_, unit), row in rows.items():
        assert (row["path"], row["lmcache_path"]) == (KVSTORE_PATH, LMCACHE_PATH)
        assert row["better"] == ("lower" if unit == "ms p50" else "higher")
        assert row["calls"] == num_requests
        assert row["request_bytes"] == QUICK_SERVER_CASE.request_bytes
        assert row["rate"] > 0 and row["lmcache_rate"] > 0 and row["ratio"] > 0
        assert len(row["round_rate"]) == len(row["lmcache_round_rate"]) == 1


def test_bench_lmcache_without_its_venv_says_how_to_build_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "lmcache", "--quick", "--lmcache-python",
                                      str(tmp_path / "missing" / "python")])
    assert result.exit_code == 1
    assert "scripts/services/lmcache.sh" in result.output
