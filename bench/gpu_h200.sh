#!/usr/bin/env bash
# The GPU run behind BENCHMARKS.md, on a machine with torch + triton + CUDA:
#   bench/gpu_h200.sh [tests] [codecs] [tiers] [gpu] [kernels] [transformers] [vllm]
#   (no argument: the first four)
# tests: the GPU cases of the kernel, tier and engine-path tests against their references, and
#        pytest -m gpu (CUDA IPC across processes); codecs: `kvstore bench codecs --no-real
#        --gpu`; tiers: `kvstore bench tiers --total-bytes 1GiB`; gpu: `kvstore bench gpu`;
# kernels: the cache-group kernels' tests (fp8 pass-through, MLA fp8, state snapshots, window
#        loads, the vLLM connector's state groups) and their rows alone, `kvstore bench gpu
#        --groups`;
# transformers: the adapter's device-path tests and bench/gpu_transformers.py (8B shape, 8k and
#        32k prompts); vllm: bench/gpu_vllm.py at the 8B shape and a 32k prefix (prefix cache,
#        kvstore raw/fp8/HBM pool, vLLM's offloading, LMCache), with the CUDA vLLM of
#        ../shared/gpu-engines unpacked in /tmp/vw (VLLM_SITE, LMCACHE_SITE to move it; the
#        configurations in VLLM_CONFIGS, default all).
# Wheels the image lacks (zstandard, lmdb, pytest-asyncio, redis, hiredis; pytest and
# its two dependencies, installed only where the image's pytest is older than 8.2) may sit in
# .whl/. Results go to $OUT (default bench/results). Exit status: any step's failure.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    mapfile -t wheels < <(ls .whl/*.whl | grep -v -E '/(pytest|pluggy|iniconfig)-')
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}"
    if ! python3 -c 'import pytest, sys; sys.exit(tuple(map(int, pytest.__version__.split(".")[:2])) < (8, 2))' \
            && compgen -G ".whl/pytest-*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl
    fi
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests codecs tiers gpu)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
status=0
for step in "${steps[@]}"; do
    case $step in
        tests) python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/codecs tests/tiers \
                   tests/client/test_gpu_path.py tests/gpu 2>&1 | tee "$OUT/gpu-tests.log" \
                   | tail -25 ;;
        codecs) python3 -m kvstore bench codecs --no-real --gpu --json "$OUT/codecs-h200.json" \
                    2>&1 | tee "$OUT/bench-codecs.log" ;;
        tiers) python3 -m kvstore bench tiers --total-bytes 1GiB --ssd-path /tmp/kvstore-bench-ssd \
                   --json "$OUT/tiers-h200.json" 2>&1 | tee "$OUT/bench-tiers.log" ;;
        gpu) python3 -m kvstore bench gpu --json "$OUT/gpu-h200.json" 2>&1 \
                 | tee "$OUT/bench-gpu.log" ;;
        kernels) python3 -m pytest -q -p no:cacheprovider -o addopts="" \
                     tests/codecs/test_engine_passthrough.py tests/codecs/test_state_kernels.py \
                     tests/client/test_gpu_fp8.py tests/client/test_engine_groups.py \
                     tests/integrations/test_vllm_fp8.py tests/integrations/test_vllm_mla.py \
                     tests/integrations/test_vllm_kernels.py tests/bench/test_gpu_groups_bench.py \
                     tests/integrations/test_vllm_states.py \
                     2>&1 | tee "$OUT/gpu-kernels-tests.log" | tail -25 \
                 && python3 -m kvstore bench gpu --groups --json "$OUT/gpu-groups-h200.json" \
                     2>&1 | tee "$OUT/bench-gpu-groups.log" ;;
        transformers) python3 -m pytest -q -p no:cacheprovider -o addopts="" \
                          tests/integrations/test_transformers_device.py \
                          tests/integrations/test_transformers.py 2>&1 \
                          | tee "$OUT/tf-gpu-tests.log" | tail -25 \
                      && python3 bench/gpu_transformers.py --shape 8b --prompt-tokens 8192 32768 \
                          --out "$OUT/transformers-h200.json" 2>&1 | tee "$OUT/tf-bench.log" ;;
        vllm) VLLM_SITE=${VLLM_SITE:-/tmp/vw/site}
              KVSTORE_ENGINE_SITE=$VLLM_SITE KVSTORE_LMCACHE_SITE=${LMCACHE_SITE:-/tmp/vw/lmc} \
              VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
              PYTHONPATH="$VLLM_SITE:$PYTHONPATH:$PWD/bench" python3 bench/gpu_vllm.py --shape 8b \
                  --prefix-tokens 32768 --dram-gib 16 \
                  --configs "${VLLM_CONFIGS:-prefix,kvstore-fp8,kvstore-raw,kvstore-hbm,offload,lmcache}" \
                  --out "$OUT/vllm-8b-h200.json" 2>&1 | tee "$OUT/vllm-bench.log" ;;
        *) echo "unknown step $step (tests, codecs, tiers, gpu, kernels, transformers, vllm)" >&2
           exit 2 ;;
    esac
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
