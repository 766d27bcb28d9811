"""The GPU pool across processes, on a real GPU: engines in other processes map the daemon's
pool through CUDA IPC, save and load through it, race it, and die holding it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import torch

from kvstore.client import Client
from kvstore.codecs.device import device_layout
from kvstore.config import DramConfig, HbmConfig, TierConfig

from ..conftest import REPO_ROOT
from ..server.helpers import DaemonThread, small_config
from .engine_proc import SPEC, namespace, tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MiB = 1 << 20


def engine(role: str, socket: str, seed: int) -> str:
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else "")}
    done = subprocess.run([sys.executable, "-m", "tests.gpu.engine_proc", role, socket,
                           str(seed)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    return done.stdout + done.stderr


@pytest.fixture
def gpu_daemon(tmp_path):
    config = small_config(tmp_path)
    config = dataclasses.replace(config, tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=64 * MiB, device="cuda:0")),
        TierConfig("host", "dram", DramConfig(capacity_bytes=64 * MiB, chunk_bytes=4 * MiB)),
    ))
    with DaemonThread(config) as daemon:
        yield daemon


def test_another_process_loads_what_one_saved(gpu_daemon):
    socket = gpu_daemon.config.server.socket_path
    assert "saved 96" in engine("save", socket, 1)
    assert "loaded 96 ok" in engine("load", socket, 1)


def test_the_daemon_waits_on_the_writers_event(gpu_daemon):
    """The engine's cache is written on a side stream behind a long kernel and saved without
    a host synchronise: what the daemon reads from the slots must be what was written."""
    out = engine("race", gpu_daemon.config.server.socket_path, 2)
    assert "raced 96 ok" in out, out


def test_an_engine_dying_mid_load_or_mid_save_is_reclaimed(gpu_daemon):
    socket = gpu_daemon.config.server.socket_path
    assert "saved 96" in engine("save", socket, 3)
    assert "acquired 96" in engine("die-after-acquire", socket, 3)
    assert "reserved 6" in engine("die-after-reserve", socket, 4)
    with Client(gpu_daemon.unix_address) as client:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = client.stats()
            if stats.active_leases == 0 and stats.active_reservations == 0:
                break
            time.sleep(0.1)
        assert stats.active_leases == 0 and stats.active_reservations == 0
        slot = device_layout("raw", SPEC).nbytes  # the dead writer's slots went back
        assert stats.tiers["gpu"].used_bytes == stats.tiers["gpu"].num_blocks * slot
        # The pool serves others: a restarted engine maps it again at once and loads.
        assert "loaded 96 ok" in engine("load", socket, 3)
        assert client.lookup(namespace(), tokens(4)).matched_tokens == 0
