"""The sidecar daemon: sockets, the grpc.aio server over one Store, signals, logging.

``run_daemon(config)`` blocks until SIGTERM/SIGINT, drains in-flight calls, closes the store
(flushing SSD) and returns 0. ``await serve(config)`` starts the same daemon inside a running
event loop and returns a :class:`Daemon` handle (TCP port 0 picks a free port), for tests and
benchmarks. ``python -m kvstore.server.daemon [--config FILE] [--set section.field=value]``
runs it without the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Coroutine
from typing import IO, Any, TypeVar

import grpc

from kvstore.config import KVStoreConfig, ServerConfig, load_config, parse_assignments
from kvstore.dumpable import protect_process
from kvstore.errors import ConfigError, KVStoreError
from kvstore.rpc.descriptors import fd_socket_path
from kvstore.rpc.framing import data_socket_path, max_frame_bytes
from kvstore.server.auth import Authenticator, AuthInterceptor
from kvstore.server.channel import ChannelCalls
from kvstore.server.data_socket import DataSocketServer
from kvstore.server.descriptor_socket import DescriptorServer
from kvstore.server.fds import ConnectionBudget, raise_nofile_limit
from kvstore.server.gate import TcpGate
from kvstore.server.health import DaemonHealth
from kvstore.server.interceptors import ErrorInterceptor
from kvstore.server.kv_events import EventHub, EventsCollector
from kvstore.server.limits import RateLimiter
from kvstore.server.metrics import Metrics, MetricsInterceptor, loop_snapshot
from kvstore.server.registration import add_to_server
from kvstore.server.service import KVStoreService, max_put_bytes
from kvstore.server.sockets import claim_socket_path
from kvstore.server.tracing import CallTracer, TracingInterceptor
from kvstore.store import Store

_log = logging.getLogger("kvstore.server.daemon")
T = TypeVar("T")
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the record's extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname,
                 "logger": record.name, "msg": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(log_level: str, log_json: bool, stream: IO[str] | None = None) -> None:
    """Route the ``kvstore`` loggers to stderr (or ``stream``), as JSON lines if asked."""
    logger = logging.getLogger("kvstore")
    for handler in [h for h in logger.handlers if getattr(h, "_kvstore_daemon", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_json else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler._kvstore_daemon = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(log_level.upper())
    logger.propagate = False


def server_options(server: ServerConfig, max_connections: int | None = None
                   ) -> list[tuple[str, int]]:
    """The gRPC core options that bound what connections can make the daemon hold
    (``max_connections``: per listener, ``server.max_connections`` if None)."""
    return [
        ("grpc.max_receive_message_length", server.max_message_bytes),
        ("grpc.max_send_message_length", server.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # per listening socket: connections past it are closed as soon as they are accepted
        ("grpc.max_allowed_incoming_connections", max_connections or server.max_connections),
        ("grpc.max_concurrent_streams", server.max_streams_per_connection),
        # a connection that has not finished its HTTP/2 handshake by then is closed
        ("grpc.server_handshake_timeout_ms", max(1, int(server.stream_idle_timeout_s * 1000))),
    ]


class Daemon:
    """A running daemon: its store, gRPC server, bound addresses and metrics endpoint.

    ``auth`` is the daemon's one token table: its gRPC calls, its data socket and its
    descriptor socket all authenticate callers by it.
    """

    def __init__(self, config: KVStoreConfig, store: Store, lock: IO[str],
                 auth: Authenticator, tracer: CallTracer | None = None,
                 budget: ConnectionBudget | None = None) -> None:
        self.config = config
        # each listener's share of the descriptors (fds.py); serve() raised the limit first
        self.budget = budget or ConnectionBudget.split(_soft_nofile(), config.server)
        self.gate: TcpGate | None = None  # the TCP gRPC port's, once bound
        self._gate_task: asyncio.Task | None = None
        self.store = store
        self.metrics = Metrics(config.server.metric_label_values)
        self.tracer = tracer or CallTracer(config.tracing)  # spans only with tracing.enabled
        self.socket_path = config.server.socket_path
        self.tcp_port: int | None = None
        self.metrics_port: int | None = None
        self.draining = False
        self._lock = lock
        self._stopped = False
        server = config.server
        rate_per_s, burst = server.rate_limit  # on by default with several tenants
        limiter = RateLimiter(rate_per_s, burst) if rate_per_s else None
        self._auth_interceptor = AuthInterceptor(server, auth, limiter)
        self.server = grpc.aio.server(
            interceptors=[TracingInterceptor(self.tracer), MetricsInterceptor(self.metrics),
                          self._auth_interceptor, ErrorInterceptor()],
            options=server_options(server, self.budget.grpc_connections),
            maximum_concurrent_rpcs=server.max_concurrent_rpcs,
        )
        # Put/Get tensor bytes beside gRPC under one-time tickets (the socket data path). The
        # daemon has no TLS: were gRPC ever served over TLS, this plain socket must not be.
        self.datapath = DataSocketServer(server, auth, data_socket_path(self.socket_path),
                                         max_put_bytes(config), self.budget.data_connections
                                         ) if server.data_socket else None
        # KV events (server/kv_events.py): None when off; published once start() has run.
        self.events = None if store.events is None else EventHub(store.events, config.events)
        service = KVStoreService(store, config, lambda: self.draining, self.datapath,
                                 self.events)
        add_to_server(service, self.server)
        self.health = DaemonHealth(self.server)  # NOT_SERVING until start() has finished
        if self.datapath is not None and server.call_channel:
            # Small calls in frames on the data socket, behind the same checks (channel.py).
            self.datapath.offer_calls(
                ChannelCalls(service.channel_cores(), limiter, self.metrics.observe,
                             lambda: self.draining, self.tracer),
                max_frame_bytes(server.max_request_tokens, server.max_message_bytes))
        # Same-host clients get their tenant's arena descriptor here (gRPC cannot carry one).
        regions = store.host_regions
        self.fd_server = None if regions is None else DescriptorServer(
            fd_socket_path(self.socket_path), config.server, auth, regions,
            self.budget.descriptor_connections)

    @property
    def unix_address(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def tcp_address(self) -> str | None:
        if self.tcp_port is None:
            return None
        host = self.config.server.tcp_address.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
        return f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{self.tcp_port}"

    def _bind(self) -> None:
        # The socket file is created by the bind inside add_insecure_port: the umask makes it
        # 0600 from its first instant, the chmod applies a configured mode.
        old = os.umask(0o177)
        try:
            self.server.add_insecure_port(self.unix_address)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, self.config.server.socket_mode)
        address = self.config.server.tcp_address
        if address:
            try:
                self.tcp_port = self.server.add_insecure_port(address)
            except RuntimeError as exc:
                raise ConfigError(f"server.tcp_address {address!r}: cannot bind: {exc}") from None

    async def start(self) -> None:
        self._bind()
        await self.server.start()
        if self.tcp_port is not None:  # strangers' connections: a deadline and a share
            self.gate = TcpGate(self.tcp_port, self.config.server.unauthenticated_timeout_s,
                                self.budget.unauthenticated_share)
            self._auth_interceptor.on_authenticated = self.gate.vouch
            self._gate_task = asyncio.get_running_loop().create_task(self.gate.run())
        if self.fd_server is not None:
            await self.fd_server.start()
        server = self.config.server
        if self.datapath is not None:
            host = server.tcp_address.rsplit(":", 1)[0].strip("[]") if self.tcp_port else None
            await self.datapath.start(host, server.data_port, server.socket_mode)
        if server.metrics_port:
            self.metrics.watch_store(loop_snapshot(self.store.stats, asyncio.get_running_loop()))
            self.metrics_port = self.metrics.start_http(server.metrics_host, server.metrics_port,
                                                        self.budget.metrics_connections,
                                                        server.unauthenticated_timeout_s)
        if self.events is not None:
            self.events.start()
            self.metrics.registry.register(EventsCollector(self.events, self.store.events))
        await self.health.serving()
        _log.info("serving", extra={"socket": self.socket_path, "tcp_port": self.tcp_port,
                                    "data_port": self.datapath and self.datapath.tcp_port,
                                    "metrics_port": self.metrics_port, "pid": os.getpid()})

    async def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, give in-flight ones ``grace_s``, close the store. Idempotent."""
        if self._stopped:
            return
        self.draining = True
        await self.health.draining()
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        started = time.monotonic()
        if self._gate_task is not None:
            self._gate_task.cancel()
        try:
            await self.server.stop(grace)
            # After the drain (a draining put may still ask for its arena), before the store
            # closes the arenas.
            if self.fd_server is not None:
                await self.fd_server.close()
            if self.datapath is not None:  # after the drain: draining calls move bytes on it
                await self.datapath.close()
            await asyncio.to_thread(self.metrics.stop_http)  # waits out the HTTP poll loop
            await asyncio.to_thread(self.tracer.shutdown)  # sends the spans still queued
            # Blocks queued for write-through get what is left of the grace.
            await self.store.close(max(0.0, grace - (time.monotonic() - started)))
            if self.events is not None:  # after the store: its last events are sent too
                await self.events.aclose()
        finally:
            if self.fd_server is not None:  # idempotent: removes the socket on any failure
                await self.fd_server.close()
            if self.datapath is not None:
                await self.datapath.close()
            if self.events is not None:  # idempotent: a failed stop still closes the sockets
                await self.events.aclose()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            self._lock.close()
            self._stopped = True
        _log.info("stopped", extra={"drain_s": round(time.monotonic() - started, 3)})


