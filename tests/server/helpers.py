"""Daemons for tests: in-process (``serve``), in a thread (for the blocking client) and as a
real subprocess (``python -m kvstore.server.daemon``), all on small configs."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.client import NO_RETRY, Client
from kvstore.config import DramConfig, KVStoreConfig, ServerConfig, SsdConfig
from kvstore.errors import KVStoreError
from kvstore.server.daemon import DaemonThread

__all__ = [
    "REPO_ROOT",
    "DaemonProcess",
    "DaemonThread",
    "MiB",
    "rpc_calls",
    "sample_total",
    "short_tmpdir",
    "small_config",
    "write_toml",
]

MiB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    """Whether ``predicate()`` came true within ``timeout_s`` (polled every ``interval_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def rpc_calls(daemon, method: str) -> int:
    """How many ``method`` calls ``daemon`` (a DaemonThread or served Daemon) answered, from
    its per-method RPC latency counts (gRPC and call channels alike)."""
    return int(sample_total(daemon.metrics.registry, "kvstore_rpc_latency_seconds_count",
                            method=method))


def sample_total(registry, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in ``registry`` whose labels include ``labels`` (a
    method's calls over every tenant and model label)."""
    return sum(sample.value for family in registry.collect() for sample in family.samples
               if sample.name == name
               and all(sample.labels.get(k) == v for k, v in labels.items()))


def short_tmpdir() -> Path:
    """A fresh directory with a short path: Unix socket paths are limited to 107 bytes."""
    return Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))


def small_config(root: Path, *, dram_bytes: int = 16 * MiB, ssd: dict[str, Any] | None = None,
                 **server: Any) -> KVStoreConfig:
    """DRAM and SSD small enough for tests; SSD admits on the first access."""
    ssd_fields = {"path": str(root / "ssd"), "capacity_bytes": 64 * MiB,
                  "segment_bytes": 1 * MiB, "admit_after_accesses": 1, "fsync": "never",
                  **(ssd or {})}
    server_fields = {"socket_path": str(root / "run" / "kv.sock"), "log_level": "WARNING",
                     "shutdown_grace_s": 2.0, **server}
    return KVStoreConfig(dram=DramConfig(capacity_bytes=dram_bytes, chunk_bytes=1 * MiB),
                         ssd=SsdConfig(**ssd_fields), server=ServerConfig(**server_fields))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f'{k} = {_toml_value(v)}' for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_toml(config: KVStoreConfig, path: Path) -> Path:
    lines = []
    for section in ("dram", "ssd", "server", "remote"):
        lines.append(f"[{section}]")
        for name, value in dataclasses.asdict(getattr(config, section)).items():
            lines.append(f"{name} = {_toml_value(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


class DaemonProcess:
    """The daemon as a real subprocess; its log lines go to ``log_path``."""

    def __init__(self, config: KVStoreConfig, root: Path, launcher: tuple[str, ...] = (),
                 nofile: tuple[int, int] | None = None) -> None:
        """``launcher``: a command the daemon's command line is handed to (it execs it);
        ``nofile``: a lowered descriptor limit (soft, hard)."""
        self.config = config
        self.address = f"unix://{config.server.socket_path}"
        self.log_path = root / f"daemon-{time.monotonic_ns()}.log"
        config_path = write_toml(config, root / "kvstore.toml")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        command = [sys.executable, "-m", "kvstore.server.daemon", "--config", str(config_path)]
        if nofile is not None:  # a lowered descriptor limit (soft, hard): floods reach it soon
            command[1:3] = ["-c", ("import resource, runpy, sys; "
                            f"resource.setrlimit(resource.RLIMIT_NOFILE, {tuple(nofile)}); "
                            "sys.argv[0] = 'kvstore.server.daemon'; "
                            "runpy.run_module('kvstore.server.daemon', run_name='__main__')")]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*launcher, *command], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log()}")
            try:
                with Client(self.address, retry=NO_RETRY, timeout_s=2.0) as client:
                    client.health()
                return
            except KVStoreError:
                time.sleep(0.1)
        raise TimeoutError(f"daemon not ready after {timeout_s}s: {self.log()}")

    def terminate(self, timeout_s: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far."""
        return [json.loads(line) for line in self.log().splitlines() if line.startswith("{")]

    def tcp_address(self) -> str:
        """The TCP address the daemon reported (``server.tcp_address`` with port 0)."""
        serving = next(e for e in self.events() if e["msg"] == "serving")
        return f"127.0.0.1:{serving['tcp_port']}"


def _kvstore_memfds() -> dict[tuple[int, int], int]:
    """This process's kvstore memfds, each once: (device, inode) -> allocated bytes."""
    gc.collect()  # memfds of earlier tests' clients that only a collection closes
    held = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvstore-"):
                stat = os.fstat(int(fd))
                held[stat.st_dev, stat.st_ino] = stat.st_blocks * 512
        except OSError:  # closed meanwhile
            continue
    return held


def memfd_inodes() -> frozenset:
    """The kvstore memfds open in this process now (take it before starting a daemon: the
    daemons of earlier tests in the process may still hold theirs)."""
    return frozenset(_kvstore_memfds())


def memfd_bytes(before: frozenset = frozenset()) -> int:
    """Memory of the kvstore memfds open in this process (an in-process daemon's, beside a
    client that holds descriptors of some of them: each counted once), those in ``before``
    left out."""
    return sum(size for inode, size in _kvstore_memfds().items() if inode not in before)
