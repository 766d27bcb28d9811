"""Fixtures for the fault tests: the daemon tests' short temp root and small config, and
small tmpfs mounts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.helpers import mount_tmpfs, unmount
from tests.server.conftest import config, root

__all__ = ["config", "mounts", "root"]


@pytest.fixture
def mounts():
    """``mount(path, size_bytes)`` mounts a small tmpfs; all are unmounted afterwards,
    innermost first."""
    mounted: list[Path] = []

    def mount(path: Path, size_bytes: int) -> Path:
        mount_tmpfs(path, size_bytes)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        unmount(path)
