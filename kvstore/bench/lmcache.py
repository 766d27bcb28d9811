"""kvstore beside LMCache 0.5.6: put and get of the same K/V payloads through each one's own
storage paths, in one run, as ratios kvstore/LMCache.

Paths: kvstore's in-process ``Store``, its daemon through the socket and through shared memory;
LMCache's in-process ``LocalCPUBackend`` and its remote server (``python -m lmcache.v1.server``,
the ``lm://`` backend) on loopback TCP through its ``LMCServerConnector``. A put starts from a
K/V tensor in the caller's hands and ends when the store holds it; a get ends with the K/V in a
warm tensor the caller holds: kvstore writes it there (``get(out=)``), LMCache hands a memory
object of its own, which is copied into the destination as its engine copies it into the paged
cache. So each side copies once per direction in process, and the remote paths also cross a
socket.

LMCache needs a CUDA torch by its pins but runs these paths on the CPU torch; it lives in its own
venv (``.venv-lmcache``, built by ``bash scripts/services/lmcache.sh build``) and is driven in a
subprocess of that venv's python (``python -m kvstore.bench.lmcache --worker``), which imports
this module's top level (the standard library, torch and ``kvstore.bench.procs``) and
lmcache, never the rest of kvstore.
The worker answers one JSON command per line; its answers are the lines starting ``REPLY``.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.bench.procs import child, daemon_args, free_port, lmcache_env, wait_until

MiB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LMCACHE_PYTHON = REPO_ROOT / ".venv-lmcache" / "bin" / "python"
LMCACHE_VERSION = "0.5.6"
_REPLY = "REPLY "
_START_S = 120.0  # the worker imports lmcache (about 10 s on the 2-core box) and starts a server


@dataclass(frozen=True, slots=True)
class Case:
    """One payload: ``blocks`` blocks of ``block_tokens`` tokens per put or get call."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    blocks: int

    @property
    def block_bytes(self) -> int:  # bf16 K and V of every layer
        return self.num_layers * 2 * self.block_tokens * self.num_kv_heads * self.head_dim * 2

    @property
    def call_bytes(self) -> int:
        return self.blocks * self.block_bytes

    def lmcache_shape(self) -> tuple[int, ...]:
        """One LMCache chunk in its ``KV_2LTD`` format: ``[2, L, T, H * D]``."""
        return (2, self.num_layers, self.block_tokens, self.num_kv_heads * self.head_dim)


# A 7-8B model's geometry (32 layers, 8 KV heads of 128, bf16). 16-token blocks are 2 MiB; vLLM's
# CPU backend defaults to 128-token blocks (vllm/platforms/cpu.py, 0.32), 16 MiB here.
CASES = (Case("2 MiB block", 32, 8, 128, 16, 1),
         Case("16-block prefix (32 MiB)", 32, 8, 128, 16, 16),
         Case("vLLM-CPU block (128 tokens, 16 MiB)", 32, 8, 128, 128, 1))
QUICK_CASES = (Case("tiny block", 2, 2, 64, 16, 1), Case("tiny 4-block prefix", 2, 2, 64, 16, 4))
# The daemon paths make their small calls (Lookup, Reserve/Commit, Acquire/Release) on the
# client's call channel; the "gRPC calls" twins make them over gRPC (call_channel=False).
GRPC_CALLS = ", gRPC calls"
KVSTORE_PATHS = ("Store, in-process", "daemon, socket", "daemon, shared memory",
                 "daemon, socket" + GRPC_CALLS, "daemon, shared memory" + GRPC_CALLS)
LMCACHE_PATHS = ("LocalCPUBackend, in-process", "lm:// server, loopback TCP")
# which LMCache path each kvstore path stands beside: in-process with in-process, across
# processes with across processes (LMCache's remote server has no shared-memory path)
PAIRS = dict(zip(KVSTORE_PATHS, (LMCACHE_PATHS[0], *[LMCACHE_PATHS[1]] * 4), strict=True))


