"""The vLLM connector end to end: engine A computes prompts and saves them through a real
daemon; a fresh engine B, with vLLM's own prefix caching off, loads the prefixes from kvstore
and produces the same tokens and log-probabilities; a page damaged on disk is recomputed, never
served.

vLLM runs in its own venv (``scripts/services/vllm.sh`` builds ``.venv-vllm`` and exports
``KVSTORE_TEST_VLLM_PYTHON``); the daemon runs from this one.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.keys import Namespace, block_keys
from tests.server.helpers import REPO_ROOT, DaemonProcess, MiB, short_tmpdir, small_config

VLLM_PYTHON = os.environ.get("KVSTORE_TEST_VLLM_PYTHON", "")
ENGINE = Path(__file__).with_name("vllm_engine.py")
IDENTITY_CASES = Path(__file__).with_name("vllm_identity_cases.py")
LOOKUP_CASES = Path(__file__).with_name("vllm_lookup_cases.py")
SAVE_CASES = Path(__file__).with_name("vllm_save_cases.py")
BLOCK_SIZE = 32  # vllm_engine.BLOCK_SIZE
PROMPTS = [list(range(3, 103)), list(range(200, 300))]  # 100 tokens: 3 full blocks each
PREFIX_TOKENS = 96

pytestmark = pytest.mark.skipif(
    not (VLLM_PYTHON and Path(VLLM_PYTHON).exists()),
    reason="no vLLM venv: set KVSTORE_TEST_VLLM_PYTHON (make test builds .venv-vllm with "
           "scripts/services/vllm.sh)")


def run_engine(root: Path, *args: str, timeout_s: float = 240, script: Path = ENGINE) -> None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO_ROOT),
           "VLLM_LOGGING_LEVEL": "WARNING"}
    log = root / f"engine-{len(list(root.glob('engine-*')))}.log"
    with open(log, "w") as out:
        proc = subprocess.run([VLLM_PYTHON, str(script), *args], env=env, stdout=out, check=False,
                              stderr=subprocess.STDOUT, timeout=timeout_s, cwd=root)
    if proc.returncode != 0:
        raise AssertionError(f"engine {args[0]} exited {proc.returncode}:\n"
                             f"{log.read_text()[-4000:]}")


def generate(root: Path, model: Path, address: str, name: str) -> dict:
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = root / f"{name}.json"
    run_engine(root, "generate", str(model), address, str(prompts), str(out))
    return json.loads(out.read_text())


def damage_on_disk(ssd_dir: Path, key: bytes) -> None:
    """Flip bytes in the middle of the stored page of ``key`` in the SSD tier's segment files,
    the daemon stopped (DRAM pages sit in memory no client can write: only the disk can rot)."""
    damaged = 0
    for segment in sorted(p for p in ssd_dir.rglob("*") if p.is_file()):
        data = segment.read_bytes()
        at = data.find(key)
        while at >= 0:
            start = at - 28  # the key's place in a page header (kvstore.page)
            if start >= 0 and data[start:start + 4] == b"KVPG":
                meta_len = struct.unpack_from("<I", data, start + 60)[0]
                payload_len = struct.unpack_from("<Q", data, start + 64)[0]
                middle = start + 80 + meta_len + payload_len // 2
                with open(segment, "r+b") as f:
                    f.seek(middle)
                    f.write(bytes(b ^ 0xFF for b in data[middle:middle + 8]))
                damaged += 1
            at = data.find(key, at + 1)
    assert damaged, f"no page of key {key.hex()} in {ssd_dir}"


@pytest.fixture(scope="module")
def runs():
    """Engine A on both prompts; the daemon stops, writing its blocks to SSD, and the second
    prompt's middle block is damaged on disk; the daemon restarts warm and a fresh engine B
    runs both prompts."""
    root = short_tmpdir()
    config = small_config(root, dram_bytes=64 * MiB, ssd={"persist_on_close": True})
    daemon = DaemonProcess(config, root)
    try:
        daemon.wait_ready()
        model = root / "model"
        run_engine(root, "build", str(model))
        a = generate(root, model, daemon.address, "a")
        ns = Namespace.from_dict(a["namespace"])
        assert daemon.terminate() == 0
        key = block_keys(ns, PROMPTS[1][:PREFIX_TOKENS])[1]
        damage_on_disk(Path(config.ssd.path), bytes(key))
        daemon = DaemonProcess(config, root)
        daemon.wait_ready()
        b = generate(root, model, daemon.address, "b")
        with Client(daemon.address) as kv:
            corrupt = sum(t.corrupt for t in kv.stats().tiers.values())
        yield a, b, corrupt
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)


def test_a_fresh_engine_loads_the_prefix_and_generates_the_same(runs):
    a, b, _ = runs
    first_a, first_b = a["results"][0], b["results"][0]
    assert first_a["num_cached_tokens"] == 0
    assert first_b["num_cached_tokens"] == PREFIX_TOKENS  # the connector's hit: the prefix
    assert first_b["tokens"] == first_a["tokens"]
    assert first_b["logprobs"] == pytest.approx(first_a["logprobs"], rel=1e-4, abs=1e-4)


def test_a_damaged_page_is_recomputed_not_served(runs):
    a, b, corrupt = runs
    second_a, second_b = a["results"][1], b["results"][1]
    assert corrupt >= 1  # the damage was found by verification ...
    assert second_b["tokens"] == second_a["tokens"]  # ... and the block recomputed
    assert second_b["logprobs"] == pytest.approx(second_a["logprobs"], rel=1e-4, abs=1e-4)


def test_connector_copies_round_trip_blocks_exactly():
    """The connector's copies against a real daemon: blocks saved in two steps (the second only
    the new blocks, behind the stored ones) load back byte for byte into other cache blocks,
    and a load from a later block leaves the blocks before it alone."""
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        run_engine(root, "copies", daemon.address, timeout_s=120)
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)


# Tokens request B of each case shares with request A (``vllm_identity_cases.cases``): A's
# prompt is 4 blocks of 32 and one token; an image or changed embedding row in block k leaves
# blocks 0 .. k-1 shared, as vLLM's own block hashes do.
EXPECTED_SHARED_TOKENS = {
    "salt": 0, "salt_vs_none": 0, "none_vs_salt": 0, "long_salt": 0,
    "lora_name": 0, "lora_vs_base": 0, "base_vs_lora": 0, "lora_path": 0, "lora_id": 0,
    "image": 32,  # a different image at tokens 40-59: block 0 is before it
    "image_offset": 32,  # the same image two tokens later, in the same block
    "image_vs_none": 64,  # an image at 70-109 against none: blocks 0 and 1 are text
    "second_image": 96,  # the same first image, and a second one in block 3
    "embeds": 64,  # prompt embeddings differing in row 70 (block 2)
    "embeds_vs_zero_ids": 0,  # token ids equal to the ids vLLM hashes for embeddings
    "unexpressible": 0,
}


def test_requests_differing_in_identity_never_share_a_block():
    """Regression (LMCache#4086, vLLM#44250): keys were the token ids plus the cache salt, so
    requests with the same ids and another LoRA adapter, image or prompt embeddings loaded
    each other's K/V. With real vLLM 0.32 requests driven through both connector halves and a
    real daemon, B shares only the blocks vLLM's own hashes would share; a request like A hits
    all 128 tokens, and one whose extra keys have no canonical form is neither saved nor
    loaded. Beside them, engines of each kv_role: a producer never loads, a consumer never
    saves (before, every role both loaded and saved); and a save that landed comes back as
    vLLM's BlockStored events under vLLM's own block hashes (before, none)."""
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        model = root / "model"
        run_engine(root, "build", str(model))
        out = root / "identity.json"
        run_engine(root, str(model), daemon.address, str(out), script=IDENTITY_CASES)
        results = json.loads(out.read_text())
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
    assert results.pop("plain_keys_unchanged") is True
    assert results.pop("ids_grow_with_the_request") is True
    roles = results.pop("roles")
    assert roles["producer_loads"] == 0  # its own prompt is stored, yet it loads nothing
    assert roles["consumer_loads"] > 0  # it loads what the producer stored
    assert roles["consumer_saved"] == 0  # and stores nothing of its own
    events = results.pop("events")
    assert events == {"media": ["kvstore"], "hashes_match": True, "tokens_match": True,
                      "taken_again": 0}
    reset = results.pop("reset")
    assert reset["before"] > 0 and reset["reset"] is True
    assert reset["after"] == reset["after_salted"] == 0
    assert results.pop("mla_keys_are_one_copy") is True
    assert {name: r["hit"] for name, r in results.items()} == EXPECTED_SHARED_TOKENS
    controls = {name: r["control"] for name, r in results.items()}
    assert controls == {name: 0 if name == "unexpressible" else 128 for name in controls}


def test_a_lookup_on_a_stopped_daemon_does_not_stall_the_scheduler():
    """Regression: the scheduler's lookup was synchronous, so a tier that did not answer (the
    shared Redis tier takes up to ~0.5 s; here a stopped daemon) stalled every request of the
    engine. Now the scheduler is told to ask again (None) while the lookup runs, gets the
    full hit once the daemon answers, and counts a lookup past its give-up time as a miss."""
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        model = root / "model"
        run_engine(root, "build", str(model))
        out = root / "lookups.json"
        run_engine(root, str(model), daemon.address, str(daemon.proc.pid), str(out),
                   script=LOOKUP_CASES)
        results = json.loads(out.read_text())
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
    pending, give_up = results["pending"], results["give_up"]
    assert pending["stopped"] == [None, False]
    assert pending["final"] == [128, False]
    assert give_up["stopped"] == [0, False] and give_up["num_asks"] == 1


@pytest.fixture(scope="module")
def saves():
    """``vllm_save_cases`` against a real daemon it stops and continues."""
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        model = root / "model"
        run_engine(root, "build", str(model))
        out = root / "saves.json"
        run_engine(root, str(model), daemon.address, str(daemon.proc.pid), str(out),
                   script=SAVE_CASES)
        yield json.loads(out.read_text())
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)


def test_a_request_is_reported_finished_only_once_its_put_landed(saves):
    """The scheduler delays freeing a request it planned saves for; the worker names it
    finished (vLLM frees its blocks then) only after the put landed: not while the daemon is
    stopped, and a lookup the moment it is named finds all four blocks."""
    landed = saves["landed"]
    assert landed["delayed"] is True
    assert landed["reported_while_stopped"] == []
    assert landed["stored_when_reported"] == 128


def test_a_stopped_daemon_does_not_stall_steps_and_saves_past_the_cap_are_dropped(saves):
    """Regression: ``wait_for_save`` gathered and put synchronously, so a daemon that did not
    answer stalled every engine step until the client's timeout. Now steps return while the
    daemon is stopped; with room queued for two saves the other three are dropped and
    counted, their requests freed at once, and the two queued land once it continues."""
    cap = saves["cap"]
    assert cap["steps_returned"] is True
    assert cap["delays"] == [True] * 5
    assert cap["reported_while_stopped"] == ["cap2", "cap3", "cap4"]
    assert cap["stopped_stats"]["dropped_saves"] == 3
    assert cap["stopped_stats"]["saved_blocks"] == 0
    assert cap["reported"] == [f"cap{i}" for i in range(5)]
    assert cap["after_stats"]["saved_blocks"] == 8
    assert cap["after_stats"]["failed_saves"] == 0
    assert cap["stored"] == [128, 128, 0, 0, 0]


def test_a_load_from_a_stopped_daemon_becomes_recompute_within_its_deadline(saves):
    """Regression: a worker's load waited on the client's 60 s call deadline inside the
    engine's step when the daemon stopped answering. With ``load_timeout_ms=300`` the step's
    ``start_load_kv`` gives up and reports every planned block as a load error (vLLM
    recomputes them); the bound below is a liveness bound, far from 60 s."""
    stalled = saves["stalled_load"]
    assert stalled["planned_tokens"] == 128
    assert stalled["errors"] == [5, 6, 7, 8]
    assert stalled["elapsed_s"] < 20


def test_beside_another_connector_under_multiconnector():
    """kvstore's connector composed with vLLM's ExampleConnector under MultiConnector (as beside
    a P/D transport): engine A saves through both, a fresh engine B whose ExampleConnector has
    an empty directory loads from kvstore and generates the same. Before, the first stats
    report failed MultiConnector's assertion (no Prometheus metrics) and ended the engine."""
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        model = root / "model"
        run_engine(root, "build", str(model))
        prompts = root / "prompts.json"
        prompts.write_text(json.dumps(PROMPTS))
        runs = {}
        for name in ("a", "b"):
            out = root / f"{name}.json"
            run_engine(root, "generate", str(model), daemon.address, str(prompts), str(out),
                       str(root / f"example-{name}"))
            runs[name] = json.loads(out.read_text())["results"]
        with Client(daemon.address) as kv:
            hits = kv.stats().counters.lookup_hit_tokens
        example_saved = any((root / "example-a").iterdir())
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
    assert [r["tokens"] for r in runs["b"]] == [r["tokens"] for r in runs["a"]]
    assert hits >= len(PROMPTS) * PREFIX_TOKENS  # B's prefixes came from kvstore
    assert example_saved  # the other connector saved as well
