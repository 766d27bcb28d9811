"""Daemon lifecycle: socket files and modes, a second start, stale sockets, restart with SSD
blocks, and SIGTERM during a stream of puts (a real subprocess)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.client import NO_RETRY, AsyncClient, Client
from kvstore.errors import AlreadyRunning, ConfigError, KVStoreError
from kvstore.keys import Namespace
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from .helpers import REPO_ROOT, DaemonProcess, DaemonThread, small_config


async def test_socket_is_private(daemon, config):
    path = config.server.socket_path
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


async def test_second_start_refuses(daemon, config):
    with pytest.raises(AlreadyRunning, match="already serves"):
        await serve(config)
    async with AsyncClient(daemon.unix_address) as client:  # the first one is unharmed
        assert (await client.health()).status == "SERVING"


async def test_stale_socket_is_replaced(config):
    path = config.server.socket_path
    os.makedirs(os.path.dirname(path), mode=0o700)
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    crashed.bind(path)  # bound, never listening, then gone: what a crash leaves behind
    crashed.close()
    d = await serve(config)
    try:
        async with AsyncClient(d.unix_address) as client:
            assert (await client.health()).status == "SERVING"
    finally:
        await d.stop(1.0)
    assert not os.path.exists(path)


async def test_live_foreign_listener_is_not_replaced(config):
    path = config.server.socket_path
    os.makedirs(os.path.dirname(path), mode=0o700)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(path)
    other.listen(1)
    try:
        with pytest.raises(AlreadyRunning, match="already answers"):
            await serve(config)
    finally:
        other.close()


async def test_regular_file_at_socket_path_is_refused(config):
    os.makedirs(os.path.dirname(config.server.socket_path), mode=0o700)
    Path(config.server.socket_path).write_text("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        await serve(config)


async def test_restart_keeps_ssd_blocks(config, ns, spec):
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    d = await serve(config)
    async with AsyncClient(d.unix_address) as client:
        assert await client.put(ns, tokens, kv, zero_copy=False) == 64
    await d.stop(1.0)  # closing the store persists DRAM-only blocks to SSD
    d = await serve(config)
    try:
        async with AsyncClient(d.unix_address) as client:
            result = await client.lookup(ns, tokens)
            assert result.matched_tokens == 64 and result.tokens_per_tier == {"ssd": 64}
            assert torch.equal(await client.get(ns, tokens, zero_copy=False), kv)
    finally:
        await d.stop(1.0)


def _put_until_refused(address: str, ns: Namespace, spec, acked: list, stop: threading.Event):
    with Client(address, retry=NO_RETRY, zero_copy=False, timeout_s=10) as client:
        for i in range(10_000):
            tokens, kv = random_tokens(32, seed=1000 + i), random_kv(spec, 32, seed=i)
            try:
                client.put(ns, tokens, kv)
            except KVStoreError:
                stop.set()
                return
            acked.append((tokens, kv))


def test_sigterm_during_puts_drains_and_keeps_acknowledged_puts(root, ns, spec):
    config = small_config(root, dram_bytes=32 << 20, log_level="INFO")
    proc = DaemonProcess(config, root)
    try:
        proc.wait_ready()
        second = subprocess.run(
            [sys.executable, "-m", "kvstore.server.daemon", "--config", str(root / "kvstore.toml")],
            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 1 and "already serves" in second.stderr
        acked: list = []
        refused = threading.Event()
        putter = threading.Thread(target=_put_until_refused,
                                  args=(proc.address, ns, spec, acked, refused))
        putter.start()
        while len(acked) < 20 and putter.is_alive():
            time.sleep(0.01)
        assert proc.terminate() == 0
        putter.join(30)
        assert refused.is_set() and len(acked) >= 20
    finally:
        proc.kill()
    assert {"serving", "draining", "stopped"} <= {e["msg"] for e in proc.events()}
    with DaemonThread(config) as daemon, Client(daemon.unix_address, zero_copy=False) as client:
        for tokens, kv in acked:
            assert torch.equal(client.get(ns, tokens), kv)


def test_daemon_thread_runs_a_coroutine_on_the_daemons_loop(tmp_path, spec):
    """What a benchmark or an embedding engine uses to reach the store beside a client."""
    config = small_config(tmp_path)
    ns = Namespace(model_id="m", spec=spec, tenant="default")
    tokens, kv = random_tokens(32), random_kv(spec, 32)
    thread = DaemonThread(config)
    with thread as daemon, Client(daemon.unix_address, zero_copy=False) as client:
        assert thread.call(daemon.store.put(ns, tokens, kv)) == 32
        assert client.lookup(ns, tokens).matched_tokens == 32
    coro = daemon.store.lookup(ns, tokens)
    with pytest.raises(KVStoreError, match="not running"):
        DaemonThread(config).call(coro)  # never started


def test_freezing_the_startup_heap_keeps_it_out_of_later_collections():
    """What start-up leaves alive is frozen (no later collection walks it); its garbage is
    collected first, not frozen with it. In a subprocess: freezing is for the whole process."""
    code = """
import gc, weakref
from kvstore.server.daemon import freeze_startup_heap
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b  # a cycle: only the collector frees it
kept = [Node()]
frozen = freeze_startup_heap()
assert gone() is None, "start-up garbage was frozen"
assert frozen == gc.get_freeze_count() > 10_000, frozen
assert not any(o is kept for o in gc.get_objects()), "a live start-up object is still tracked"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
