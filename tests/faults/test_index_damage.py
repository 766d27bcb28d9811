"""A damaged LMDB index is a cold start, not an outage: the tier moves it aside, counts it,
rebuilds the index from the self-describing pages in the segments and serves every page
written before the damage again, bit-exact. Opening runs in a child process, so a SIGBUS
(what a truncated LMDB file did to a reader) would show as its exit status."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import torch

from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.tiers.ssd import index_check as ssd_index_check
from kvstore.tiers.ssd.tier import SsdTier
from tests.faults.ssd_reopen import damage_page, reopen, tier_config

from ..conftest import random_kv, random_tokens
from ..server.helpers import REPO_ROOT, DaemonProcess, small_config

NUM_PAGES = 1000  # an index of about a hundred LMDB pages: a cut lands mid-tree
LMDB_PAGE_BYTES = 4096


async def write_pages(directory: Path, count: int = NUM_PAGES) -> None:
    tier = SsdTier(tier_config(str(directory)))
    await tier.open()
    try:
        pages = [damage_page(i) for i in range(count)]
        assert all(await asyncio.gather(*(tier.write(k, d, m)
                                          for k, m, d in pages)))
    finally:
        await tier.close()


def reopen_in_child(directories: list[Path], count: int = NUM_PAGES
                    ) -> tuple[dict[Path, dict], str]:
    """Open each directory's tier in turn in one child process: its results by directory,
    and its log."""
    child = subprocess.run(
        [sys.executable, "-m", "tests.faults.ssd_reopen", str(count), *map(str, directories)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr[-2000:]}"
    assert "Traceback" not in child.stderr, child.stderr
    results = [json.loads(line) for line in child.stdout.splitlines()]
    return {Path(r.pop("path")): r for r in results}, child.stderr


def _overwrite(path: Path, start: int, length: int | None = None) -> None:
    size = path.stat().st_size
    length = size - start if length is None else length
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(random.Random(1).randbytes(length))


def overwrite_pages(index: Path) -> None:
    _overwrite(index / "data.mdb", 2 * LMDB_PAGE_BYTES)  # the tree; the meta pages survive


def overwrite_meta(index: Path) -> None:
    _overwrite(index / "data.mdb", 0, 2 * LMDB_PAGE_BYTES)


def truncate_to_few_bytes(index: Path) -> None:
    os.truncate(index / "data.mdb", 5)


def truncate_to_half(index: Path) -> None:
    os.truncate(index / "data.mdb", (index / "data.mdb").stat().st_size // 2)


def replace_with_garbage(index: Path) -> None:
    (index / "data.mdb").write_bytes(random.Random(2).randbytes(64 << 10))


def zero_it(index: Path) -> None:
    path = index / "data.mdb"
    path.write_bytes(bytes(path.stat().st_size))


def delete_lock_and_overwrite(index: Path) -> None:
    (index / "lock.mdb").unlink()
    overwrite_pages(index)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "overwrite_pages": overwrite_pages, "overwrite_meta": overwrite_meta,
    "truncate_to_few_bytes": truncate_to_few_bytes, "truncate_to_half": truncate_to_half,
    "replace_with_garbage": replace_with_garbage, "zero_it": zero_it,
    "delete_lock_and_overwrite": delete_lock_and_overwrite,
}


def delete_index(index: Path) -> None:
    for name in ("data.mdb", "lock.mdb"):
        (index / name).unlink()
    index.rmdir()


def damage_a_page_and_the_index(index: Path) -> None:
    """Page 7 damaged in its segment, a torn append after the last page, the index garbage."""
    segments = sorted(index.parent.glob("seg-*.dat"))
    _, _, victim = damage_page(7)
    blob = segments[0].read_bytes()
    at = blob.index(victim) + len(victim) - 50
    with open(segments[0], "r+b") as f:
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in blob[at:at + 8]))
    with open(segments[-1], "ab") as f:
        f.write(b"KVPG" + random.Random(3).randbytes(9000))
    replace_with_garbage(index)


def empty_index(index: Path) -> None:
    """What a rebuild that died before its commit leaves: a new index with nothing in it."""
    delete_index(index)
    index.mkdir(mode=0o700)
    env = lmdb.open(str(index), max_dbs=1)
    env.open_db(b"pages")
    env.close()


CASES = {**DAMAGE, "delete_index": delete_index, "empty_index": empty_index,
         "damage_a_page_and_the_index": damage_a_page_and_the_index}


@pytest.fixture(scope="module")
def reopened(tmp_path_factory) -> tuple[dict[str, dict], str, Path]:
    """Every case, each in its own directory, all reopened by one child process (the
    child's start-up, mostly importing torch, costs more than its work)."""
    root = tmp_path_factory.mktemp("damage")
    for name, damage in CASES.items():
        asyncio.run(write_pages(root / name))
        damage(root / name / "index")
    results, log = reopen_in_child([root / name for name in CASES])
    return {path.name: result for path, result in results.items()}, log, root


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_damaged_index_is_rebuilt_from_segments(reopened, damage):
    results, log, root = reopened
    directory = root / damage
    assert results[damage] == {"num_blocks": NUM_PAGES, "index_resets": 1,
                               "exact": NUM_PAGES, "missing": [], "corrupt": 0}
    assert f"ssd index in {directory} is damaged" in log
    moved = list(directory.glob("index.corrupt-*"))
    assert len(moved) == 1 and (moved[0] / "data.mdb").exists()  # kept for inspection
    assert await reopen(str(directory), NUM_PAGES) == {  # the rebuilt index was committed
        "num_blocks": NUM_PAGES, "index_resets": 0, "exact": NUM_PAGES, "missing": [],
        "corrupt": 0}


def test_missing_index_is_rebuilt_from_segments(reopened):
    """It used to mean an empty tier: every segment was deleted as holding no indexed page."""
    results, log, root = reopened
    assert results["delete_index"]["exact"] == NUM_PAGES
    assert results["delete_index"]["index_resets"] == 0
    assert f"ssd index in {root / 'delete_index'} is missing" in log


def test_empty_index_beside_segments_is_rebuilt(reopened):
    results, log, root = reopened
    assert results["empty_index"]["exact"] == NUM_PAGES
    assert results["empty_index"]["index_resets"] == 0
    assert f"ssd index in {root / 'empty_index'} is empty" in log


async def test_damaged_index_on_its_own_mount_is_moved_aside_inside_it(tmp_path, mounts):
    """``index/`` as a mount point cannot be renamed: the damaged file is renamed inside it."""
    directory = tmp_path / "ssd"
    directory.mkdir(mode=0o700)
    index = mounts(directory / "index", 4 << 20)
    await write_pages(directory, 100)
    replace_with_garbage(index)
    result = await reopen(str(directory), 100)
    assert result["exact"] == 100 and result["index_resets"] == 1
    assert len(list(index.glob("data.mdb.corrupt-*"))) == 1


def test_rebuild_skips_damaged_pages_and_torn_tails(reopened):
    results, _, _ = reopened
    assert results["damage_a_page_and_the_index"] == {
        "num_blocks": NUM_PAGES - 1, "index_resets": 1, "exact": NUM_PAGES - 1,
        "missing": [7], "corrupt": 0}


def test_daemon_restarts_cold_after_index_damage(root, spec):
    """Through the daemon: blocks persisted to SSD, the index truncated while it was down;
    the next start serves every block again and reports the reset in its stats."""
    config = small_config(root, log_level="INFO")
    ns = Namespace(model_id="test/model", spec=spec, tenant="acme")
    prefixes = [(random_tokens(320, seed=i), random_kv(spec, 320, seed=i)) for i in range(10)]
    proc = DaemonProcess(config, root)
    try:
        proc.wait_ready()
        with Client(proc.address, zero_copy=False) as client:
            for tokens, kv in prefixes:
                assert client.put(ns, tokens, kv) == 320
        assert proc.terminate() == 0  # persists the DRAM blocks to SSD
    finally:
        proc.kill()
    truncate_to_half(Path(config.ssd.path) / "index")

    proc = DaemonProcess(config, root)
    try:
        proc.wait_ready()
        with Client(proc.address, zero_copy=False) as client:
            for tokens, kv in prefixes:
                assert torch.equal(client.get(ns, tokens), kv)
            assert client.stats().tiers["ssd"].extra["index_resets"] == 1
        assert proc.terminate() == 0
    finally:
        proc.kill()
    warnings = [e for e in proc.events() if e["level"] == "WARNING" and "is damaged" in e["msg"]]
    assert len(warnings) == 1 and warnings[0]["moved_to"].startswith(config.ssd.path)
    assert not any("exc" in e for e in proc.events())


async def test_check_exit_statuses(tmp_path):
    """The child's verdicts: 0 for a sound index, DAMAGED for garbage, UNAVAILABLE where it
    cannot import lmdb (here: no site-packages), which the tier takes for "not checked"."""
    directory = tmp_path / "ssd"
    await write_pages(directory, 50)
    index = directory / "index"

    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *flags, ssd_index_check.__file__, str(index),
                               "pages"], capture_output=True, text=True, timeout=60,
                              check=False)

    assert run().returncode == 0
    assert run("-S", "-I").returncode == ssd_index_check.UNAVAILABLE
    replace_with_garbage(index)
    damaged = run()
    assert damaged.returncode == ssd_index_check.DAMAGED and "MDB_INVALID" in damaged.stderr
