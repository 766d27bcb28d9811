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


def test_bench_lmcache_without_its_venv_says_how_to_build_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "lmcache", "--quick", "--lmcache-python",
                                      str(tmp_path / "missing" / "python")])
    assert result.exit_code == 1
    assert "scripts/services/lmcache.sh" in result.output