async def serve(config: KVStoreConfig) -> Daemon:
    """Open the store and start serving; the caller owns ``await daemon.stop()``."""
    server = config.server
    # Before the first memfd exists: same-uid processes get no way into the tenants' pages.
    if not server.dumpable and not protect_process():
        _log.warning("could not make the daemon non-dumpable: processes of its uid can read "
                     "and write its memory through /proc and ptrace")
    auth = Authenticator(server)
    if server.tcp_address and auth.tokens.empty:
        raise ConfigError("server.tcp_address is set but no server.tenant_tokens or "
                          "server.admin_token: TCP is never served without tokens")
    tracer = CallTracer(config.tracing)  # before anything opens: a missing extra fails first
    lock = claim_socket_path(server.socket_path)
    # After the socket is ours: a daemon refused there says only why, and changes no limit.
    budget = ConnectionBudget.split(raise_nofile_limit(), server)
    try:
        store = Store(config)
        await store.open()
    except BaseException:
        lock.close()
        raise
    daemon = Daemon(config, store, lock, auth, tracer, budget)
    try:
        await daemon.start()
    except BaseException:
        await daemon.stop(0)
        raise
    return daemon


def _soft_nofile() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then move every object still alive (modules, torch,
    grpc, the config: about 180k of them) out of the collector's generations for good, so no
    later collection walks them. A full collection over them took 110-180 ms on the 2-core box
    (2026-12-01), a stall of every call in flight, due each time the blocks stored since the
    last one reach a quarter of the objects alive. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _run(config: KVStoreConfig) -> int:
    # Handlers first: a SIGTERM while the sockets come up (they exist before serve returns)
    # stops the daemon cleanly once it is up, instead of killing it half-started.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    daemon = await serve(config)
    freeze_startup_heap()
    try:
        await stop.wait()
        _log.info("draining", extra={"grace_s": config.server.shutdown_grace_s})
    finally:
        await daemon.stop()
    return 0


