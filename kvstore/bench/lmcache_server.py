"""kvstore beside LMCache 0.5.6's multiprocess ``lmcache server``, driven by LMCache's own
``lmcache bench server --mode cpu`` on one side and the same requests from a kvstore ``Client``
of a daemon on the other.

LMCache's side runs as its user would run it, from its venv (``.venv-lmcache``): ``lmcache
server`` on loopback ZMQ with its L1 in a POSIX shared-memory segment (``--shm-name``,
``--supported-transfer-mode engine_driven``), and for each recorded round one ``lmcache bench
server --mode cpu --transfer-mode engine_driven`` process. That client registers one mock
worker (tp 1) whose paged KV cache is one CPU tensor ``[2, pages, page_tokens, H, D]`` per
layer and makes its requests one after another, no two at once. For each request (``--start``
to ``--end``, ``--interval 0``): a cold LOOKUP (LOOKUP, then QUERY_PREFETCH_STATUS until it
answers), a STORE of every whole chunk (the worker gathers the request's pages into the
server's shared-memory slots, then commits), then a warm LOOKUP and a RETRIEVE of every chunk
(the worker scatters the slots into its zeroed pages). It times each of the four with
``time.monotonic`` and reports per operation the count and the mean, min, max, p50 and p99 in
ms (``--format json --output``), and how many requests' checksums (MD5 of the pages stored
against the pages retrieved) matched. It prints no throughput: the GB/s and lookups/s here are
a request's bytes (or one lookup) over the mean latency of its operation.

kvstore's side: a daemon subprocess and one ``Client`` over its Unix socket with shared memory
(``zero_copy=True``), the same requests in the same order, one at a time, timed the same way:
``lookup`` (cold), ``put`` of the request's K/V from one contiguous tensor, ``lookup`` (warm),
``get`` into a zeroed warm tensor (``out=``). Each side moves every byte once per direction.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.bench.procs import child, daemon_args, free_port, lmcache_env, wait_until
from kvstore.errors import KVStoreError

MiB = 1 << 20

_START_S = 120.0  # LMCache's server imports in about 10 s on the 2-core box
_BENCH_TIMEOUT_S = 600.0
_HOST = "127.0.0.1"
# kvstore's name of each operation -> the section of LMCache's JSON report that times it
OPS = {"store": "cold_store", "retrieve": "warm_retrieve", "lookup, stored prompt": "warm_lookup",
       "lookup, new prompt": "cold_lookup"}
KVSTORE_PATH = "daemon, shared memory"  # a Client(zero_copy=True) on its socket
LMCACHE_PATH = "lmcache server, shared memory"  # its `lmcache bench server --mode cpu`


@dataclass(frozen=True, slots=True)
class ServerCase:
    """The shapes both sides run: bf16 K/V of ``num_layers`` layers of ``num_kv_heads`` heads
    of ``head_dim``; requests of ``request_tokens`` tokens (whole chunks), stored in chunks of
    ``chunk_tokens`` (LMCache's ``--chunk-size``, kvstore's ``block_tokens``); LMCache's client
    keeps them in a paged cache of ``page_tokens``-token pages."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int
    page_tokens: int
    request_tokens: int

    def __post_init__(self) -> None:
        if self.request_tokens % self.chunk_tokens or self.chunk_tokens % self.page_tokens:
            raise ValueError(f"ServerCase: request_tokens ({self.request_tokens}) must be whole "
                             f"chunks of chunk_tokens ({self.chunk_tokens}), whole pages of "
                             f"page_tokens ({self.page_tokens})")

    @property
    def request_bytes(self) -> int:
        return self.num_layers * 2 * self.request_tokens * self.num_kv_heads * self.head_dim * 2

    def shape_spec(self) -> str:
        """LMCache's ``--kvcache-shape-spec``: a paged cache of twice a request's pages (its
        client places request ``i`` at page ``i * pages % (all - pages)``)."""
        num_pages = 2 * self.request_tokens // self.page_tokens
        return (f"(2,{num_pages},{self.page_tokens},{self.num_kv_heads},{self.head_dim})"
                f":bfloat16:{self.num_layers}")


