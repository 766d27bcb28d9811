"""``bench/gpu_transformers.py --shape micro`` end to end on the CPU (the device path through
Triton's interpreter): every configuration has its row, the wrapped rows reused the prefix and
raw pages give plain generation's first token. No timings are checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="5.17")

REPO = Path(__file__).resolve().parents[2]


def test_micro_run_has_every_configuration(tmp_path):
    out = tmp_path / "tf.json"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_transformers.py"),
                          "--shape", "micro", "--prompt-tokens", "48", "--reps", "1",
                          "--dram-gib", "1", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "device-fp8" in run.stdout  # the table
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain", "device-raw", "device-fp8", "host-raw"}
    for name in ("device-raw", "device-fp8", "host-raw"):
        assert rows[name]["reused_tokens"] == 32 and rows[name]["prompt_tokens"] == 48
    assert rows["device-raw"]["same_first_token"] and rows["host-raw"]["same_first_token"]
    assert rows["device-raw"]["cold_saved_tokens"] == 48
