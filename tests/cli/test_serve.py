"""``kvstore serve``: flags, env vars, file and --set onto one config, and a real daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.server.daemon import Daemon

from .helpers import REPO, invoke


def test_serve_flags_env_file_and_set_map_onto_config(tmp_path: Path) -> None:
    config_file = tmp_path / "kvstore.toml"
    config_file.write_text('[ssd]\npath = "/from/file"\ncodec = "zstd"\n'
                           '[server]\nadmin_token = "secret"\n')
    result = invoke("serve", "--dry-run", "--config", str(config_file),
                    "--dram-capacity", "1GiB", "--set", "ssd.capacity_bytes=2GiB",
                    "--metrics-port", "9400", env={"KVSTORE_SSD__PATH": "/from/env"})
    assert result.exit_code == 0, result.output
    effective = json.loads(result.stdout)
    assert effective["dram"]["capacity_bytes"] == 1 << 30  # flag
    assert effective["ssd"]["capacity_bytes"] == 2 << 30  # --set
    assert effective["ssd"]["path"] == "/from/env"  # env beats the file
    assert effective["ssd"]["codec"] == "zstd"  # file
    assert effective["server"]["metrics_port"] == 9400
    assert effective["server"]["admin_token"] == "***"  # never printed


def test_serve_set_wins_over_flag() -> None:
    result = invoke("serve", "--dry-run", "--dram-capacity", "1GiB",
                    "--set", "dram.capacity_bytes=2GiB")
    assert json.loads(result.stdout)["dram"]["capacity_bytes"] == 2 << 30


@pytest.mark.parametrize("args, message", [
    (["--set", "dram.capacity_bytes=lots"], "dram.capacity_bytes: cannot parse size"),
    (["--set", "dram.no_such_field=1"], "unknown config field dram.no_such_field"),
    (["--set", "nonsense"], "expected section.field=value"),
    (["--log-level", "LOUD"], "server.log_level must be"),
    (["--config", "/no/such/kvstore.toml"], "cannot read config file /no/such/kvstore.toml"),
])
def test_serve_config_errors_are_one_line(args: list[str], message: str) -> None:
    result = invoke("serve", *args)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ")
    assert message in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_serve_runs_a_daemon_until_sigterm(tmp_path: Path) -> None:
    """`kvstore serve` as a real process: it answers `stats`, then drains on SIGTERM, exit 0."""
    sock = tmp_path / "serve.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--socket", str(sock),
         "--dram-capacity", "16MiB", "--ssd-path", str(tmp_path / "ssd"),
         "--ssd-capacity", "64MiB", "--set", "dram.chunk_bytes=1MiB"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sock.exists(), proc.stderr.read() if proc.poll() is not None else "no socket"
        result = invoke("stats", "--json", "--address", f"unix://{sock}")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["tiers"]["dram"]["capacity_bytes"] == 16 << 20
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert not sock.exists()


def test_serve_refuses_a_socket_already_served(daemon: Daemon) -> None:
    """A real process: the daemon's logging setup stays out of this test process."""
    proc = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--socket",
                           daemon.socket_path], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and daemon.socket_path in proc.stderr
    assert "Traceback" not in proc.stderr


def test_remote_url_flag_adds_the_shared_tier_last_and_is_never_printed() -> None:
    from kvstore.config import load_config

    result = invoke("serve", "--dry-run", "--remote-url", "redis://app:s3cret@cache:6379",
                    "--set", "remote.ttl_s=60")
    assert result.exit_code == 0, result.output
    assert "s3cret" not in result.output
    effective = json.loads(result.stdout)
    assert effective["remote"]["url"] == "redis://app:***@cache:6379"
    assert effective["remote"]["ttl_s"] == 60.0
    chain = load_config(overrides={"remote": {"url": "redis://cache:6379"}}).tier_chain()
    assert [(t.name, t.kind) for t in chain] == [("dram", "dram"), ("ssd", "ssd"),
                                                 ("remote", "remote")]
    tables = invoke("serve", "--dry-run", "--set", "remote.url=redis://:pw@h:1")
    assert "pw@" not in tables.output
