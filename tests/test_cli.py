"""The ``kvstore`` command through typer's CliRunner, against a real daemon on a Unix socket."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstore import __version__
from kvstore.bench.report import BenchReport, Column
from kvstore.cli import app, load_runner
from kvstore.client import Client
from kvstore.config import DramConfig, KVStoreConfig, ServerConfig, SsdConfig
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.server.daemon import Daemon, serve
from tests.conftest import random_kv, random_tokens

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str, input: str | None = None, env: dict[str, str] | None = None):
    return runner.invoke(app, list(args), input=input, env=env, catch_exceptions=False)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon serving from its own event loop thread, as a separate process would."""
    base = tmp_path_factory.mktemp("daemon")
    config = KVStoreConfig(
        dram=DramConfig(capacity_bytes=32 << 20, chunk_bytes=1 << 20),
        ssd=SsdConfig(path=str(base / "ssd"), capacity_bytes=64 << 20, segment_bytes=4 << 20),
        server=ServerConfig(socket_path=str(base / "kv.sock"), log_json=False),
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(serve(config), loop).result(60)
    try:
        yield running
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(0), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def put_blocks(daemon: Daemon, spec, tenant: str, num_blocks: int, seed: int = 0) -> None:
    ns = Namespace(model_id="cli/model", spec=spec, tenant=tenant)
    tokens = random_tokens(num_blocks * spec.block_tokens, seed=seed)
    with Client(daemon.unix_address) as client:
        written = client.put(ns, tokens, random_kv(spec, len(tokens), seed), zero_copy=False)
    assert written == len(tokens)


def listed(daemon: Daemon, *filters: str) -> list[dict]:
    result = invoke("ls", "--address", daemon.unix_address, "--json", *filters)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ------------------------------------------------------------------------ version, entry points


def test_version() -> None:
    result = invoke("version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"kvstore {__version__}"


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


def test_usage_error_exits_2() -> None:
    result = invoke("ls", "--limit", "-1")
    assert result.exit_code == 2


# ------------------------------------------------------------------------------------ serve


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


def test_unreachable_daemon_names_address_and_serve(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/absent.sock"
    result = invoke("stats", "--address", address)
    assert result.exit_code == 1
    assert address in result.stderr and "kvstore serve" in result.stderr


def test_stats_watch_refreshes_until_ctrl_c(daemon: Daemon, monkeypatch) -> None:
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("kvstore.cli.time.sleep", sleep)
    lines = invoke("stats", "--address", daemon.unix_address, "--watch", "0.5", "--json")
    assert lines.exit_code == 0
    assert [json.loads(line)["tiers"].keys() for line in lines.stdout.splitlines()] == [
        {"dram", "ssd"}] * 2
    naps.clear()
    live = invoke("stats", "--address", daemon.unix_address, "--watch", "0.5")
    assert live.exit_code == 0 and "dram" in live.stdout and naps == [0.5, 0.5]


def test_address_from_environment(daemon: Daemon) -> None:
    result = invoke("stats", "--json", env={"KVSTORE_ADDRESS": daemon.unix_address})
    assert result.exit_code == 0, result.output


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


# ------------------------------------------------------------------------------------ bench


def test_load_runner_names_a_missing_module() -> None:
    with pytest.raises(KVStoreError, match="kvstore.bench.no_such_bench.*not part of this build"):
        load_runner("kvstore.bench.no_such_bench", "run", "kvstore bench x")


def test_bench_codecs_runs_the_module_it_finds(monkeypatch, tmp_path: Path) -> None:
    """The command imports kvstore.bench.codecs on use and publishes what it returns."""
    seen: dict[str, object] = {}

    def run_codec_bench(**kwargs: object) -> BenchReport:
        seen.update(kwargs)
        return BenchReport(name="codecs", title="codecs", rows=({"codec": "raw"},),
                           columns=(Column("codec", "codec", justify="left"),))

    fake = types.ModuleType("kvstore.bench.codecs")
    fake.run_codec_bench = run_codec_bench  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvstore.bench.codecs", fake)
    out = tmp_path / "codecs.json"
    result = invoke("bench", "codecs", "--quick", "--no-real", "--codec", "fp8_e4m3",
                    "--codec", "raw+zstd", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert seen == {"quick": True, "real": False, "gpu": None, "minilm_dir": None,
                    "codec_names": ("fp8_e4m3", "raw+zstd")}
    written = json.loads(out.read_text())
    assert written["bench"] == "codecs" and written["rows"] == [{"codec": "raw"}]
    assert {"date", "host", "command", "environment", "params"} <= set(written)


def test_bench_rpc_passes_its_options(monkeypatch, tmp_path: Path) -> None:
    seen: dict[str, object] = {}

    def run_rpc_bench(**kwargs: object) -> BenchReport:
        seen.update(kwargs)
        return BenchReport(name="rpc", title="rpc", columns=(Column("value", "value"),),
                           rows=({"value": 1.5},))

    fake = types.ModuleType("kvstore.bench.rpc")
    fake.run_rpc_bench = run_rpc_bench  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvstore.bench.rpc", fake)
    out = tmp_path / "rpc.json"
    result = invoke("bench", "rpc", "--total-bytes", "64MiB", "--concurrency", "4",
                    "--json", str(out))
    assert result.exit_code == 0, result.output
    assert seen == {"total_bytes": 64 << 20, "lookup_repeats": 200, "small_call_s": 2.0,
                    "concurrency": 4}
    assert json.loads(out.read_text())["rows"] == [{"value": 1.5}]


def test_bench_without_its_module_is_a_clean_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "kvstore.bench.codecs", None)  # import raises
    result = invoke("bench", "codecs")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: `kvstore bench codecs`")
