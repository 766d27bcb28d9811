#!/usr/bin/env bash
# The GPU run behind BENCHMARKS.md: kernel tests against their torch references on a real GPU,
# then the codec and tier benchmarks. Expects a machine with torch + triton + CUDA; wheels the
# image lacks (zstandard, xxhash, lmdb, pytest-asyncio) may sit in .whl/. Results go to $OUT
# (default bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/codecs tests/tiers tests/test_store.py \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -25
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/bench.log"
import sys
from kvstore.bench.codecs import run_codec_bench
from kvstore.bench.report import write_report
from kvstore.bench.tiers import run_tier_bench
out = sys.argv[1]
write_report(run_codec_bench(real=False, gpu=True), f"{out}/codecs-h200.json",
             command="kvstore bench codecs --no-real --gpu")
write_report(run_tier_bench(total_bytes=1 << 30, ssd_path="/tmp/kvstore-bench-ssd"),
             f"{out}/tiers-h200.json", command="kvstore bench tiers --total-bytes 1GiB")
PY
