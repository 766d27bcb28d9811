"""RPC benchmark: the daemon's Lookup latency, put/get GB/s through the socket and through shared
memory, and small-call throughput, each against a bare grpc.aio echo of the same payload; and
the socket path (data socket, and the streamed gRPC fallback) against redis-py SET/GET of the
same 2 MiB values pipelined a prompt deep, on a redis-server started here, over Unix sockets
and TCP loopback, with CPU seconds per GB of both sides.

The daemon, the echo server and redis-server run as subprocesses in a temp directory; the
client side runs here. ``kvstore bench rpc`` prints the tables and writes the JSON.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import hashlib
import mmap
import os
import resource
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import torch

from kvstore.bench.report import BenchReport, Column, write_report
from kvstore.client import NO_RETRY, AsyncClient, Client
from kvstore.copies import copy_all, default_copy_threads
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.tensors import chunk_limit
from kvstore.spec import KVSpec

MiB = 1 << 20
T = TypeVar("T")
# 32 layers x 8 kv heads x 128 head dim x 16 tokens x K,V x bf16 = 2 MiB per block (a 7-8B model)
BLOCK_SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)
# Lookup cost depends on the number of blocks, not their size: tiny blocks keep setup cheap.
LOOKUP_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=16)
PROMPT_BLOCKS = 16  # blocks per put/get call (32 MiB)
LOOKUP_PREFIXES = (8192, 32768)
MAX_MESSAGE_BYTES = 256 * MiB
_ECHO = "/kvstore.bench.Echo/"
_SERVER_START_S = 60.0
_BENCH_TOKEN = "kvstore-bench-admin"  # the daemon's TCP port is never served without a token
_ECHO_SECTION = "against a bare gRPC echo"
_REDIS_SECTION = "socket path against redis-py SET/GET, pipelined 16 deep"
_COPY_SECTION = "shared memory against one copy (np.copyto) into or out of a memfd"
_CHANNEL_SECTION = "call channel against gRPC, alternated call by call"
CHANNEL_ROUNDS = 5  # rounds of the paired channel/gRPC rows; ratios are medians over rounds


# ------------------------------------------------------------------------------ echo server


async def _echo_unary(request: bytes, context) -> bytes:
    """Replies with as many bytes as the first 8 request bytes ask for."""
    return bytes(int.from_bytes(request[:8], "little"))


async def _echo_upload(request_iterator, context) -> bytes:
    total = 0
    async for chunk in request_iterator:
        total += len(chunk)
    return total.to_bytes(8, "little")


async def _echo_download(request: bytes, context):
    total, chunk_bytes = struct.unpack_from("<QQ", request)
    block = bytes(chunk_bytes)
    for start in range(0, total, chunk_bytes):
        yield block if start + chunk_bytes <= total else block[: total - start]


async def serve_echo(address: str) -> None:
    """A bare grpc.aio server with identity (bytes) serialisers, until SIGTERM."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvstore.bench.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(_echo_unary),
        "Upload": grpc.stream_unary_rpc_method_handler(_echo_upload),
        "Download": grpc.unary_stream_rpc_method_handler(_echo_download),
    }),))
    server.add_insecure_port(address)
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1.0)


# ------------------------------------------------------------------------------ processes


