"""Child processes of the benchmarks: started with this checkout on PYTHONPATH, waited for
until they answer, stopped on the way out; a free loopback port; the environment LMCache's
processes run in and the arguments of a throwaway kvstore daemon.

Only the standard library at import (grpc on use): the LMCache bench's worker, which runs in
LMCache's own venv, imports this module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvstore.errors import KVStoreError

START_S = 60.0  # how long a server child may take to answer


@contextlib.contextmanager
def child(args: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """``python args...`` with this checkout first on PYTHONPATH, its output in ``log_path``;
    SIGTERM (then SIGKILL after 30 s) on the way out."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                                     os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()



def wait_until(ready: Callable[[], None], proc: subprocess.Popen, log_path: Path) -> None:
    """Call ``ready`` until it stops raising (KVStoreError or a gRPC error), ``START_S`` at
    most; KVStoreError with the log's tail if ``proc`` exits first."""
    import grpc

    deadline = time.monotonic() + START_S
    while True:
        if proc.poll() is not None:
            raise KVStoreError(f"bench server exited: {log_path.read_text()[-2000:]}")
        try:
            ready()
            return
        except (KVStoreError, grpc.RpcError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lmcache_env(log_level: str) -> dict[str, str]:
    """The environment LMCache's processes run in: no usage reports, no banner, its log at
    ``log_level``."""
    return {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
            "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_LOG_LEVEL": log_level}


def daemon_args(socket_path: Path, dram_bytes: int) -> list[str]:
    """``python`` arguments of a kvstore daemon on ``socket_path`` with a DRAM tier of
    ``dram_bytes`` and no SSD, logging warnings only, no metrics port."""
    return ["-m", "kvstore.server.daemon", "--set", f"server.socket_path={socket_path}",
            "--set", f"dram.capacity_bytes={dram_bytes}", "--set", "ssd.enabled=false",
            "--set", "server.log_level=WARNING", "--set", "server.metrics_port=0"]


__all__ = ["START_S", "child", "daemon_args", "free_port", "lmcache_env", "wait_until"]
