"""File systems for the fault tests: small tmpfs mounts, and filling one up."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest


def mount_tmpfs(path: Path, size_bytes: int) -> None:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (mode 0700); skip the test if we cannot."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700",
                           "tmpfs", str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path, leave_bytes: int = 0) -> Path:
    """Write a file into ``directory`` until its file system has no room left, then give
    ``leave_bytes`` of it back."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        chunk = bytes(64 << 10)
        while True:
            try:
                if os.write(fd, chunk) == 0:
                    break
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[:len(chunk) // 2]
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave_bytes))
    finally:
        os.close(fd)
    return filler
