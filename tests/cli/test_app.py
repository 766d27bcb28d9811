"""What every command shares: the entry points, usage errors and reaching the daemon."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from kvstore import __version__
from kvstore.cli import app
from kvstore.server.daemon import Daemon

from .helpers import REPO, invoke


@pytest.mark.parametrize("argv", [
    [sys.executable, "-m", "kvstore", "version"],
    [str(Path(sys.executable).parent / "kvstore"), "version"],
])
def test_real_process(argv: list[str]) -> None:
    """`python -m kvstore` and the installed console script run the same app."""
    if not os.path.exists(argv[0]):
        pytest.skip(f"{argv[0]} is not installed")
    # PYTHONPATH: run this checkout's code whatever state the installed package is in.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"kvstore {__version__}"


def test_help_lists_the_commands_in_order() -> None:
    """The command modules register on import; `kvstore --help` keeps serve first."""
    group = typer.main.get_command(app)
    assert list(group.commands) == ["serve", "stats", "ls", "evict", "doctor", "version", "health",
                                    "bench", "deploy", "pin"]
    assert list(group.commands["bench"].commands) == ["tiers", "rpc", "codecs", "gpu",
                                                      "policy", "remote", "lmcache", "scale",
                                                      "engine"]


def test_usage_error_exits_2() -> None:
    result = invoke("ls", "--limit", "-1")
    assert result.exit_code == 2


def test_unreachable_daemon_names_address_and_serve(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/absent.sock"
    result = invoke("stats", "--address", address)
    assert result.exit_code == 1
    assert address in result.stderr and "kvstore serve" in result.stderr


def test_address_from_environment(daemon: Daemon) -> None:
    result = invoke("stats", "--json", env={"KVSTORE_ADDRESS": daemon.unix_address})
    assert result.exit_code == 0, result.output
