"""The socket path (data socket, and the streamed gRPC fallback) against redis-py SET/GET of
the same 2 MiB values pipelined a prompt deep, on a redis-server started here, over Unix
sockets and TCP loopback, with CPU seconds per GB of both sides."""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvstore.bench.procs import START_S, free_port
from kvstore.bench.rpc.common import (
    BENCH_TOKEN,
    BLOCK_SPEC,
    MAX_MESSAGE_BYTES,
    PROMPT_BLOCKS,
    each,
    seconds_of,
)
from kvstore.client import NO_RETRY, Client
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace

_REDIS_SECTION = "socket path against redis-py SET/GET, pipelined 16 deep"


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
    wall = seconds_of(call)
    return wall, _cpu_s(pids) - cpu


@contextlib.contextmanager
def _redis_server(root: Path) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    """redis-server on a free loopback port and a Unix socket, no persistence."""
    import redis

    port, unix = free_port(), root / "redis.sock"
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--unixsocket", str(unix), "--unixsocketperm", "700",
            "--dir", str(root), "--logfile", str(root / "redis.log"), "--protected-mode", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
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
        out[f"get {name}"] = _measured(lambda c=client, p=prompts: each(
            p, lambda t, c=c: c.get(ns, t)), pids)
        client.evict(model_id=ns.model_id)
    out["put redis"] = _measured(lambda: [redis_side.put(i) for i in range(num_calls)], pids)
    out["get redis"] = _measured(lambda: [redis_side.get(i) for i in range(num_calls)], pids)
    redis_side.conn.flushall()
    return out


def redis_rows(unix_address: str, tcp_address: str, daemon_pid: int, root: Path,
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
            token = None if transport == "unix" else BENCH_TOKEN
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

