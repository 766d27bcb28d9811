"""stats, ls, evict, doctor and version against a real daemon on a Unix socket."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore import __version__
from kvstore.server.daemon import Daemon

from .helpers import invoke, listed, put_blocks


def test_version() -> None:
    result = invoke("version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"kvstore {__version__}"


# ------------------------------------------------------------------------------ stats, ls


def test_stats_table_and_json(daemon: Daemon, spec) -> None:
    put_blocks(daemon, spec, "stats-tenant", 2)
    table = invoke("stats", "--address", daemon.unix_address)
    assert table.exit_code == 0, table.output
    for word in ("dram", "ssd", "hit rate", "evictions", "lookups", "puts"):
        assert word in table.stdout
    data = json.loads(invoke("stats", "--address", daemon.unix_address, "--json").stdout)
    assert set(data["tiers"]) == {"dram", "ssd"}
    assert data["puts"] >= 1 and data["tiers"]["dram"]["num_blocks"] >= 2
    mine = json.loads(invoke("stats", "--address", daemon.unix_address, "--json",
                             "--tenant", "stats-tenant").stdout)
    assert mine["tiers"]["dram"]["num_blocks"] == 2


def test_ls_lists_and_filters(daemon: Daemon, spec) -> None:
    put_blocks(daemon, spec, "ls-tenant", 3, seed=1)
    rows = listed(daemon, "--tenant", "ls-tenant")
    assert len(rows) == 3
    assert {r["tenant"] for r in rows} == {"ls-tenant"}
    assert sorted(r["block_index"] for r in rows) == [0, 1, 2]
    assert all(len(r["key"]) == 32 and "dram" in r["tiers"] for r in rows)
    limited = listed(daemon, "--tenant", "ls-tenant", "--limit", "1")
    assert len(limited) == 1 and limited[0]["key"] in {r["key"] for r in rows}
    assert listed(daemon, "--tenant", "ls-tenant", "--model", "other/model") == []
    table = invoke("ls", "--address", daemon.unix_address, "--tenant", "ls-tenant")
    assert rows[0]["key"] in table.stdout and "3 blocks" in table.stdout


def test_ls_unknown_tier_is_a_clean_error(daemon: Daemon) -> None:
    result = invoke("ls", "--address", daemon.unix_address, "--tier", "tape")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and "tape" in result.stderr


def test_stats_watch_refreshes_until_ctrl_c(daemon: Daemon, monkeypatch) -> None:
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("kvstore.cli.admin.time.sleep", sleep)
    lines = invoke("stats", "--address", daemon.unix_address, "--watch", "0.5", "--json")
    assert lines.exit_code == 0
    assert [json.loads(line)["tiers"].keys() for line in lines.stdout.splitlines()] == [
        {"dram", "ssd"}] * 2
    naps.clear()
    live = invoke("stats", "--address", daemon.unix_address, "--watch", "0.5")
    assert live.exit_code == 0 and "dram" in live.stdout and naps == [0.5, 0.5]


# ------------------------------------------------------------------------------------ evict


def test_evict_asks_and_respects_no(daemon: Daemon, spec) -> None:
    put_blocks(daemon, spec, "keep-tenant", 2, seed=2)
    result = invoke("evict", "--address", daemon.unix_address, "--tenant", "keep-tenant",
                    input="n\n")
    assert result.exit_code == 1 and "Aborted" in result.output
    assert "tenant 'keep-tenant'" in result.output
    assert len(listed(daemon, "--tenant", "keep-tenant")) == 2


def test_evict_confirmed_and_by_key(daemon: Daemon, spec) -> None:
    put_blocks(daemon, spec, "gone-tenant", 3, seed=3)
    rows = listed(daemon, "--tenant", "gone-tenant")
    leaf = max(rows, key=lambda r: r["block_index"])
    by_key = invoke("evict", "--address", daemon.unix_address, "--key", leaf["key"], "--yes")
    assert by_key.exit_code == 0 and "evicted 1 block" in by_key.stdout
    assert len(listed(daemon, "--tenant", "gone-tenant")) == 2
    confirmed = invoke("evict", "--address", daemon.unix_address, "--tenant", "gone-tenant",
                       input="y\n")
    assert confirmed.exit_code == 0 and "evicted 2 blocks" in confirmed.stdout
    assert listed(daemon, "--tenant", "gone-tenant") == []


@pytest.mark.parametrize("args, message", [
    ([], "say what to evict"),
    (["--all", "--tenant", "x"], "--all cannot be combined"),
    (["--key", "abc"], "32 hex digits"),
    (["--key", "zz" * 16], "not hexadecimal"),
])
def test_evict_usage_errors(args: list[str], message: str) -> None:
    result = invoke("evict", "--yes", "--address", "unix:///nowhere.sock", *args)
    assert result.exit_code == 2
    assert message in result.output


# ----------------------------------------------------------------------------------- doctor


def _doctor_config(tmp_path: Path, socket_path: str) -> Path:
    path = tmp_path / "doctor.toml"
    path.write_text(f'[ssd]\npath = "{tmp_path / "ssd"}"\ncapacity_bytes = "1MiB"\n'
                    f'[dram]\ncapacity_bytes = "1MiB"\n[server]\nsocket_path = "{socket_path}"\n')
    return path


def test_doctor_with_a_live_daemon(daemon: Daemon, tmp_path: Path) -> None:
    config = _doctor_config(tmp_path, daemon.socket_path)
    result = invoke("doctor", "--config", str(config), "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert result.exit_code == 0, result.output
    assert checks["torch"]["ok"] and checks["daemon"]["ok"]
    assert "SERVING" in checks["daemon"]["detail"]
    assert {"cuda", "cupy", "triton", "shm", "memlock", "ssd dir", "disk space",
            "o_direct"} <= set(checks)
    assert not checks["cuda"]["required"] and not checks["cupy"]["required"]
    table = invoke("doctor", "--config", str(config))
    assert table.exit_code == 0 and "o_direct" in table.stdout


def test_doctor_without_a_daemon_only_warns(tmp_path: Path) -> None:
    config = _doctor_config(tmp_path, str(tmp_path / "none.sock"))
    checks = json.loads(invoke("doctor", "--config", str(config), "--json").stdout)
    daemon_check = next(c for c in checks if c["name"] == "daemon")
    assert daemon_check["status"] == "warn" and "kvstore serve" in daemon_check["detail"]


def test_doctor_fails_on_a_dead_socket(tmp_path: Path) -> None:
    dead = tmp_path / "dead.sock"
    dead.write_text("")  # present, answers nothing
    config = _doctor_config(tmp_path, str(dead))
    result = invoke("doctor", "--config", str(config), "--json")
    assert result.exit_code == 1
    daemon_check = next(c for c in json.loads(result.stdout) if c["name"] == "daemon")
    assert daemon_check["status"] == "fail"


def test_doctor_fails_when_the_ssd_dir_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = tmp_path / "bad.toml"
    config.write_text(f'[ssd]\npath = "{blocker}"\n[server]\nsocket_path = "{tmp_path}/s"\n')
    result = invoke("doctor", "--config", str(config), "--json")
    assert result.exit_code == 1
    ssd = next(c for c in json.loads(result.stdout) if c["name"] == "ssd dir")
    assert ssd["status"] == "fail" and "not a directory" in ssd["detail"]
