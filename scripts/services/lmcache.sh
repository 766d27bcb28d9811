# LMCache 0.5.6 for `kvstore bench lmcache` (and its smoke test), in its own venv: its pins
# (a CUDA torch, cupy, cuda-python, numpy<=2.2.6) must not reach .venv.
# `bash scripts/services/lmcache.sh build` builds .venv-lmcache once (about 2 minutes): the CPU
# torch, lmcache without dependencies, then the pure-Python and CPU packages the paths the
# benchmark drives import (its CPU backend, its lm:// server and connector, its multiprocess
# `lmcache server` and the `lmcache bench server` client); no CUDA package.
# `make test` sources this with `start`, which builds nothing (CI time is limited): it exports
# KVSTORE_LMCACHE_PYTHON only when the venv is already there, and the smoke test skips otherwise.
kvstore_lmcache_start() {
    if [ -x "$PWD/.venv-lmcache/bin/python" ]; then
        export KVSTORE_LMCACHE_PYTHON="$PWD/.venv-lmcache/bin/python"
    fi
}

kvstore_lmcache_build() {
    local venv="$PWD/.venv-lmcache"
    local probe='import lmcache.v1.storage_backend.connector.lm_connector, lmcache.v1.server.__main__
import lmcache.v1.multiprocess.http_server, lmcache.cli.commands.bench.server_bench.client'
    if [ ! -x "$venv/bin/python" ] || ! LMCACHE_TRACK_USAGE=false "$venv/bin/python" -c "$probe" \
            >/dev/null 2>&1; then
        echo "building $venv (lmcache==0.5.6 on torch==2.13.0+cpu)" >&2
        "${PYTHON:-python3}" -m venv "$venv"
        "$venv/bin/python" -m pip install -q "torch==2.13.0"
        "$venv/bin/python" -m pip install -q --no-deps "lmcache==0.5.6"
        "$venv/bin/python" -m pip install -q "numpy<=2.2.6" numba pyyaml pyzmq msgspec psutil \
            py-cpuinfo sortedcontainers "prometheus_client<=0.24.1" aiofiles aiofile blake3 \
            redis safetensors cachetools httpx aiohttp requests "transformers>=5.4" \
            cryptography fastapi uvicorn httptools nvtx "protobuf<7,>=6.31.1" \
            "opentelemetry-api<=1.40.0" opentelemetry-sdk \
            "opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0"
    fi
    export KVSTORE_LMCACHE_PYTHON="$venv/bin/python"
}

case "${1:-}" in
    build) kvstore_lmcache_build ;;
    start) kvstore_lmcache_start ;;
    stop) unset KVSTORE_LMCACHE_PYTHON ;;
esac
