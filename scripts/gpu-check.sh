#!/usr/bin/env bash
# On a CUDA machine: the GPU tests (pytest -m gpu and the GPU cases of the engine kernels, the
# HBM tier and the engine's GPU path), then `kvstore bench gpu`. Logs and JSON go to $OUT.
#   scripts/gpu-check.sh [--quick] [--tests-only|--bench-only] [extra bench args...]
# Wheels of packages the machine lacks may be carried in .whl/ (installed to /tmp/site).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    mapfile -t wheels < <(ls .whl/*.whl | grep -v -E '/(pytest|pluggy|iniconfig)-')
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${wheels[@]}" || exit 1
    if ! python3 -c 'import pytest, sys; sys.exit(tuple(map(int, pytest.__version__.split(".")[:2])) < (8, 2))'; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl || exit 1
    fi
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
mode=all; bench_args=()
for arg in "$@"; do
    case $arg in
        --tests-only) mode=tests ;;
        --bench-only) mode=bench ;;
        *) bench_args+=("$arg") ;;
    esac
done
status=0
if [ "$mode" != bench ]; then
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/codecs/test_engine_kernels.py \
        tests/tiers/test_hbm.py tests/client/test_gpu_path.py tests/gpu \
        tests/codecs/test_fp8.py tests/codecs/test_fp4.py 2>&1 | tee "$OUT/tests.log" | tail -40
    status=${PIPESTATUS[0]}
fi
if [ "$mode" != tests ]; then
    python3 -m kvstore bench gpu --json "$OUT/bench-gpu.json" "${bench_args[@]}" 2>&1 \
        | tee "$OUT/bench.log"
    status=$(( status | PIPESTATUS[0] ))
fi
exit $status