# A 7-8B model's geometry (32 layers, 8 KV heads of 128, bf16): 128 KiB a token. 256-token
# chunks are LMCache's default --chunk-size (and kvstore's largest block); 16-token pages are
# vLLM's default block; 512 tokens a request are its client's default --num-tokens: 64 MiB.
SERVER_CASE = ServerCase(32, 8, 128, chunk_tokens=256, page_tokens=16, request_tokens=512)
QUICK_SERVER_CASE = ServerCase(2, 2, 64, chunk_tokens=16, page_tokens=16, request_tokens=32)


def nearest_rank(samples: list[float], fraction: float) -> float:
    """The nearest-rank percentile (LMCache's tool reports its p50 and p99 this way)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(len(ordered) * fraction) - 1)]


# ---------------------------------------------------------------------------- LMCache side


class LMCacheServer:
    """``lmcache server`` from the LMCache venv, with ``capacity_bytes`` of shared-memory L1."""

    def __init__(self, python: Path, case: ServerCase, capacity_bytes: int, root: Path) -> None:
        self.python, self.case, self.root = python, case, root
        self.rpc_port, self.http_port = free_port(), free_port()
        self.shm_name = f"kvstore-bench-{os.getpid()}"
        self.log_path = root / "lmcache-server.log"
        command = [str(python), "-m", "lmcache.cli.main", "server", "--host", _HOST,
                   "--port", str(self.rpc_port), "--http-host", _HOST,
                   "--http-port", str(self.http_port), "--chunk-size", str(case.chunk_tokens),
                   "--supported-transfer-mode", "engine_driven", "--shm-name", self.shm_name,
                   "--l1-size-gb", f"{capacity_bytes / (1 << 30):.4f}",
                   "--eviction-policy", "LRU"]
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(command, env=lmcache_env("WARNING"), stdout=log,
                                          stderr=subprocess.STDOUT, cwd=root)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_S
        for port in (self.rpc_port, self.http_port):
            while True:
                try:
                    socket.create_connection((_HOST, port), timeout=1).close()
                    break
                except OSError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        raise KVStoreError("`lmcache server` did not start: "
                                           f"{self.log_path.read_text()[-2000:]}") from None
                    time.sleep(0.2)

    def bench(self, first: int, num_requests: int) -> dict[str, dict[str, float]]:
        """One ``lmcache bench server`` run of requests ``first`` .. ``first + num_requests``;
        its p50 and mean latency (ms) of each of ``OPS``."""
        out = self.root / f"lmcache-bench-{first}.json"
        log_path = self.root / f"lmcache-bench-{first}.log"
        command = [str(self.python), "-m", "lmcache.cli.main", "bench", "server",
                   "--rpc-url", f"tcp://{_HOST}:{self.rpc_port}",
                   "--url", f"http://{_HOST}:{self.http_port}", "--mode", "cpu",
                   "--transfer-mode", "engine_driven",
                   # it prepends one token (the request's number) to these
                   "--num-tokens", str(self.case.request_tokens - 1),
                   "--kvcache-shape-spec", self.case.shape_spec(),
                   "--start", str(first), "--end", str(first + num_requests),
                   "--interval", "0", "--format", "json", "--output", str(out), "--quiet"]
        with open(log_path, "w") as log:
            # INFO: its log says which transport the worker registered with (SHM or pickle)
            done = subprocess.run(command, env=lmcache_env("INFO"), stdout=log,
                                  stderr=subprocess.STDOUT, cwd=self.root,
                                  timeout=_BENCH_TIMEOUT_S, check=False)
        text = log_path.read_text()
        if done.returncode != 0 or not out.exists():
            raise KVStoreError(f"`lmcache bench server` failed ({done.returncode}): "
                               f"{text[-2000:]}")
        if "mode=SHM" not in text:
            raise KVStoreError("`lmcache bench server` did not move K/V through shared memory: "
                               f"{text[-2000:]}")
        return parse_lmcache_report(json.loads(out.read_text()), num_requests)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()  # it stops its HTTP and ZMQ servers and unlinks the segment
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        Path("/dev/shm", f"lmcache_l1_pool_{self.shm_name}").unlink(missing_ok=True)


def parse_lmcache_report(report: dict[str, Any], num_requests: int
                         ) -> dict[str, dict[str, float]]:
    """``OPS``' p50 and mean (ms) from ``lmcache bench server``'s JSON report; KVStoreError
    unless every request was timed and its checksums matched (what it stored came back)."""
    metrics = report["metrics"]
    results = metrics["results"]
    if results["total_requests"] != num_requests or results["checksum_ok"] != num_requests:
        raise KVStoreError(f"`lmcache bench server`: {results['checksum_ok']} of "
                           f"{num_requests} requests came back intact ({results})")
    times = {}
    for op, section in OPS.items():
        found = metrics.get(section, {})
        if found.get(f"{section}_count") != num_requests:
            raise KVStoreError(f"`lmcache bench server` timed {found.get(f'{section}_count')} "
                               f"of {num_requests} {section.replace('_', ' ')}s")
        times[op] = {"p50_ms": found[f"{section}_p50"], "mean_ms": found[f"{section}_mean"]}
    return times


# ---------------------------------------------------------------------------- kvstore side


class KVStoreServerSide:
    """The same requests from a ``Client`` of a daemon, through its shared memory."""

    def __init__(self, case: ServerCase, client: Any) -> None:
        from kvstore.keys import Namespace
        from kvstore.spec import KVSpec

        spec = KVSpec(num_layers=case.num_layers, num_kv_heads=case.num_kv_heads,
                      head_dim=case.head_dim, block_tokens=case.chunk_tokens, dtype="bfloat16")
        self.ns = Namespace(model_id="bench/lmcache-server", spec=spec, tenant="bench")
        self.case, self.client = case, client
        g = torch.Generator().manual_seed(0)
        self.kv = torch.randn(spec.shape(case.request_tokens), generator=g).to(torch.bfloat16)
        self.out = torch.empty_like(self.kv)  # the retrieves' warm destination

    def bench(self, first: int, num_requests: int) -> dict[str, dict[str, float]]:
        """Requests ``first`` .. ``first + num_requests``, as LMCache's client makes them; the
        p50 and mean latency (ms) of each of ``OPS``."""
        samples: dict[str, list[float]] = {op: [] for op in OPS}
        ns, client, whole = self.ns, self.client, self.case.request_tokens

        def timed(op: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            result = call(*args, **kwargs)
            samples[op].append((time.monotonic() - start) * 1000)
            return result

        for request in range(first, first + num_requests):
            tokens = list(range(request * whole, (request + 1) * whole))
            miss = timed("lookup, new prompt", client.lookup, ns, tokens)
            written = timed("store", client.put, ns, tokens, self.kv, zero_copy=True)
            self.out.zero_()
            hit = timed("lookup, stored prompt", client.lookup, ns, tokens)
            got = timed("retrieve", client.get, ns, tokens, zero_copy=True, out=self.out)
            if (miss.matched_tokens, written, hit.matched_tokens) != (0, whole, whole):
                raise KVStoreError(f"request {request}: looked up {miss.matched_tokens} tokens "
                                   f"before its put, put {written}, then looked up "
                                   f"{hit.matched_tokens} of {whole}")
            if got is None or not torch.equal(self.out, self.kv):
                raise KVStoreError(f"request {request}: the K/V read back differs from the K/V "
                                   "put")
        return {op: {"p50_ms": nearest_rank(s, 0.5), "mean_ms": statistics.fmean(s)}
                for op, s in samples.items()}


# ---------------------------------------------------------------------------- the section


def _rows(case: ServerCase, num_requests: int, ours: list[dict[str, dict[str, float]]],
          theirs: list[dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    section = (f"beside `lmcache server` ({case.request_tokens}-token requests of "
               f"{case.request_bytes / MiB:.4g} MiB, {case.chunk_tokens}-token chunks)")
    common = {"case": section, "path": KVSTORE_PATH, "lmcache_path": LMCACHE_PATH,
              "calls": num_requests, "request_bytes": case.request_bytes, "concurrency": 1}
    rows = []
    for op in OPS:
        is_lookup = op.startswith("lookup")
        # throughput of a round: a request's bytes (or one lookup) over the op's mean latency
        per_call = 1000.0 if is_lookup else case.request_bytes / 1e9 * 1000
        rate = [per_call / r[op]["mean_ms"] for r in ours]
        lmcache_rate = [per_call / r[op]["mean_ms"] for r in theirs]
        value, base = statistics.median(rate), statistics.median(lmcache_rate)
        rows.append({**common, "op": op, "rate": value, "lmcache_rate": base,
                     "unit": "lookups/s" if is_lookup else "GB/s", "better": "higher",
                     "ratio": value / base, "round_rate": rate,
                     "lmcache_round_rate": lmcache_rate})
        p50 = [r[op]["p50_ms"] for r in ours]
        lmcache_p50 = [r[op]["p50_ms"] for r in theirs]
        value, base = statistics.median(p50), statistics.median(lmcache_p50)
        rows.append({**common, "op": op, "rate": value, "lmcache_rate": base,
                     "unit": "ms p50", "better": "lower", "ratio": value / base,
                     "round_rate": p50, "lmcache_round_rate": lmcache_p50})
    return rows


def run_server_section(python: Path, total_bytes: int, repeat: int, quick: bool
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Both sides ``repeat`` recorded rounds of the same requests after one unrecorded warm-up
    round, kvstore first in even rounds and LMCache first in odd ones.

    Returns:
        The section's rows (medians of the rounds) and its parameters.
    """
    import tempfile

    from kvstore.client import NO_RETRY, Client

    case = QUICK_SERVER_CASE if quick else SERVER_CASE
    num_requests = max(1, total_bytes // case.request_bytes)
    # Both hold every round (neither side evicts); LMCache evicts above 80 % of its L1.
    capacity_bytes = int((repeat + 1) * num_requests * case.request_bytes * 1.25) + 256 * MiB
    ours: list[dict[str, dict[str, float]]] = []
    theirs: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="kvsls", dir="/tmp") as tmp:
        root = Path(tmp)
        socket_path = root / "kv.sock"
        with child(daemon_args(socket_path, capacity_bytes), root / "daemon.log") as daemon, \
                Client(f"unix://{socket_path}", retry=NO_RETRY, zero_copy=True) as client:
            wait_until(client.health, daemon, root / "daemon.log")
            server = LMCacheServer(python, case, capacity_bytes, root)
            try:
                kvstore_side = KVStoreServerSide(case, client)
                for round_index in range(repeat + 1):
                    first = round_index * num_requests
                    sides = [(ours, kvstore_side.bench), (theirs, server.bench)]
                    for results, bench in sides if round_index % 2 == 0 else sides[::-1]:
                        result = bench(first, num_requests)
                        if round_index:
                            results.append(result)
            finally:
                server.close()
    params = {"case": asdict(case), "request_bytes": case.request_bytes,
              "num_requests": num_requests, "concurrency": 1, "capacity_bytes": capacity_bytes,
              "lmcache_shape_spec": case.shape_spec(), "kvstore_rounds": ours,
              "lmcache_rounds": theirs}
    return _rows(case, num_requests, ours, theirs), params
