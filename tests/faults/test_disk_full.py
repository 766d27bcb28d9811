"""A full disk is CapacityError (RESOURCE_EXHAUSTED at the edge) naming the path: for segment
appends, index commits, fdatasync and a full LMDB map. The failed write is reported to its
caller only; reads go on, later writes succeed once there is room again, and no acknowledged
page is lost (checked after a restart). The file systems are real: small tmpfs mounts, one
under the SSD directory and one just for its index."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from kvstore.client import AsyncClient
from kvstore.config import SsdConfig
from kvstore.errors import CapacityError
from kvstore.keys import Namespace
from kvstore.server.daemon import serve
from kvstore.tiers.ssd.tier import SsdTier
from tests.tiers.test_ssd import make_page

from ..conftest import random_kv, random_tokens
from ..server.helpers import REPO_ROOT, sample_total, small_config
from .helpers import fill
from .ssd_compact_crash import PAGE_BYTES, tier_config

MiB = 1 << 20


def ssd_config(path: Path, **overrides) -> SsdConfig:
    fields = {"path": str(path), "capacity_bytes": 256 * MiB, "segment_bytes": MiB,
              "fsync": "always", "fsync_interval_s": 0.01, **overrides}
    return SsdConfig(**fields)


async def opened(config: SsdConfig) -> SsdTier:
    tier = SsdTier(config)
    await tier.open()
    return tier


async def assert_served(tier: SsdTier, pages) -> None:
    for key, _, data in pages:
        page = await tier.read(key)
        assert page is not None and bytes(page.data) == data


async def test_full_disk_fails_appends_then_recovers(tmp_path, mounts):
    mnt = mounts(tmp_path / "mnt", 8 * MiB)
    config = ssd_config(mnt / "ssd")
    acked = [make_page(i, 20_000) for i in range(20)]
    later = [make_page(100 + i, 200_000) for i in range(6)]
    tier = await opened(config)
    try:
        for key, meta, data in acked:
            assert await tier.write(key, data, meta)
        filler = fill(mnt)
        for key, meta, data in later:
            with pytest.raises(CapacityError, match=f"{mnt}.*file system is full"):
                await tier.write(key, data, meta)
            assert not tier.contains(key)
        await assert_served(tier, acked)
        assert tier.stats().num_blocks == len(acked)
        filler.unlink()
        for key, meta, data in later:
            assert await tier.write(key, data, meta)
        await assert_served(tier, acked + later)
    finally:
        await tier.close()
    tier = await opened(config)
    try:
        await assert_served(tier, acked + later)
        stats = tier.stats()
        assert stats.num_blocks == len(acked + later) and stats.corrupt == 0
    finally:
        await tier.close()


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_full_index_disk_fails_commits_then_recovers(tmp_path, mounts, fsync):
    directory = tmp_path / "ssd"
    directory.mkdir(mode=0o700)
    index = mounts(directory / "index", 512 << 10)  # the index alone on a small file system
    config = ssd_config(directory, fsync=fsync)
    acked = [make_page(i, 1000) for i in range(50)]
    tier = await opened(config)
    try:
        for key, meta, data in acked:
            assert await tier.write(key, data, meta)
        filler = fill(index)
        burst = [make_page(1000 + i, 1000) for i in range(400)]  # new LMDB pages needed
        results = await asyncio.gather(*(tier.write(k, d, m) for k, m, d in burst),
                                       return_exceptions=True)
        failed = [page for page, r in zip(burst, results) if isinstance(r, BaseException)]
        assert failed, "the index commit did not run out of room"
        for r in results:
            assert r is True or (isinstance(r, CapacityError) and str(index) in str(r)
                                 and "file system is full" in str(r)), r
        for key, _, _ in failed:
            assert not tier.contains(key) and await tier.read(key) is None
        acked += [page for page, r in zip(burst, results) if r is True]
        await assert_served(tier, acked)
        filler.unlink()
        for key, meta, data in failed:
            assert await tier.write(key, data, meta)
        acked += failed
        await assert_served(tier, acked)
    finally:
        await tier.close()
    tier = await opened(config)
    try:
        await assert_served(tier, acked)
        assert tier.stats().num_blocks == len(acked)
    finally:
        await tier.close()


async def test_compaction_on_full_index_disk_then_crash_loses_no_page(tmp_path, mounts):
    """Compaction moves a victim's pages while no index commit can succeed, and the process
    dies before one does: the victim segment must still be on disk, since the committed index
    still points into it (it used to be deleted right after the moves)."""
    directory = tmp_path / "ssd"
    directory.mkdir(mode=0o700)
    mounts(directory / "index", 512 << 10)
    child = subprocess.run(
        [sys.executable, "-m", "tests.faults.ssd_compact_crash", str(directory)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    live = json.loads(child.stdout)
    assert "ssd compaction" in child.stderr and "copies failed" in child.stderr
    (directory / "index" / "filler").unlink()
    tier = await opened(tier_config(str(directory)))
    try:
        await assert_served(tier, [make_page(i, PAGE_BYTES) for i in live])
        assert tier.stats().corrupt == 0
    finally:
        await tier.close()


async def test_rebuild_on_a_full_disk_opens_and_commits_later(tmp_path, mounts):
    """A damaged index found while the disk is full: the tier opens on the rebuilt in-memory
    index, serves it, and commits it once there is room (it used to refuse to open)."""
    mnt = mounts(tmp_path / "mnt", 8 * MiB)
    config = ssd_config(mnt, fsync="never")
    pages = [make_page(i, 100) for i in range(1500)]  # an index of about 60 LMDB pages
    tier = await opened(config)
    try:
        assert all(await asyncio.gather(*(tier.write(k, d, m)
                                          for k, m, d in pages)))
    finally:
        await tier.close()
    (mnt / "index" / "data.mdb").write_bytes(bytes(64 << 10))
    filler = fill(mnt, leave_bytes=64 << 10)  # room for a new, empty index; not for the rest
    tier = await opened(config)
    try:
        assert tier.stats().extra["index_resets"] == 1
        assert tier._lmdb.is_behind, "the rebuilt index was committed: the disk had room"
        await assert_served(tier, pages)
        filler.unlink()
        for _ in range(200):  # the flusher commits what the open could not
            if not tier._lmdb.is_behind:
                break
            await asyncio.sleep(0.01)
        assert not tier._lmdb.is_behind
    finally:
        await tier.close()
    tier = await opened(config)
    try:
        assert tier.stats().extra["index_resets"] == 0
        await assert_served(tier, pages)
    finally:
        await tier.close()


async def test_full_index_map_names_the_setting(tmp_path):
    config = ssd_config(tmp_path / "ssd", fsync="never", index_map_bytes=256 << 10)
    acked, refused = [], None
    tier = await opened(config)
    try:
        for i in range(5000):
            key, meta, data = page = make_page(i, 100)
            try:
                assert await tier.write(key, data, meta)
            except CapacityError as exc:
                refused = page
                assert "ssd.index_map_bytes" in str(exc) and str(tmp_path / "ssd") in str(exc)
                break
            acked.append(page)
        assert refused is not None, "the index map never filled"
        assert not tier.contains(refused[0])
        await assert_served(tier, acked)
    finally:
        await tier.close()
    tier = await opened(ssd_config(tmp_path / "ssd", fsync="never", index_map_bytes=64 * MiB))
    try:
        await assert_served(tier, acked)
        key, meta, data = refused
        assert await tier.write(key, data, meta)
    finally:
        await tier.close()


async def test_fdatasync_out_of_space_fails_the_write(tmp_path, monkeypatch):
    """ENOSPC from fdatasync is injected at ``os.fdatasync`` itself: no file system here
    fails it on demand (tmpfs never does; ext4 reserves blocks when the data is written, so
    a full disk fails the write first, as the tests above show)."""
    config = ssd_config(tmp_path / "ssd")
    acked = [make_page(i, 5000) for i in range(5)]
    refused = make_page(99, 5000)
    tier = await opened(config)
    real_fdatasync = os.fdatasync
    try:
        for key, meta, data in acked:
            assert await tier.write(key, data, meta)

        def out_of_space(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fdatasync", out_of_space)
        key, meta, data = refused
        with pytest.raises(CapacityError, match=r"fdatasync of .*seg-\d+\.dat failed: its "
                                                "file system is full"):
            await tier.write(key, data, meta)
        assert not tier.contains(key)
        await assert_served(tier, acked)
        monkeypatch.setattr(os, "fdatasync", real_fdatasync)
        assert await tier.write(key, data, meta)
    finally:
        await tier.close()
    tier = await opened(config)
    try:
        await assert_served(tier, acked + [refused])
    finally:
        await tier.close()


async def test_daemon_put_on_full_disk_is_resource_exhausted(root, mounts, spec):
    """Through the daemon: DRAM full, so a put demotes blocks to an SSD whose disk is full."""
    mnt = mounts(root / "mnt", 4 * MiB)
    config = small_config(root, dram_bytes=MiB, ssd={"path": str(mnt / "ssd")})
    ns = Namespace(model_id="test/model", spec=spec, tenant="acme")
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address, zero_copy=False) as client:
            first = [(random_tokens(64, seed=i), random_kv(spec, 64, seed=i)) for i in range(8)]
            for tokens, kv in first:
                assert await client.put(ns, tokens, kv) == 64
            filler = fill(mnt)
            with pytest.raises(CapacityError, match=f"{mnt}.*file system is full"):
                for i in range(8, 200):  # until DRAM must demote to the full disk
                    await client.put(ns, random_tokens(64, seed=i), random_kv(spec, 64, seed=i))
            for tokens, kv in first:
                assert torch.equal(await client.get(ns, tokens), kv)
            filler.unlink()
            tokens, kv = random_tokens(64, seed=500), random_kv(spec, 64, seed=500)
            assert await client.put(ns, tokens, kv) == 64
            assert (await client.health()).status == "SERVING"
        assert sample_total(daemon.metrics.registry, "kvstore_rpc_errors_total", method="Put",
                            code=grpc.StatusCode.RESOURCE_EXHAUSTED.name) == 1
    finally:
        await daemon.stop(1.0)
