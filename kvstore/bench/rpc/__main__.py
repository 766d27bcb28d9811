"""``python -m kvstore.bench.rpc``: the RPC bench without the ``kvstore`` command."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvstore.bench.report import write_report
from kvstore.bench.rpc.common import MiB
from kvstore.bench.rpc.echo import serve_echo
from kvstore.bench.rpc.run import run_rpc_bench


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