@contextlib.contextmanager
def _process(args: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
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


def _wait_until(ready: Callable[[], None], proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + _SERVER_START_S
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


# ----------------------------------------------------------------------------- measurements


class Echo:
    """Blocking calls to the echo server, shaped like the kvstore calls they stand beside."""

    def __init__(self, address: str) -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.insecure_channel(address, options=options)
        self.unary = self.channel.unary_unary(_ECHO + "Unary")
        self.upload = self.channel.stream_unary(_ECHO + "Upload")
        self.download = self.channel.unary_stream(_ECHO + "Download")

    def call(self, request_bytes: int, response_bytes: int) -> Callable[[], object]:
        request = response_bytes.to_bytes(8, "little") + bytes(max(0, request_bytes - 8))
        return lambda: self.unary(request)

    def put(self, view: memoryview, chunk_bytes: int) -> None:
        self.upload(bytes(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes))

    def get(self, total_bytes: int, chunk_bytes: int) -> bytearray:
        out, pos = bytearray(total_bytes), 0
        for chunk in self.download(struct.pack("<QQ", total_bytes, chunk_bytes)):
            out[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        return out


def _latencies_ms(call: Callable[[], object], repeats: int) -> np.ndarray:
    for _ in range(min(10, repeats)):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return np.array(times) * 1e3


def _each(prompts: Iterable[T], get: Callable[[T], object]) -> None:
    """``get(prompt)`` for each prompt, each result dropped before the next get: a caller
    holds one prompt's K/V at a time, as Redis's side holds one pipeline's values. (Keeping a
    pass's results, 1 GiB, made every get write memory the process never had: on the 2-core
    box, a VM, that first touch cost 80 ms per 32 MiB against 5 ms, 2026-12-01.)"""
    for prompt in prompts:
        get(prompt)


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _row(measurement: str, value: float, unit: str, baseline: float, **extra) -> dict:
    return {"section": _ECHO_SECTION, "measurement": measurement, "value": value, "unit": unit,
            "echo": baseline, "vs_echo": value / baseline if baseline else None, **extra}


def python_lookup_floor(fingerprint: bytes, tokens: list[int], index: dict[bytes, None],
                        block_tokens: int, record: bool = False) -> int:
    """A lookup in plain Python, the floor Lookup is measured against: the tokens as uint32
    bytes, a loop of chained blake2b-128 over their blocks, a dict probe per key (stopping at
    the first miss). Returns the blocks matched; ``record`` adds every key to ``index``."""
    data = array.array("I", tokens).tobytes()
    step = 4 * block_tokens
    parent, matched = fingerprint, 0
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.blake2b(parent + data[start:start + step], digest_size=16).digest()
        if record:
            index[parent] = None
        elif parent not in index:
            break
        matched += 1
    return matched


def _lookup_rows(client: Client, echo: Echo, repeats: int) -> list[dict]:
    rows = []
    for num_tokens in LOOKUP_PREFIXES:
        ns = Namespace(model_id="bench/lookup", spec=LOOKUP_SPEC, tenant="bench")
        tokens = np.random.default_rng(num_tokens).integers(0, 50_000, num_tokens).tolist()
        kv = torch.zeros(LOOKUP_SPEC.shape(num_tokens), dtype=torch.bfloat16)
        client.put(ns, tokens, kv, zero_copy=False)
        result = client.lookup(ns, tokens)
        if result.matched_tokens != num_tokens:
            raise KVStoreError(f"lookup bench: {result.matched_tokens} of {num_tokens} matched")
        # the echo carries what the client and the daemon send: the keys packed
        request = pb.LookupRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                                   packed=True).ByteSize()
        response = pb.LookupResponse(packed_keys=b"".join(result.keys), matched_tokens=num_tokens,
                                     num_tokens=num_tokens,
                                     tokens_per_tier=result.tokens_per_tier).ByteSize()
        index: dict[bytes, None] = {}
        python_lookup_floor(ns.fingerprint, tokens, index, LOOKUP_SPEC.block_tokens, record=True)
        ours = _latencies_ms(lambda ns=ns, tokens=tokens: client.lookup(ns, tokens), repeats)
        bare = _latencies_ms(echo.call(request, response), repeats)
        floor = _latencies_ms(lambda ns=ns, tokens=tokens, index=index: python_lookup_floor(
            ns.fingerprint, tokens, index, LOOKUP_SPEC.block_tokens), repeats)
        for q in (50, 99):
            value, below = float(np.percentile(ours, q)), float(np.percentile(floor, q))
            rows.append(_row(f"Lookup {num_tokens // 1024}k-token prefix p{q}", value, "ms",
                             float(np.percentile(bare, q)), payload_bytes=request + response,
                             floor=below, vs_floor=value / below))
    return rows


def _transfer_rows(client: Client, echo: Echo, total_bytes: int) -> list[dict]:
    ns = Namespace(model_id="bench/blocks", spec=BLOCK_SPEC, tenant="bench")
    prompt_tokens = PROMPT_BLOCKS * BLOCK_SPEC.block_tokens
    num_calls = max(1, total_bytes // (PROMPT_BLOCKS * BLOCK_SPEC.block_bytes))
    kv = torch.randn(BLOCK_SPEC.shape(prompt_tokens)).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    moved = num_calls * nbytes / 1e9
    chunk = chunk_limit(MAX_MESSAGE_BYTES)
    view = memoryview(kv.view(-1).view(torch.uint8).numpy())

    def prompts(base: int) -> list[list[int]]:
        return [list(range(base + i * prompt_tokens, base + (i + 1) * prompt_tokens))
                for i in range(num_calls)]

    def put_all(batch: list[list[int]], zero_copy: bool) -> float:
        return _seconds(lambda: [client.put(ns, t, kv, zero_copy=zero_copy) for t in batch])

    put_all(prompts(10_000_000), False)  # warm-up: grows and pre-faults the DRAM arena
    # ... and, as the copy baseline faults its memfd in untimed, the staging slots and this
    # client's mappings of them and of published memory.
    warm = torch.ones_like(kv)
    warm_up = prompts(15_000_000)
    put_all(warm_up, True)
    for t in warm_up:
        client.get(ns, t, zero_copy=True, out=warm)
    client.flush_releases()
    client.evict(model_id=ns.model_id)
    put_socket = put_all(prompts(20_000_000), False)
    client.evict(model_id=ns.model_id)
    shared = prompts(30_000_000)
    put_shm = put_all(shared, True)
    get_socket = _seconds(lambda: _each(shared, lambda t: client.get(ns, t, zero_copy=False)))
    get_shm = _seconds(lambda: _each(shared, lambda t: client.get(ns, t, zero_copy=True)))
    # Into a warm buffer of the caller's, as the copy baseline copies into one.
    get_shm_out = _seconds(lambda: _each(shared, lambda t: client.get(ns, t, zero_copy=True,
                                                                    out=warm)))
    echo_put = _seconds(lambda: [echo.put(view, chunk) for _ in range(num_calls)])
    echo_get = _seconds(lambda: _each(range(num_calls), lambda _: echo.get(nbytes, chunk)))
    copy_in, copy_out, copy_out_shared = _memfd_copies(view, num_calls)
    threads = default_copy_threads()
    client.flush_releases()
    client.evict(model_id=ns.model_id)
    extra = {"payload_bytes": nbytes}
    return [
        _row("put 2 MiB blocks, socket", moved / put_socket, "GB/s", moved / echo_put, **extra),
        _row("put 2 MiB blocks, shared memory", moved / put_shm, "GB/s", moved / echo_put,
             **extra),
        _row("get 2 MiB blocks, socket", moved / get_socket, "GB/s", moved / echo_get, **extra),
        _row("get 2 MiB blocks, shared memory", moved / get_shm, "GB/s", moved / echo_get,
             **extra),
        _copy_row("put 2 MiB blocks x16, shared memory, vs one copy into a memfd",
                  moved / put_shm, moved / copy_in, 0.7, **extra),
        _copy_row("get 2 MiB blocks x16, shared memory, vs one copy out of a memfd (into a "
                  "warm out=)", moved / get_shm_out, moved / copy_out, 0.8, **extra),
        _copy_row("get 2 MiB blocks x16, shared memory, vs one copy out of a memfd (a fresh "
                  "result)", moved / get_shm, moved / copy_out, 0.8, **extra),
        # The ceiling on this host: the same copy spread over the client's copy threads.
        _copy_row(f"get 2 MiB blocks x16, shared memory, vs that copy on {threads} threads "
                  "(into a warm out=)", moved / get_shm_out, moved / copy_out_shared, None,
                  copy_threads=threads, **extra),
    ]


def _memfd_copies(view: memoryview, num_calls: int) -> tuple[float, float, float]:
    """Seconds of ``num_calls`` single-threaded copies (``np.copyto``) of ``view`` into a
    prefaulted memfd mapping, as many out of it into a warm buffer (the floor of a
    shared-memory put and get of the same bytes), and as many out of it shared between the
    client's default copy threads (``copy_all``: this host's ceiling for a get)."""
    src = np.frombuffer(view, dtype=np.uint8)
    fd = os.memfd_create("kvstore-bench-copy", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, src.nbytes)
        mapped = mmap.mmap(fd, src.nbytes)
        shared = np.frombuffer(mapped, dtype=np.uint8)
        out = np.ones_like(src)  # warm: a get's result buffer is not a fresh one here
        np.copyto(shared, src)  # untimed: faults the pages in
        copy_in = _seconds(lambda: [np.copyto(shared, src) for _ in range(num_calls)])
        copy_out = _seconds(lambda: [np.copyto(out, shared) for _ in range(num_calls)])
        threads = default_copy_threads()
        copy_out_shared = _seconds(lambda: [copy_all([(out, shared)], threads)
                                            for _ in range(num_calls)])
        shared = None  # the mapping closes once no array views it
        mapped.close()
    finally:
        os.close(fd)
    return copy_in, copy_out, copy_out_shared


def _copy_row(measurement: str, value: float, copy_gbps: float, aim: float | None,
              **extra) -> dict:
    return {"section": _COPY_SECTION, "measurement": measurement, "value": value,
            "unit": "GB/s", "copy": copy_gbps, "vs_copy": value / copy_gbps, "aim": aim, **extra}


async def _calls_per_second(call: Callable[[], object], seconds: float, concurrency: int
                            ) -> float:
    done = 0
    stop_at = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await call()
            done += 1

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.monotonic() - start)


async def _small_call_rows(address: str, echo_address: str, seconds: float,
                           concurrency: int) -> list[dict]:
    ns = Namespace(model_id="bench/small", spec=LOOKUP_SPEC, tenant="bench")
    tokens = list(range(LOOKUP_SPEC.block_tokens))
    request = pb.LookupRequest(namespace=namespace_to_proto(ns),
                               tokens=tokens_to_bytes(tokens)).ByteSize()
    response = pb.LookupResponse(num_tokens=len(tokens)).ByteSize()
    async with AsyncClient(address, retry=NO_RETRY) as client, \
            grpc.aio.insecure_channel(echo_address) as channel:
        unary = channel.unary_unary(_ECHO + "Unary")
        payload = response.to_bytes(8, "little") + bytes(max(0, request - 8))
        ours = await _calls_per_second(lambda: client.lookup(ns, tokens), seconds, concurrency)
        bare = await _calls_per_second(lambda: unary(payload), seconds, concurrency)
    return [_row(f"small calls (Lookup, 1 block, {concurrency} in flight)", ours, "calls/s",
                 bare, payload_bytes=request + response)]


# -------------------------------------------------------------------- call channel vs gRPC


def _channel_row(measurement: str, channel: float, grpc_value: float, unit: str,
                 round_ratios: list[float], **extra) -> dict:
    return {"section": _CHANNEL_SECTION, "measurement": measurement, "value": channel,
            "unit": unit, "grpc": grpc_value, "vs_grpc": statistics.median(round_ratios),
            **extra}


def _alternated(calls: dict[str, Callable[[int], object]], per_round: int, rounds: int
                ) -> dict[str, list[np.ndarray]]:
    """Seconds of each call, alternated call by call in a rotating order, per round."""
    names = list(calls)
    times: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for round_index in range(rounds):
        taken: dict[str, list[float]] = {name: [] for name in names}
        for i in range(per_round):
            shift = (i + round_index) % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                calls[name](i)
                taken[name].append(time.perf_counter() - start)
        for name in names:
            times[name].append(np.array(taken[name]))
    return times


def _channel_lookup_rows(channel: Client, plain: Client, repeats: int, rounds: int
                         ) -> list[dict]:
    rows = []
    per_round = max(1, repeats // rounds)
    for num_tokens in LOOKUP_PREFIXES:
        ns = Namespace(model_id="bench/lookup", spec=LOOKUP_SPEC, tenant="bench")
        tokens = np.random.default_rng(num_tokens).integers(0, 50_000, num_tokens).tolist()
        index: dict[bytes, None] = {}
        python_lookup_floor(ns.fingerprint, tokens, index, LOOKUP_SPEC.block_tokens, record=True)
        for client in (channel, plain):  # warm: the channel opened, the reply path run
            client.lookup(ns, tokens)
        times = _alternated({
            "channel": lambda _i, ns=ns, tokens=tokens: channel.lookup(ns, tokens),
            "grpc": lambda _i, ns=ns, tokens=tokens: plain.lookup(ns, tokens),
            "floor": lambda _i, ns=ns, tokens=tokens, index=index: python_lookup_floor(
                ns.fingerprint, tokens, index, LOOKUP_SPEC.block_tokens)}, per_round, rounds)
        for q in (50, 99):
            every = {name: np.concatenate(series) * 1e3 for name, series in times.items()}
            value = {name: float(np.percentile(ms, q)) for name, ms in every.items()}
            ratios = [float(np.percentile(c, q) / np.percentile(g, q))
                      for c, g in zip(times["channel"], times["grpc"], strict=True)]
            floor_ratios = [float(np.percentile(c, q) / np.percentile(f, q))
                            for c, f in zip(times["channel"], times["floor"], strict=True)]
            rows.append(_channel_row(
                f"Lookup {num_tokens // 1024}k-token prefix p{q}, channel vs gRPC",
                value["channel"], value["grpc"], "ms", ratios, floor=value["floor"],
                vs_floor=statistics.median(floor_ratios),
                grpc_vs_floor=statistics.median(
                    float(np.percentile(g, q) / np.percentile(f, q))
                    for g, f in zip(times["grpc"], times["floor"], strict=True))))
    return rows


def _channel_block_rows(channel: Client, plain: Client, rounds: int) -> list[dict]:
    """One 2 MiB block put and got through shared memory (Reserve/Commit, Acquire/Release:
    two small calls per block) on each path, alternated call by call."""
    ns = Namespace(model_id="bench/one-block", spec=BLOCK_SPEC, tenant="bench")
    bt = BLOCK_SPEC.block_tokens
    kv = torch.randn(BLOCK_SPEC.shape(bt)).to(torch.bfloat16)
    outs = {"channel": torch.ones_like(kv), "grpc": torch.ones_like(kv)}
    clients = {"channel": channel, "grpc": plain}
    per_round = 16
    put_times: dict[str, list[np.ndarray]] = {"channel": [], "grpc": []}
    get_times: dict[str, list[np.ndarray]] = {"channel": [], "grpc": []}
    for round_index in range(rounds + 1):  # the first round warms the arena up, untimed
        base = 40_000_000 + round_index * 1_000_000

        def tokens(path: str, i: int, base: int = base) -> list[int]:
            start = base + (i * 2 + (path == "grpc")) * bt
            return list(range(start, start + bt))

        puts = _alternated({path: lambda i, path=path: clients[path].put(
            ns, tokens(path, i), kv, zero_copy=True) for path in clients}, per_round, 1)
        gets = _alternated({path: lambda i, path=path: clients[path].get(
            ns, tokens(path, i), zero_copy=True, out=outs[path]) for path in clients},
            per_round, 1)
        for client in clients.values():
            client.flush_releases()
        channel.evict(model_id=ns.model_id)
        if round_index:
            for path in clients:
                put_times[path] += puts[path]
                get_times[path] += gets[path]
    gb = BLOCK_SPEC.block_bytes / 1e9
    rows = []
    for op, times in (("put", put_times), ("get", get_times)):
        rate = {path: gb / float(np.median(np.concatenate(series)))
                for path, series in times.items()}
        ratios = [float(np.median(g) / np.median(c))
                  for c, g in zip(times["channel"], times["grpc"], strict=True)]
        rows.append(_channel_row(f"{op} one 2 MiB block, shared memory, channel vs gRPC",
                                 rate["channel"], rate["grpc"], "GB/s", ratios,
                                 payload_bytes=BLOCK_SPEC.block_bytes))
    return rows


async def _channel_small_call_rows(address: str, seconds: float, concurrency: int,
                                   rounds: int) -> list[dict]:
    ns = Namespace(model_id="bench/small", spec=LOOKUP_SPEC, tenant="bench")
    tokens = list(range(LOOKUP_SPEC.block_tokens))
    rates: dict[str, list[float]] = {"channel": [], "grpc": []}
    async with AsyncClient(address, retry=NO_RETRY) as channel, \
            AsyncClient(address, retry=NO_RETRY, call_channel=False) as plain:
        clients = {"channel": channel, "grpc": plain}
        for client in clients.values():
            await client.lookup(ns, tokens)
        for round_index in range(rounds):
            order = list(clients)[::1 if round_index % 2 == 0 else -1]
            for path in order:
                client = clients[path]
                rates[path].append(await _calls_per_second(
                    lambda client=client: client.lookup(ns, tokens), seconds / rounds,
                    concurrency))
    ratios = [c / g for c, g in zip(rates["channel"], rates["grpc"], strict=True)]
    return [_channel_row(f"small calls (Lookup, 1 block, {concurrency} in flight), channel vs "
                         "gRPC", statistics.median(rates["channel"]),
                         statistics.median(rates["grpc"]), "calls/s", ratios)]


def _channel_rows(address: str, repeats: int, small_call_s: float, concurrency: int,
                  rounds: int = CHANNEL_ROUNDS) -> list[dict]:
    """The small calls on a call channel against the same calls over gRPC, from two clients
    of this process alternating call by call (``vs_grpc``: median over rounds of the round's
    channel / gRPC for latency, gRPC / channel time, i.e. the speed-up, for GB/s and
    calls/s)."""
    with Client(address, retry=NO_RETRY, max_message_bytes=MAX_MESSAGE_BYTES) as channel, \
            Client(address, retry=NO_RETRY, max_message_bytes=MAX_MESSAGE_BYTES,
                   call_channel=False) as plain:
        rows = _channel_lookup_rows(channel, plain, repeats, rounds)
        rows += _channel_block_rows(channel, plain, rounds)
    rows += asyncio.run(_channel_small_call_rows(address, small_call_s, concurrency, rounds))
    return rows


# ------------------------------------------------------------------------- against Redis


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by this process and ``pids``."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def _measured(call: Callable[[], object], pids: list[int]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of both sides) of ``call``."""
    cpu = _cpu_s(pids)
    wall = _seconds(call)
    return wall, _cpu_s(pids) - cpu


@contextlib.contextmanager
def _redis_server(root: Path) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    """redis-server on a free loopback port and a Unix socket, no persistence."""
    import redis

    port, unix = _free_port(), root / "redis.sock"
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--unixsocket", str(unix), "--unixsocketperm", "700",
            "--dir", str(root), "--logfile", str(root / "redis.log"), "--protected-mode", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + _SERVER_START_S
        while True:
            try:
                redis.Redis(unix_socket_path=str(unix)).ping()
                break
            except (redis.ConnectionError, FileNotFoundError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise KVStoreError("redis-server did not start") from None
                time.sleep(0.05)
        yield proc, port, unix
    finally:
        proc.terminate()
        proc.wait(30)


class _RedisSide:
    """redis-py SET/GET of a prompt's blocks as separate 2 MiB values, one pipeline a prompt."""

    def __init__(self, conn, blocks: list[bytes]) -> None:
        self.conn, self.blocks = conn, blocks

    def put(self, base: int) -> None:
        pipe = self.conn.pipeline(transaction=False)
        for i, value in enumerate(self.blocks):
            pipe.set(f"b{base}:{i}", value)
        pipe.execute()

    def get(self, base: int) -> None:
        pipe = self.conn.pipeline(transaction=False)
        for i in range(len(self.blocks)):
            pipe.get(f"b{base}:{i}")
        if any(v is None for v in pipe.execute()):
            raise KVStoreError("redis bench: a value was missing")


def _redis_round(clients: dict[str, Client], redis_side: _RedisSide, ns: Namespace,
                 kv: torch.Tensor, num_calls: int, pids: list[int], base: int
                 ) -> dict[str, tuple[float, float]]:
    """One paired round: every path puts then gets the same bytes; (wall s, CPU s) by path."""
    prompt_tokens = PROMPT_BLOCKS * BLOCK_SPEC.block_tokens
    out = {}
    for offset, (name, client) in enumerate(clients.items()):
        prompts = [list(range(base + (offset * num_calls + i) * prompt_tokens,
                              base + (offset * num_calls + i + 1) * prompt_tokens))
                   for i in range(num_calls)]
        out[f"put {name}"] = _measured(lambda c=client, p=prompts: [c.put(ns, t, kv)
                                                                   for t in p], pids)
        out[f"get {name}"] = _measured(lambda c=client, p=prompts: _each(
            p, lambda t, c=c: c.get(ns, t)), pids)
        client.evict(model_id=ns.model_id)
    out["put redis"] = _measured(lambda: [redis_side.put(i) for i in range(num_calls)], pids)
    out["get redis"] = _measured(lambda: [redis_side.get(i) for i in range(num_calls)], pids)
    redis_side.conn.flushall()
    return out


def _redis_rows(unix_address: str, tcp_address: str, daemon_pid: int, root: Path,
                total_bytes: int, repeats: int) -> list[dict]:
    """Socket-path put/get against redis-py SET/GET of the same 2 MiB values, per transport."""
    import redis

    ns = Namespace(model_id="bench/redis", spec=BLOCK_SPEC, tenant="bench")
    kv = torch.randn(BLOCK_SPEC.shape(PROMPT_BLOCKS * BLOCK_SPEC.block_tokens)
                     ).to(torch.bfloat16)
    raw = kv.view(-1).view(torch.uint8).numpy()
    block = BLOCK_SPEC.block_bytes
    blocks = [raw[i * block : (i + 1) * block].tobytes() for i in range(PROMPT_BLOCKS)]
    num_calls = max(1, total_bytes // (PROMPT_BLOCKS * block))
    gb = num_calls * PROMPT_BLOCKS * block / 1e9
    rows = []
    with _redis_server(root) as (redis_proc, redis_port, redis_unix):
        pids = [daemon_pid, redis_proc.pid]
        for transport, address, redis_conn in (
                ("unix", unix_address, redis.Redis(unix_socket_path=str(redis_unix))),
                ("tcp", tcp_address, redis.Redis(host="127.0.0.1", port=redis_port))):
            token = None if transport == "unix" else _BENCH_TOKEN
            with Client(address, token=token, retry=NO_RETRY, zero_copy=False,
                        max_message_bytes=MAX_MESSAGE_BYTES) as data_socket, \
                    Client(address, token=token, retry=NO_RETRY, zero_copy=False,
                           data_socket=False, max_message_bytes=MAX_MESSAGE_BYTES) as streamed:
                clients = {"data socket": data_socket, "streamed": streamed}
                redis_side = _RedisSide(redis_conn, blocks)
                _redis_round(clients, redis_side, ns, kv, 1, pids, 50_000_000)  # warm-up
                rounds = [_redis_round(clients, redis_side, ns, kv, num_calls, pids,
                                       60_000_000 + r * 10_000_000) for r in range(repeats)]
            redis_conn.close()
            rows += _paired_rows(rounds, transport, gb)
    return rows


def _paired_rows(rounds: list[dict[str, tuple[float, float]]], transport: str, gb: float
                 ) -> list[dict]:
    rows = []
    for op in ("put", "get"):
        redis_gbs = statistics.median(gb / r[f"{op} redis"][0] for r in rounds)
        redis_cpu = statistics.median(r[f"{op} redis"][1] / gb for r in rounds)
        for path in ("data socket", "streamed"):
            key = f"{op} {path}"
            rows.append({
                "section": _REDIS_SECTION,
                "measurement": f"{op} 2 MiB blocks x16, {path}, {transport}",
                "value": statistics.median(gb / r[key][0] for r in rounds), "unit": "GB/s",
                "redis": redis_gbs,
                # the ratio of each round, then their median: pairs share the box's load
                "vs_redis": statistics.median(r[f"{op} redis"][0] / r[key][0] for r in rounds),
                "cpu_s_per_gb": statistics.median(r[key][1] / gb for r in rounds),
                "redis_cpu_s_per_gb": redis_cpu,
                "cpu_vs_redis": statistics.median(r[key][1] / r[f"{op} redis"][1]
                                                  for r in rounds),
            })
    return rows


# ------------------------------------------------------------------------------------ entry


def redis_available() -> bool:
    """Whether the Redis comparison can run here: redis-server on PATH and redis-py."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return shutil.which("redis-server") is not None


def run_rpc_bench(total_bytes: int = 256 * MiB, lookup_repeats: int = 200,
                  small_call_s: float = 2.0, concurrency: int = 32,
                  redis_repeats: int = 3) -> BenchReport:
    """Start a daemon and an echo server, measure, stop them, and return the report.

    Args:
        total_bytes: bytes each put/get measurement moves (whole 32 MiB prompts of 2 MiB
            blocks; at least one prompt).
        lookup_repeats: timed Lookup calls per prefix length.
        small_call_s: seconds each small-call throughput measurement runs.
        concurrency: small calls in flight.
        redis_repeats: paired rounds against redis-py (0: skip; skipped with a note where
            redis-server or redis-py is missing).

    Returns:
        Rows of (measurement, value, unit, echo, vs_echo): ``vs_echo`` is value / echo, so for
        latency above 1 means slower than bare gRPC, for GB/s and calls/s above 1 means faster.
        Rows of the Redis section have (redis, vs_redis, cpu_s_per_gb, redis_cpu_s_per_gb,
        cpu_vs_redis) instead: medians over the rounds, ratios of paired rounds.
    """
    if total_bytes < 1 or lookup_repeats < 1 or small_call_s <= 0 or concurrency < 1:
        raise InvalidArgument("total_bytes, lookup_repeats, small_call_s and concurrency must "
                              "be positive")
    if redis_repeats < 0:
        raise InvalidArgument(f"redis_repeats must be >= 0, got {redis_repeats}")
    with_redis = redis_repeats > 0 and redis_available()
    with tempfile.TemporaryDirectory(prefix="kvsb", dir="/tmp") as tmp:
        root = Path(tmp)
        socket_path, echo_path = root / "kv.sock", root / "echo.sock"
        prompt_bytes = PROMPT_BLOCKS * BLOCK_SPEC.block_bytes
        dram_bytes = max(total_bytes, prompt_bytes) + 256 * MiB
        tcp_address = f"127.0.0.1:{_free_port()}"  # the Redis section's TCP pairs
        daemon_args = ["-m", "kvstore.server.daemon", "--set", f"server.socket_path={socket_path}",
                       "--set", f"dram.capacity_bytes={dram_bytes}", "--set", "ssd.enabled=false",
                       "--set", "server.log_level=WARNING", "--set", "server.metrics_port=0",
                       "--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}",
                       "--set", f"server.tcp_address={tcp_address}",
                       "--set", f"server.admin_token={_BENCH_TOKEN}"]
        echo_args = ["-m", "kvstore.bench.rpc", "--echo-server", f"unix://{echo_path}"]
        address, echo_address = f"unix://{socket_path}", f"unix://{echo_path}"
        with _process(daemon_args, root / "daemon.log") as daemon, \
                _process(echo_args, root / "echo.log") as echo_proc, \
                Client(address, retry=NO_RETRY, max_message_bytes=MAX_MESSAGE_BYTES) as client:
            _wait_until(client.health, daemon, root / "daemon.log")
            echo = Echo(echo_address)
            _wait_until(echo.call(8, 8), echo_proc, root / "echo.log")
            rows = _lookup_rows(client, echo, lookup_repeats)
            rows += _transfer_rows(client, echo, total_bytes)
            rows += asyncio.run(_small_call_rows(address, echo_address, small_call_s,
                                                 concurrency))
            rows += _channel_rows(address, lookup_repeats, small_call_s, concurrency)
            echo.channel.close()
            if with_redis:
                rows += _redis_rows(address, tcp_address, daemon.pid, root, total_bytes,
                                    redis_repeats)
    return BenchReport(
        name="rpc", title="kvstore RPC vs bare grpc.aio echo (same payloads, same run)",
        columns=(Column("measurement", "measurement", justify="left"),
                 Column("value", "kvstore"), Column("unit", "unit", justify="left"),
                 Column("echo", "echo"), Column("vs_echo", "kvstore/echo"),
                 Column("floor", "python floor"), Column("vs_floor", "kvstore/floor"),
                 Column("copy", "one copy"), Column("vs_copy", "kvstore/copy"),
                 Column("aim", "aim"),
                 Column("grpc", "over gRPC"), Column("vs_grpc", "channel/gRPC"),
                 Column("grpc_vs_floor", "gRPC/floor"),
                 Column("redis", "redis"), Column("vs_redis", "kvstore/redis"),
                 Column("cpu_s_per_gb", "CPU s/GB"), Column("redis_cpu_s_per_gb", "redis CPU s/GB"),
                 Column("cpu_vs_redis", "CPU kvstore/redis")),
        rows=tuple(rows), section_key="section",
        params={"total_bytes": total_bytes, "lookup_repeats": lookup_repeats,
                "small_call_s": small_call_s, "concurrency": concurrency,
                "redis_repeats": redis_repeats if with_redis else 0,
                "block_spec": BLOCK_SPEC.to_dict(), "lookup_spec": LOOKUP_SPEC.to_dict(),
                "prompt_blocks": PROMPT_BLOCKS},
        notes=(("kvstore/echo: latency above 1 is slower than bare gRPC; GB/s and calls/s "
               "above 1 are faster. Shared-memory rows compare against the socket echo."),
               ("python floor: a plain Python lookup in this process (chained blake2b over "
                "16-token blocks, a dict probe per key), measured beside each Lookup row."),
               ("channel/gRPC: the same calls on a call channel and over gRPC, alternated call "
                "by call, median over rounds of each round's ratio: for ms below 1 is faster, "
                "for GB/s and calls/s above 1 is faster. kvstore/floor there: the same per "
                "round."),
               ("kvstore/redis: one kvstore put/get of a 16-block prompt (32 MiB) against 16 "
               "redis-py SET/GET of its 2 MiB blocks in one pipeline; above 1 is faster. CPU "
               "s/GB counts both sides (this process and the daemon or redis-server)."),
               *(() if with_redis or not redis_repeats else
                 ("redis-server or redis-py is missing: the Redis section was skipped",))),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.bench.rpc")
    parser.add_argument("--echo-server", metavar="ADDRESS", help="serve the echo baseline only")
    parser.add_argument("--total-bytes", type=int, default=256 * MiB)
    parser.add_argument("--redis-repeats", type=int, default=3,
                        help="paired rounds against redis-py (0: skip)")
    parser.add_argument("--json", help="results file [default: bench/results/rpc-<date>.json]")
    args = parser.parse_args(argv)
    if args.echo_server:
        asyncio.run(serve_echo(args.echo_server))
        return 0
    write_report(run_rpc_bench(total_bytes=args.total_bytes, redis_repeats=args.redis_repeats),
                 args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
