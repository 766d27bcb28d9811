"""``kvstore health``: what the container probes run; exit 0 only on SERVING."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.config import DramConfig, KVStoreConfig, ServerConfig, SsdConfig
from kvstore.server.daemon import Daemon, DaemonThread

from .helpers import REPO, invoke


def test_serving_daemon_exits_0(daemon: Daemon) -> None:
    for service in ("", "kvstore.v1.KVStore"):
        result = invoke("health", "--address", daemon.unix_address, "--service", service)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "SERVING"


def test_socket_path_from_the_config_file_and_env(daemon: Daemon, tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[server]\nsocket_path = "{daemon.socket_path}"\n')
    assert invoke("health", "--config", str(config)).exit_code == 0
    env = {"KVSTORE_SERVER__SOCKET_PATH": daemon.socket_path}
    assert invoke("health", env=env).exit_code == 0


def test_unknown_service_exits_1(daemon: Daemon) -> None:
    result = invoke("health", "--address", daemon.unix_address, "--service", "nope.Nope")
    assert result.exit_code == 1
    assert result.stdout.strip() == "SERVICE_UNKNOWN"


def test_no_daemon_exits_1_with_a_clear_answer(tmp_path: Path) -> None:
    result = invoke("health", "--address", f"unix://{tmp_path}/none.sock", "--timeout", "2")
    assert result.exit_code == 1
    assert result.stdout.strip() == "UNREACHABLE"
    assert "no kvstore daemon answers" in result.stderr


@pytest.fixture
def small(tmp_path: Path) -> KVStoreConfig:
    return KVStoreConfig(
        dram=DramConfig(capacity_bytes=16 << 20, chunk_bytes=1 << 20),
        ssd=SsdConfig(path=str(tmp_path / "ssd"), capacity_bytes=64 << 20, segment_bytes=4 << 20),
        server=ServerConfig(socket_path=str(tmp_path / "run" / "kv.sock"), log_json=False),
    )


def test_draining_daemon_exits_1(small: KVStoreConfig) -> None:
    runner = DaemonThread(small)
    with runner as d:
        assert invoke("health", "--address", d.unix_address).exit_code == 0
        runner.call(d.health.draining())
        result = invoke("health", "--address", d.unix_address)
        assert result.exit_code == 1
        assert result.stdout.strip() == "NOT_SERVING"
        assert "not serving" in result.stderr


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "kvstore", "health", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)


def test_exit_codes_of_the_real_command(daemon: Daemon, tmp_path: Path) -> None:
    ok = _run("--address", daemon.unix_address)
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
    gone = _run("--address", f"unix://{tmp_path}/none.sock", "--timeout", "1")
    assert (gone.returncode, gone.stdout.strip()) == (1, "UNREACHABLE"), gone.stderr
