"""Real redis-server processes on loopback for the remote tier's tests: a standalone server and a
3-master cluster whose nodes a test can kill and restart.

``scripts/services/redis.sh`` (run by ``make test``) starts a shared standalone server and a
cluster and exports ``KVSTORE_TEST_REDIS_URL`` / ``KVSTORE_TEST_REDIS_CLUSTER``; without them,
tests start their own when a ``redis-server`` binary exists, and skip (saying why) when not.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NO_REDIS = ("no redis-server binary and KVSTORE_TEST_REDIS_URL unset: run `make test` (it "
            "installs and starts one) or `apt-get install redis-server`")
needs_redis_binary = pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None,
                                        reason=NO_REDIS)


def free_port() -> int:
    """A loopback port that is free, as is the cluster bus port 10000 above it."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


def _ping(port: int, password: str = "") -> bool:
    args = [REDIS_CLI, "-p", str(port), "--no-auth-warning"]
    if password:
        args += ["-a", password]
    out = subprocess.run([*args, "ping"], capture_output=True, text=True, timeout=5,
                         check=False)
    return out.stdout.strip() == "PONG"


class RedisServer:
    """One redis-server process on a loopback port (no persistence)."""

    def __init__(self, root: Path, port: int | None = None, password: str = "",
                 cluster: bool = False) -> None:
        self.port = port or free_port()
        self.password = password
        self.cluster = cluster
        self.dir = root / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f"default:{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no",
                "--logfile", str(self.dir / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _ping(self.port, self.password):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} did not start: "
                                   f"{(self.dir / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def cli(self, *args: str) -> str:
        base = [REDIS_CLI, "-p", str(self.port), "--no-auth-warning"]
        if self.password:
            base += ["-a", self.password]
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout


class RedisClusterProcs:
    """Three masters, no replicas, made one cluster with ``redis-cli --cluster create``."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.nodes = [RedisServer(root, cluster=True) for _ in range(size)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterProcs:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                        "--cluster-yes"], capture_output=True, text=True, timeout=60, check=True)
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(n.proc is not None and "cluster_state:ok" in n.cli("cluster", "info")
                   for n in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def restart(self, index: int) -> None:
        """Start a killed node again on its port; it rejoins from its nodes.conf (empty)."""
        self.nodes[index].start()
        self.wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


def standalone_url(tmp_root: Path) -> tuple[str, RedisServer | None]:
    """The shared server's URL (``KVSTORE_TEST_REDIS_URL``), or a fresh one's."""
    url = os.environ.get("KVSTORE_TEST_REDIS_URL")
    if url:
        return url, None
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_root).start()
    return server.url, server


def cluster_url(tmp_root: Path) -> tuple[str, RedisClusterProcs | None]:
    """The shared cluster's URL (``KVSTORE_TEST_REDIS_CLUSTER``), or a fresh cluster's."""
    url = os.environ.get("KVSTORE_TEST_REDIS_CLUSTER")
    if url:
        return url, None
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(NO_REDIS)
    cluster = RedisClusterProcs(tmp_root).start()
    return cluster.url, cluster


def temp_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvredis", dir="/tmp"))
