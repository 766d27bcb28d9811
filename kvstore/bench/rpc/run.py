"""Start a daemon, an echo server (and a redis-server where there is one), measure every
section of the RPC bench against them, and put the rows in one report."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from kvstore.bench.procs import child, daemon_args, free_port, wait_until
from kvstore.bench.report import BenchReport, Column
from kvstore.bench.rpc.channel import channel_rows
from kvstore.bench.rpc.common import (
    BENCH_TOKEN,
    BLOCK_SPEC,
    LOOKUP_SPEC,
    MAX_MESSAGE_BYTES,
    PROMPT_BLOCKS,
    MiB,
)
from kvstore.bench.rpc.echo import Echo, lookup_rows, small_call_rows, transfer_rows
from kvstore.bench.rpc.redis_pairs import redis_rows
from kvstore.client import NO_RETRY, Client
from kvstore.errors import InvalidArgument


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
        tcp_address = f"127.0.0.1:{free_port()}"  # the Redis section's TCP pairs
        daemon_argv = daemon_args(socket_path, dram_bytes) + [
            "--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}",
            "--set", f"server.tcp_address={tcp_address}",
            "--set", f"server.admin_token={BENCH_TOKEN}"]
        echo_args = ["-m", "kvstore.bench.rpc.echo", f"unix://{echo_path}"]
        address, echo_address = f"unix://{socket_path}", f"unix://{echo_path}"
        with child(daemon_argv, root / "daemon.log") as daemon, \
                child(echo_args, root / "echo.log") as echo_proc, \
                Client(address, retry=NO_RETRY, max_message_bytes=MAX_MESSAGE_BYTES) as client:
            wait_until(client.health, daemon, root / "daemon.log")
            echo = Echo(echo_address)
            wait_until(echo.call(8, 8), echo_proc, root / "echo.log")
            rows = lookup_rows(client, echo, lookup_repeats)
            rows += transfer_rows(client, echo, total_bytes)
            rows += asyncio.run(small_call_rows(address, echo_address, small_call_s,
                                                concurrency))
            rows += channel_rows(address, lookup_repeats, small_call_s, concurrency)
            echo.channel.close()
            if with_redis:
                rows += redis_rows(address, tcp_address, daemon.pid, root, total_bytes,
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
