"""Tools for attacking a real daemon: raw gRPC calls that bypass the client library, probes of
the daemon process (memory, open sockets) and a K/V geometry where a few tokens weigh a lot."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvstore.keys import Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.spec import KVSpec

from .helpers import DaemonProcess, small_config

MiB = 1 << 20
SERVICE = "/kvstore.v1.KVStore/"
SC = grpc.StatusCode

# 32 layers x 8 kv heads x 128 head dim in bf16: 128 KiB per token, so a 1 GiB tensor is
# declared by 8192 tokens (a 32 KiB tokens field).
HEAVY_SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)
HEAVY_NS = Namespace(model_id="hostile/heavy", spec=HEAVY_SPEC, tenant="acme")
HEAVY_TOKEN_BYTES = HEAVY_SPEC.block_bytes // HEAVY_SPEC.block_tokens


def method(name: str) -> str:
    return SERVICE + name


def status_line(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` field in bytes (VmRSS: resident now, VmHWM: peak resident)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rpc_errors(metrics_port: int) -> dict[tuple[str, str], float]:
    """The daemon's ``kvstore_rpc_errors_total`` by (method, code), scraped from its port."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    errors: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvstore_rpc_errors_total":  # summed over tenant and model labels
                key = (s.labels["method"], s.labels["code"])
                errors[key] = errors.get(key, 0.0) + s.value
    return errors


def num_sockets(pid: int) -> int:
    """How many sockets the process holds open."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


async def eventually(predicate: Callable[[], bool], timeout_s: float,
                     interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval_s)


@contextlib.contextmanager
def daemon_process(root: Path, **server: Any) -> Iterator[DaemonProcess]:
    """A ready daemon subprocess with ``small_config(root, **server)`` logging at INFO (its
    "serving" line names the TCP port); killed afterwards. ``nofile=(soft, hard)`` lowers its
    descriptor limit."""
    dram = server.pop("dram_bytes", 16 * MiB)
    nofile = server.pop("nofile", None)
    server.setdefault("log_level", "INFO")
    proc = DaemonProcess(small_config(root, dram_bytes=dram, **server), root, nofile=nofile)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


def heavy_header(num_tokens: int, ns: Namespace = HEAVY_NS, seed: int = 0) -> pb.PutRequest:
    """A valid PutHeader declaring ``num_tokens`` tokens of HEAVY_SPEC K/V."""
    tokens = [(seed * 7919 + i) % 50_000 for i in range(num_tokens)]
    tensor = pb.TensorHeader(dtype=ns.spec.dtype, shape=list(ns.spec.shape(num_tokens)),
                             total_bytes=num_tokens * HEAVY_TOKEN_BYTES)
    return pb.PutRequest(header=pb.PutHeader(namespace=namespace_to_proto(ns),
                                             tokens=tokens_to_bytes(tokens), tensor=tensor))


class Stream:
    """The request side of a client stream, fed by the test: ``send`` a message, ``close``
    to half-close; until then the stream just waits, as a stalled client's would."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def send(self, message: Any) -> None:
        self._queue.put_nowait(message)

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[Any]:
        while (message := await self._queue.get()) is not None:
            yield message


def put_call(channel: grpc.aio.Channel, stream: Stream, token: str | None = None,
             timeout_s: float = 60.0):
    """A raw Put fed by ``stream``; await it for the response (or the AioRpcError)."""
    rpc = channel.stream_unary(method("Put"), request_serializer=pb.PutRequest.SerializeToString,
                               response_deserializer=pb.PutResponse.FromString)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return rpc(aiter(stream), timeout=timeout_s, metadata=metadata)


async def outcome(call) -> tuple[SC, str]:
    """(status code, details) of an awaitable call."""
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return SC.OK, ""