# glibc serves allocations above 128 KiB (adaptively up to 32 MiB) with fresh mmaps and returns
# them on free, so every 2 MiB page encoded by a put page-faults ~512 times. Keeping such
# buffers in the heap took DRAM puts of 2 MiB blocks from 1.1 to 2.0 GB/s (2-core box,
# 2026-11-29). Values: mallopt's M_TRIM_THRESHOLD (-1) and M_MMAP_THRESHOLD (-3).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD_BYTES = 32 << 20
MALLOC_TRIM_THRESHOLD_BYTES = 1 << 30


def tune_malloc() -> bool:
    """Keep page-sized buffers in glibc's heap (see above); False where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD_BYTES)
                    and libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def run_daemon(config: KVStoreConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain, flush and return 0 (the exit code).

    Raises:
        AlreadyRunning: another daemon serves ``config.server.socket_path``.
        ConfigError: the sockets cannot be set up as configured.
    """
    configure_logging(config.server.log_level, config.server.log_json)
    if not tune_malloc():
        _log.info("malloc tuning unavailable (not glibc); large puts will page-fault more")
    return asyncio.run(_run(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.server.daemon")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)
    try:
        return run_daemon(load_config(args.config, overrides=parse_assignments(args.set)))
    except KVStoreError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1


class DaemonThread:
    """``serve(config)`` on an event loop of its own in a thread, for a process that also runs
    a blocking client (an engine with the daemon inside it, benchmarks, tests)::

        with DaemonThread(config) as daemon:
            with Client(daemon.unix_address) as client: ...
    """

    def __init__(self, config: KVStoreConfig, stop_grace_s: float = 1.0) -> None:
        self.config = config
        self.daemon: Daemon | None = None
        self._grace_s = stop_grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True,
                                        name="kvstore-daemon")

    async def _main(self) -> None:
        try:
            self.daemon = await serve(self.config)
        except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
            self._error = exc
            self._ready.set()
            return
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await self.daemon.stop(self._grace_s)

    def __enter__(self) -> Daemon:
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise self._error
        if self.daemon is None:
            raise KVStoreError("the daemon did not start within 60 s")
        return self.daemon

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the daemon's event loop (its store's) and wait for its result; from
        another thread, while the daemon runs."""
        if self._loop is None:
            coro.close()
            raise KVStoreError("the daemon is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


if __name__ == "__main__":
    sys.exit(main())