def calls_per_pass(case: Case, total_bytes: int) -> int:
    return max(1, total_bytes // case.call_bytes)


def _seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


# ---------------------------------------------------------------- LMCache side (its own venv)


class LMCacheSide:
    """LMCache's backends for one case: the in-process CPU backend and a connector to the
    ``lm://`` server (its allocator gives both their memory objects)."""

    def __init__(self, case: Case, calls: int, port: int) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.token_database import ChunkedTokenDatabase

        self.case, self.calls = case, calls
        # room for a pass held by the backend plus the objects a remote pass has in flight
        size_gb = 2.2 * calls * case.call_bytes / 1e9 + 0.1
        config = LMCacheEngineConfig.from_defaults(chunk_size=case.block_tokens, local_cpu=True,
                                                   max_local_cpu_size=size_gb, remote_url=None)
        metadata = LMCacheMetadata(
            model_name="bench", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16,
            kv_shape=(case.num_layers, 2, case.block_tokens, case.num_kv_heads, case.head_dim))
        self.backend = LocalCPUBackend(config, metadata)
        # Keys as LMCache's engine makes them: chained hashes of each chunk of a prompt's
        # tokens (the prompts are kvstore's side's).
        self.tokens_db = ChunkedTokenDatabase(config, metadata)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.connector = LMCServerConnector("127.0.0.1", port, self.loop, self.backend)
        g = torch.Generator().manual_seed(0)
        self.source = [torch.randn(case.lmcache_shape(), generator=g).to(torch.bfloat16)
                       for _ in range(case.blocks)]
        self.target = [torch.empty_like(t) for t in self.source]

    def keys(self, call: int) -> list[Any]:
        """The keys of prompt ``call``'s chunks, hashed from its tokens."""
        tokens = self.case.blocks * self.case.block_tokens
        return [key for _, _, key in self.tokens_db.process_tokens(
            list(range(call * tokens, (call + 1) * tokens)))]

    def _filled(self, block: int) -> Any:
        from lmcache.v1.memory_management import MemoryFormat

        obj = self.backend.allocate(torch.Size(self.case.lmcache_shape()), torch.bfloat16,
                                    MemoryFormat.KV_2LTD)
        if obj is None:
            raise RuntimeError("LMCache's CPU allocator is full")
        obj.tensor.copy_(self.source[block])
        return obj

    def _remote(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def run(self, path: str) -> dict[str, float]:
        remote = path == LMCACHE_PATHS[1]
        put_s = _seconds(lambda: [self._put(key, b, remote) for c in range(self.calls)
                                  for b, key in enumerate(self.keys(c))])
        lookup_s = _seconds(lambda: [self._lookup(self.keys(c), remote)
                                     for c in range(self.calls)])
        get_s = _seconds(lambda: [self._get(key, b, remote) for c in range(self.calls)
                                  for b, key in enumerate(self.keys(c))])
        if not all(torch.equal(s, t) for s, t in zip(self.source, self.target, strict=True)):
            raise RuntimeError(f"{path}: the K/V read back differs from the K/V put")
        for t in self.target:
            t.zero_()
        if not remote:  # the server keeps the keys: the next pass overwrites them
            for c in range(self.calls):
                for key in self.keys(c):
                    self.backend.remove(key)
        return {"put_s": put_s, "get_s": get_s, "lookup_s": lookup_s}

    def _lookup(self, keys: list[Any], remote: bool) -> None:
        """How much of a prompt is stored, as LMCache's engine asks: its tokens hashed (the
        caller's ``keys(call)``), then chunk by chunk from the first, until one is missing
        (every one is here)."""
        for key in keys:
            found = (self._remote(self.connector.exists(key)) if remote
                     else self.backend.contains(key))
            if not found:
                raise RuntimeError(f"LMCache lost chunk {key.chunk_hash}")

    def _put(self, key: Any, block: int, remote: bool) -> None:
        obj = self._filled(block)
        if remote:
            self._remote(self.connector.put(key, obj))
        else:
            self.backend.submit_put_task(key, obj)  # takes its own reference
        obj.ref_count_down()

    def _get(self, key: Any, block: int, remote: bool) -> None:
        obj = (self._remote(self.connector.get(key)) if remote
               else self.backend.get_blocking(key))
        if obj is None:
            raise RuntimeError(f"LMCache lost chunk {key.chunk_hash}")
        self.target[block].copy_(obj.tensor)
        obj.ref_count_down()

    def close(self) -> None:
        self._remote(self.connector.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.backend.close()


def _start_lm_server() -> tuple[subprocess.Popen, int]:
    import socket

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1",
                               str(port), "cpu"], stdout=sys.stderr, stderr=sys.stderr)
    deadline = time.monotonic() + _START_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("the LMCache server did not start") from None
            time.sleep(0.2)


def worker() -> int:
    """Serve the commands of ``LMCacheWorker`` on stdin until ``exit``."""
    from lmcache import __version__

    server, port = _start_lm_server()
    side: LMCacheSide | None = None
    print(_REPLY + json.dumps({"version": __version__}), flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "exit":
                break
            if command["op"] == "case":
                if side is not None:
                    side.close()
                side = LMCacheSide(Case(**command["case"]), command["calls"], port)
                reply: dict[str, Any] = {}
            else:
                reply = side.run(command["path"])  # type: ignore[union-attr]
            print(_REPLY + json.dumps(reply), flush=True)
    finally:
        if side is not None:
            side.close()
        server.terminate()
        server.wait(10)
    return 0


# --------------------------------------------------------------------------- kvstore side


class LMCacheWorker:
    """The LMCache worker subprocess, driven a command at a time."""

    def __init__(self, python: Path, log_path: Path) -> None:
        env = {**lmcache_env("WARNING"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen([str(python), "-m", "kvstore.bench.lmcache", "--worker"],
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True, cwd=REPO_ROOT)
        self.log_path = log_path
        self.version = self._reply()["version"]

    def _reply(self) -> dict[str, Any]:
        from kvstore.errors import KVStoreError

        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(_REPLY):
                return json.loads(line[len(_REPLY):])
        raise KVStoreError(f"the LMCache worker exited ({self._proc.wait()}): "
                           f"{self.log_path.read_text()[-2000:]}")

    def call(self, **command: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:  # "exit" has no reply: the worker stops its server and leaves
                self._proc.stdin.write(json.dumps({"op": "exit"}) + "\n")  # type: ignore[union-attr]
                self._proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


class KVStoreSide:
    """kvstore's paths for one case: an in-process ``Store`` on ``loop`` and a client of a
    daemon subprocess."""

    def __init__(self, case: Case, index: int, calls: int, store: Any,
                 loop: asyncio.AbstractEventLoop, client: Any, grpc_client: Any) -> None:
        from kvstore.keys import Namespace
        from kvstore.spec import KVSpec

        spec = KVSpec(num_layers=case.num_layers, num_kv_heads=case.num_kv_heads,
                      head_dim=case.head_dim, block_tokens=case.block_tokens, dtype="bfloat16")
        self.ns = Namespace(model_id=f"bench/lmcache/{index}", spec=spec, tenant="bench")
        self.store, self.loop, self.client = store, loop, client
        self.grpc_client = grpc_client  # the same calls, never on a call channel
        g = torch.Generator().manual_seed(0)
        self.kv = torch.randn(spec.shape(case.blocks * case.block_tokens),
                              generator=g).to(torch.bfloat16)
        self.out = torch.empty_like(self.kv)  # the gets' warm destination, as LMCache's

        tokens = case.blocks * case.block_tokens
        self.prompts = [list(range(i * tokens, (i + 1) * tokens)) for i in range(calls)]

    def _calls(self, path: str) -> tuple[Any, Any, Any, Any]:
        ns, kv = self.ns, self.kv
        if path == KVSTORE_PATHS[0]:
            run = self.loop.run_until_complete
            return (lambda t: run(self.store.put(ns, t, kv)),
                    lambda t: run(self.store.get(ns, t, out=self.out)),
                    lambda t: run(self.store.lookup(ns, t)),
                    lambda: run(self.store.evict(model_id=ns.model_id)))
        zero_copy = "shared memory" in path
        client = self.grpc_client if path.endswith(GRPC_CALLS) else self.client
        return (lambda t: client.put(ns, t, kv, zero_copy=zero_copy),
                lambda t: client.get(ns, t, zero_copy=zero_copy, out=self.out),
                lambda t: client.lookup(ns, t),
                lambda: client.evict(model_id=ns.model_id))

    def run(self, path: str) -> dict[str, float]:
        from kvstore.errors import KVStoreError

        put, get, lookup, evict = self._calls(path)
        got: list[Any] = []
        whole = len(self.prompts[0])
        put_s = _seconds(lambda: [put(t) for t in self.prompts])
        hits: list[Any] = []
        lookup_s = _seconds(lambda: hits.extend(lookup(t) for t in self.prompts))
        self.out.fill_(float("nan"))
        get_s = _seconds(lambda: got.extend(get(t) for t in self.prompts))
        evict()
        # Every prompt holds the same K/V: the last get's, in out, is checked.
        if any(g is None for g in got) or not torch.equal(self.out, self.kv):
            raise KVStoreError(f"{path}: the K/V read back differs from the K/V put")
        if any(hit.matched_tokens != whole for hit in hits):
            raise KVStoreError(f"{path}: a lookup missed a prompt just put")
        return {"put_s": put_s, "get_s": get_s, "lookup_s": lookup_s}


def _gbps(nbytes: int, seconds: list[float]) -> list[float]:
    return [nbytes / s / 1e9 for s in seconds]


def _case_rows(case: Case, calls: int, times: dict[str, dict[str, list[float]]]
               ) -> list[dict[str, Any]]:
    nbytes = calls * case.call_bytes
    rows = []
    for op in ("put", "get"):
        for path, beside in PAIRS.items():
            ours, theirs = _gbps(nbytes, times[path][op]), _gbps(nbytes, times[beside][op])
            value, base = statistics.median(ours), statistics.median(theirs)
            rows.append({"case": case.name, "op": op, "path": path, "gbps": value,
                         "lmcache_path": beside, "lmcache_gbps": base, "ratio": value / base,
                         "rate": value, "lmcache_rate": base, "unit": "GB/s",
                         "bytes": nbytes, "calls": calls, "call_bytes": case.call_bytes,
                         "round_gbps": ours, "lmcache_round_gbps": theirs})
    for path, beside in PAIRS.items():  # a whole prompt's lookup, per second
        ours = [calls / s for s in times[path]["lookup"]]
        theirs = [calls / s for s in times[beside]["lookup"]]
        value, base = statistics.median(ours), statistics.median(theirs)
        rows.append({"case": case.name, "op": "lookup", "path": path, "rate": value,
                     "lmcache_path": beside, "lmcache_rate": base, "ratio": value / base,
                     "unit": "lookups/s", "calls": calls, "blocks": case.blocks,
                     "round_rate": ours, "lmcache_round_rate": theirs})
    return rows


def _measure(case: Case, calls: int, ours: KVStoreSide, lmcache: LMCacheWorker, repeat: int
             ) -> dict[str, dict[str, list[float]]]:
    """Every path ``repeat`` times after one unrecorded warm-up round (it grows and pre-faults
    the arenas), kvstore first in even rounds and LMCache first in odd ones."""
    times = {p: {"put": [], "get": [], "lookup": []} for p in (*KVSTORE_PATHS, *LMCACHE_PATHS)}
    lmcache.call(op="case", case=asdict(case), calls=calls)
    for round_index in range(repeat + 1):
        sides = [(KVSTORE_PATHS, ours.run), (LMCACHE_PATHS, lambda p: lmcache.call(op="run",
                                                                                   path=p))]
        for paths, run in sides if round_index % 2 == 0 else sides[::-1]:
            for path in paths:
                result = run(path)
                if round_index:
                    for op in ("put", "get", "lookup"):
                        times[path][op].append(result[f"{op}_s"])
    return times


def lmcache_python(path: str | os.PathLike[str] | None = None) -> Path:
    """The LMCache venv's python: ``path``, else $KVSTORE_LMCACHE_PYTHON, else .venv-lmcache."""
    from kvstore.errors import KVStoreError

    chosen = Path(path or os.environ.get("KVSTORE_LMCACHE_PYTHON") or DEFAULT_LMCACHE_PYTHON)
    if not chosen.exists():
        raise KVStoreError(f"no LMCache venv at {chosen}: build it with `bash "
                           f"scripts/services/lmcache.sh build` (LMCache {LMCACHE_VERSION} on "
                           "the CPU torch) or pass its python")
    return chosen


def _backend_section(total_bytes: int, repeat: int, quick: bool, venv_python: Path
                     ) -> tuple[list[dict[str, Any]], str]:
    """Every case on every path of both stores: the rows and LMCache's version."""
    import tempfile

    from kvstore.client import NO_RETRY, Client
    from kvstore.config import DramConfig, KVStoreConfig, SsdConfig
    from kvstore.store import Store

    cases = QUICK_CASES if quick else CASES
    pass_bytes = max(calls_per_pass(c, total_bytes) * c.call_bytes for c in cases)
    dram_bytes = int(pass_bytes * 1.1) + 256 * MiB
    rows: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    store = Store(KVStoreConfig(dram=DramConfig(capacity_bytes=dram_bytes),
                                ssd=SsdConfig(enabled=False)))
    with tempfile.TemporaryDirectory(prefix="kvsl", dir="/tmp") as tmp:
        root = Path(tmp)
        socket_path = root / "kv.sock"
        with child(daemon_args(socket_path, dram_bytes), root / "daemon.log") as daemon, \
                Client(f"unix://{socket_path}", retry=NO_RETRY) as client, \
                Client(f"unix://{socket_path}", retry=NO_RETRY,
                       call_channel=False) as grpc_client:
            worker_proc = LMCacheWorker(venv_python, root / "lmcache.log")
            try:
                loop.run_until_complete(store.open())
                wait_until(client.health, daemon, root / "daemon.log")
                for index, case in enumerate(cases):
                    calls = calls_per_pass(case, total_bytes)
                    ours = KVStoreSide(case, index, calls, store, loop, client, grpc_client)
                    rows += _case_rows(case, calls, _measure(case, calls, ours, worker_proc,
                                                             repeat))
            finally:
                worker_proc.close()
                loop.run_until_complete(store.close())
                loop.close()
    return rows, worker_proc.version


def _installed_version(venv_python: Path) -> str:
    """The lmcache version installed in the LMCache venv (read without importing lmcache)."""
    probe = "import importlib.metadata as m; print(m.version('lmcache'))"
    done = subprocess.run([str(venv_python), "-c", probe], capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


_BACKEND_NOTES = (
    ("kvstore/LMCache above 1: kvstore is faster. A lookup asks how much of a prompt just put "
     "is stored, from its tokens: kvstore's Lookup once per prompt; LMCache's token database "
     "hashing the chunks, then contains / exists once per chunk from the first, as its engine "
     "asks."),
    ("A put starts from the caller's tensor; a get ends with the K/V in a tensor the caller "
     "can use (LMCache's memory object copied out, as its engine copies it into the cache)."),
    ("LMCache's remote server has no shared-memory path: both daemon paths stand beside its "
     "loopback TCP server."))
_SERVER_NOTES = (
    ("Beside `lmcache server`: LMCache's numbers are its own `lmcache bench server --mode cpu` "
     "report (the p50 and mean latency of each operation of one request after another); "
     "kvstore's are the same requests from a Client of its daemon through shared memory, "
     "timed the same way. Rates are a request's bytes (or one lookup) over the mean latency: "
     "kvstore/LMCache above 1 is kvstore ahead; for the ms p50 rows below 1 is."),)


def run_lmcache_bench(total_bytes: int = 256 * MiB, repeat: int = 3, quick: bool = False,
                      python: str | os.PathLike[str] | None = None, backends: bool = True,
                      server: bool = False) -> Any:
    """Measure both stores and return the report.

    Args:
        total_bytes: bytes each put or get pass of a path moves (whole calls, at least one).
        repeat: recorded rounds per path; the table shows medians.
        quick: tiny two-layer payloads instead of the 7-8B model's (seconds; for tests).
        python: the LMCache venv's python (see :func:`lmcache_python`).
        backends: every case on every path beside LMCache's CPU backend and ``lm://`` server.
        server: the section beside LMCache's multiprocess ``lmcache server``, driven by its
            ``lmcache bench server --mode cpu`` (``kvstore.bench.lmcache_server``).

    Returns:
        A ``BenchReport``: one row per (case, op, kvstore path) with its rate, the LMCache path
        beside it, that path's rate and their ratio (above 1: kvstore is faster, except for
        the ``ms p50`` rows, where below 1 is).
    """
    from kvstore.bench.report import BenchReport, Column
    from kvstore.errors import InvalidArgument

    if total_bytes < 1 or repeat < 1:
        raise InvalidArgument(f"total_bytes ({total_bytes}) and repeat ({repeat}) must be "
                              "positive")
    if not (backends or server):
        raise InvalidArgument("nothing to run: neither the backends nor the server section")
    venv_python = lmcache_python(python)
    rows: list[dict[str, Any]] = []
    params: dict[str, Any] = {"total_bytes": total_bytes, "repeat": repeat, "quick": quick}
    notes: tuple[str, ...] = ()
    version = _installed_version(venv_python)
    if backends:
        backend_rows, version = _backend_section(total_bytes, repeat, quick, venv_python)
        rows += backend_rows
        notes += _BACKEND_NOTES
        params["cases"] = [asdict(c) | {"call_bytes": c.call_bytes}
                           for c in (QUICK_CASES if quick else CASES)]
    if server:
        from kvstore.bench.lmcache_server import run_server_section

        server_rows, params["server"] = run_server_section(venv_python, total_bytes, repeat,
                                                           quick)
        rows += server_rows
        notes += _SERVER_NOTES
    params["lmcache_version"] = version
    return BenchReport(
        name="lmcache", title=f"kvstore vs LMCache {version} (same payloads, same run; "
                              "medians)",
        columns=(Column("op", "op", justify="left"), Column("path", "kvstore path",
                                                            justify="left"),
                 Column("rate", "rate"), Column("lmcache_path", "beside LMCache",
                                                justify="left"),
                 Column("lmcache_rate", "rate"), Column("unit", "unit", justify="left"),
                 Column("better", "better", justify="left"),
                 Column("ratio", "kvstore/LMCache")),
        rows=tuple(rows), section_key="case", params=params, notes=notes)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvstore.bench.lmcache")
    parser.add_argument("--worker", action="store_true",
                        help="serve LMCache's side (run by the LMCache venv's python)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    from kvstore.bench.report import write_report

    write_report(run_lmcache_bench())
    return 0


if __name__ == "__main__":
    sys.exit(main())
