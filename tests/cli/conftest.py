"""Fixtures for the CLI tests: a real daemon on a Unix socket."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from kvstore.config import DramConfig, KVStoreConfig, ServerConfig, SsdConfig
from kvstore.server.daemon import Daemon, serve


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
