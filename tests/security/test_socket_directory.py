"""The socket directory is ours alone before the daemon uses it: created 0700 when missing;
a symlink, a directory of another user or one that group or others may write is refused,
naming the path and the fault; the lock file is 0600 and never opened through a symlink."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.server.daemon import serve

from ..server.helpers import REPO_ROOT, short_tmpdir

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
OTHER_UID = 12345


def mode_of(path: Path | str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def loose_umask():
    old = os.umask(0)
    yield
    os.umask(old)


async def test_missing_directory_is_created_private(config, loose_umask):
    socket_dir = Path(config.server.socket_path).parent
    assert not socket_dir.exists()
    daemon = await serve(config)
    try:
        assert mode_of(socket_dir) == 0o700 and os.stat(socket_dir).st_uid == os.geteuid()
        assert mode_of(f"{config.server.socket_path}.lock") == 0o600
        assert mode_of(config.server.socket_path) == 0o600
    finally:
        await daemon.stop(1.0)


async def test_symlinked_directory_is_refused(config, root):
    socket_dir = Path(config.server.socket_path).parent
    target = root / "elsewhere"
    target.mkdir(mode=0o700)
    socket_dir.symlink_to(target)
    with pytest.raises(ConfigError, match=f"socket directory {socket_dir} .* is a symlink"):
        await serve(config)
    assert list(target.iterdir()) == []  # nothing was created through the link


async def test_world_writable_directory_is_refused(config):
    socket_dir = Path(config.server.socket_path).parent
    socket_dir.mkdir()
    os.chmod(socket_dir, 0o777)
    with pytest.raises(ConfigError, match=f"{socket_dir} .* writable by group or others "
                                          r"\(mode 0777\)"):
        await serve(config)
    os.chmod(socket_dir, 0o770)
    with pytest.raises(ConfigError, match="writable by group or others"):
        await serve(config)
    assert list(socket_dir.iterdir()) == []


@needs_root
async def test_directory_of_another_user_is_refused(config):
    socket_dir = Path(config.server.socket_path).parent
    socket_dir.mkdir(mode=0o700)
    os.chown(socket_dir, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"{socket_dir} .* owned by uid {OTHER_UID}"):
        await serve(config)
    assert list(socket_dir.iterdir()) == []


async def test_symlinked_lock_file_is_refused(config, root):
    socket_dir = Path(config.server.socket_path).parent
    socket_dir.mkdir(mode=0o700)
    victim = root / "victim"
    victim.write_text("keep me")
    os.symlink(victim, f"{config.server.socket_path}.lock")
    with pytest.raises(ConfigError, match="lock file .* is a symlink"):
        await serve(config)
    assert victim.read_text() == "keep me" and mode_of(victim) != 0o600


async def test_loose_lock_file_is_tightened(config):
    socket_dir = Path(config.server.socket_path).parent
    socket_dir.mkdir(mode=0o700)
    lock = Path(f"{config.server.socket_path}.lock")
    lock.touch()
    os.chmod(lock, 0o666)
    daemon = await serve(config)
    try:
        assert mode_of(lock) == 0o600
    finally:
        await daemon.stop(1.0)


def _run_default_daemon(tmpdir: Path) -> subprocess.Popen:
    """The daemon with its default socket path (``$TMPDIR/kvstore-<uid>/kvstore.sock`` when
    no ``XDG_RUNTIME_DIR`` is set), SSD off and a small DRAM tier."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSTORE_") and k != "XDG_RUNTIME_DIR"}
    env.update(TMPDIR=str(tmpdir), PYTHONPATH=str(REPO_ROOT))
    args = ["ssd.enabled=false", "dram.capacity_bytes=16MiB", "dram.chunk_bytes=1MiB",
            "server.log_level=WARNING"]
    command = [sys.executable, "-m", "kvstore.server.daemon"]
    command += [item for arg in args for item in ("--set", arg)]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture
def tmpdir_root():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_default_socket_directory_is_checked(tmpdir_root):
    default_dir = tmpdir_root / f"kvstore-{os.getuid()}"
    planted = tmpdir_root / "planted"
    planted.mkdir(mode=0o700)
    default_dir.symlink_to(planted)  # what another local user could have left in /tmp
    proc = _run_default_daemon(tmpdir_root)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert f"socket directory {default_dir}" in err and "symlink" in err
    assert "Traceback" not in err and list(planted.iterdir()) == []

    default_dir.unlink()
    proc = _run_default_daemon(tmpdir_root)
    try:
        sock = default_dir / "kvstore.sock"
        deadline = time.monotonic() + 120
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists(), proc.stderr.read() if proc.poll() is not None else "timeout"
        assert mode_of(default_dir) == 0o700 and mode_of(sock) == 0o600
        assert mode_of(f"{sock}.lock") == 0o600
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
