"""The SSD tier's files (segments, LOCK, the LMDB index) are 0600 in 0700 directories,
whatever the umask; an older, looser layout of ours is tightened at open; a directory owned
by another user is refused, naming it."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from tests.tiers.test_ssd import config, make_page, opened

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
OTHER_UID = 12345


@pytest.fixture
def loose_umask():
    old = os.umask(0)
    yield
    os.umask(old)


def modes(directory: Path) -> dict[str, int]:
    """Path (relative to ``directory``, "." for itself) -> permission bits, for everything."""
    found = {".": stat.S_IMODE(os.lstat(directory).st_mode)}
    for path in directory.rglob("*"):
        found[str(path.relative_to(directory))] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


def assert_private(directory: Path) -> None:
    found = modes(directory)
    assert {"LOCK", "index", "index/data.mdb", "index/lock.mdb"} <= set(found)
    assert any(name.startswith("seg-") for name in found)
    for name, mode in found.items():
        is_dir = (directory / name).is_dir()
        assert mode == (0o700 if is_dir else 0o600), f"{name} is {mode:04o}"


async def write_pages(directory: Path, count: int = 8) -> None:
    tier = await opened(config(directory))
    try:
        pages = [make_page(i, 300_000) for i in range(count)]  # more than one 1 MiB segment
        assert all(await asyncio.gather(*(tier.write(k, d, m)
                                          for k, m, d in pages)))
        assert_private(directory)
    finally:
        await tier.close()


async def test_files_are_private_whatever_the_umask(tmp_path, loose_umask):
    directory = tmp_path / "cache" / "ssd"
    await write_pages(directory)
    assert len(list(directory.glob("seg-*.dat"))) >= 2
    assert_private(directory)


async def test_looser_layout_of_ours_is_tightened(tmp_path, loose_umask):
    directory = tmp_path / "ssd"
    await write_pages(directory)
    for path in [directory, *directory.rglob("*")]:  # what an older version left behind
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    tier = await opened(config(directory))
    try:
        assert_private(directory)
        assert tier.stats().num_blocks == 8
    finally:
        await tier.close()


@needs_root
@pytest.mark.parametrize("foreign", [".", "index"])
async def test_directory_of_another_user_is_refused(tmp_path, foreign):
    directory = tmp_path / "ssd"
    await write_pages(directory)
    target = directory / foreign
    os.chown(target, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"{target.resolve()} is owned by uid {OTHER_UID}"):
        await opened(config(directory))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700  # left as it was


async def test_a_file_in_place_of_the_directory_is_refused(tmp_path):
    directory = tmp_path / "ssd"
    directory.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"ssd.path {directory} is not a directory"):
        await opened(config(directory))
