"""``kvstore bench gpu --groups`` on the CPU twin (Triton's interpreter, tiny shapes): every
cache-group row is there, its path checked bit for bit before it was timed, and its rate a
ratio to the device copy measured in the same run. Timings are not checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvstore.cli import app
from kvstore.codecs.triton.common import kernels_runnable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernels_runnable(DEVICE),
                                reason="needs CUDA or TRITON_INTERPRET=1")
PATHS = {"device copy (read + write)",
         "HBM pool -> engine, MLA latent bf16", "engine -> HBM pool, MLA latent bf16 (save)",
         "HBM pool -> engine, MLA latent fp8", "engine -> HBM pool, MLA latent fp8 (save)",
         "HBM pool -> engine, fp8 pass-through", "engine -> HBM pool, fp8 pass-through (save)",
         "state pages -> engine slots", "engine slots -> state pages (snapshot)"}


def test_group_rows_run_and_compare_with_a_device_copy(tmp_path: Path) -> None:
    out = tmp_path / "groups.json"
    result = CliRunner().invoke(app, ["bench", "gpu", "--groups", "--quick", "--json", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {r["path"]: r for r in report["rows"]}
    assert set(rows) == PATHS
    for row in rows.values():
        assert row["section"] == "groups" and row["ms"] > 0 and row["ratio"] > 0
        assert row["ceiling"] == "device copy"
