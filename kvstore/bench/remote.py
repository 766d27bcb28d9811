"""``kvstore bench remote``: the remote tier's put/get GB/s for 2 MiB pages against raw redis-py
SET/GET of the same bytes pipelined the same way over the same client, and its prefix probe
latency against pipelined EXISTS, in one run.

Without ``--url`` it starts a throwaway redis-server on loopback (persistence off).
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvstore.bench.report import BenchReport, Column
from kvstore.config import RemoteConfig
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from kvstore.page import PageMeta, encode_page
from kvstore.tiers.remote.tier import RemoteTier

PAGE_BYTES = 2 << 20
PROBE_TOKENS = (8192, 32768)
BLOCK_TOKENS = 16  # a 2 MiB page per 16 tokens: e.g. 32 layers x 8 heads x 128 x bf16 x K,V
NAMESPACE = b"bench-namespace!"
COLUMNS = (Column("op", "operation", justify="left"), Column("kvstore", "kvstore"),
           Column("raw", "raw redis-py"), Column("ratio", "kvstore / raw"),
           Column("unit", "unit", justify="left"))


def _pages(num: int, payload_bytes: int, tenant: str) -> list[tuple[PageMeta, bytes]]:
    out = []
    payload = os.urandom(payload_bytes)  # the same bytes per page: the store never looks inside
    for i in range(num):
        key = BlockKey(secrets.token_bytes(16))
        meta = PageMeta(key=key, namespace=NAMESPACE, parent=None, block_index=i, tenant=tenant,
                        model_id="bench", codec="raw", codec_id=1)
        out.append((meta, encode_page(meta, payload)))
    return out


async def _median_ms(repeat: int, *runs: Callable[[], Awaitable[Any]]) -> list[float]:
    """The median ms of each of ``runs``, timed in turns (so drift hits them alike)."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeat):
        for run, spent in zip(runs, times):
            started = time.perf_counter()
            await run()
            spent.append((time.perf_counter() - started) * 1000)
    return [statistics.median(spent) for spent in times]


async def _throughput(tier: RemoteTier, total_bytes: int, repeat: int) -> list[dict[str, Any]]:
    link = tier._link
    num = max(1, total_bytes // PAGE_BYTES)
    per_pipeline = max(1, tier._config.pipeline_bytes // PAGE_BYTES)
    ttl_ms = int(tier._config.ttl_s * 1000)
    rows = []
    tier_put: list[float] = []
    tier_get: list[float] = []
    raw_put: list[float] = []
    raw_get: list[float] = []
    for r in range(repeat):
        tenant = f"bench{r}"
        pages = _pages(num, PAGE_BYTES - 200, tenant)
        nbytes = sum(len(p) for _, p in pages)
        names = [f"rawbench:{r}:{m.key.hex()}" for m, _ in pages]

        sets = [functools.partial(_queue_set, names[i], pages[i][1], ttl_ms) for i in range(num)]
        gets = [functools.partial(_queue_get, names[i]) for i in range(num)]
        raw_set = functools.partial(_raw, is_cluster=link.is_cluster, commands=sets,
                                    per_pipeline=per_pipeline)
        raw_read = functools.partial(_raw, is_cluster=link.is_cluster, commands=gets,
                                     per_pipeline=per_pipeline)
        puts = (functools.partial(_timed, raw_put, nbytes, link.call("bench", raw_set, 600)),
                functools.partial(_timed, tier_put, nbytes, _write_all(tier, pages)))
        # Which goes first alternates: the second writer meets a server that has grown.
        for put in puts if r % 2 == 0 else puts[::-1]:
            await put()
        started = time.perf_counter()
        await link.call("bench", raw_read, 600)
        raw_get.append(nbytes / (time.perf_counter() - started) / 1e9)
        started = time.perf_counter()
        got = await tier.read_many([m.key for m, _ in pages], tenant, NAMESPACE)
        tier_get.append(nbytes / (time.perf_counter() - started) / 1e9)
        if any(p is None for p in got):
            raise KVStoreError("bench: pages written were not read back")
        del got
        for meta, _ in pages:
            await tier.delete(meta.key)
        await link.call("bench", lambda c, n=names: _delete_all(c, n, link.is_cluster), 600)
    for op, mine, raw in (("put 2 MiB pages", tier_put, raw_put),
                          ("get 2 MiB pages (verified)", tier_get, raw_get)):
        best, best_raw = max(mine), max(raw)
        rows.append({"op": op, "kvstore": best, "raw": best_raw, "ratio": best / best_raw,
                     "unit": "GB/s"})
    return rows


async def _timed(rates: list[float], nbytes: int, work: Awaitable[Any]) -> None:
    started = time.perf_counter()
    await work
    rates.append(nbytes / (time.perf_counter() - started) / 1e9)


async def _write_all(tier: RemoteTier, pages: list[tuple[PageMeta, bytes]]) -> None:
    if not all(await tier.write_many(pages)):
        raise KVStoreError("bench: the remote tier refused pages (raise its capacity)")


def _queue_set(name: str, page: bytes, ttl_ms: int, pipe: Any) -> None:
    pipe.set(name, page, px=ttl_ms, nx=True)


def _queue_get(name: str, pipe: Any) -> None:
    pipe.get(name)


def _queue_exists(name: str, pipe: Any) -> None:
    pipe.exists(name)


async def _raw(client: Any, is_cluster: bool, commands: list[Callable[[Any], None]],
               per_pipeline: int) -> list[Any]:
    """The commands in pipelines of ``per_pipeline``, straight on the client."""
    results = []
    for start in range(0, len(commands), per_pipeline):
        async with client.pipeline() if is_cluster else client.pipeline(transaction=False) \
                as pipe:
            for queue in commands[start:start + per_pipeline]:
                queue(pipe)
            results += await pipe.execute()
    return results


async def _delete_all(client: Any, names: list[str], is_cluster: bool) -> None:
    async with client.pipeline() if is_cluster else client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.delete(name)
        await pipe.execute()


async def _probes(tier: RemoteTier, repeat: int) -> list[dict[str, Any]]:
    link = tier._link
    rows = []
    for tokens in PROBE_TOKENS:
        num = tokens // BLOCK_TOKENS
        pages = _pages(num, 256, "probe")  # small pages: a probe never reads values
        await tier.write_many(pages)
        keys = [m.key for m, _ in pages]
        names = [tier.page_key(k, "probe") for k in keys]

        raw_exists = functools.partial(
            _raw, is_cluster=link.is_cluster, per_pipeline=len(names),
            commands=[functools.partial(_queue_exists, n) for n in names])
        assert await tier.exists_prefix(keys, "probe") == num
        mine, raw = await _median_ms(repeat,
                                     functools.partial(tier.exists_prefix, keys, "probe"),
                                     functools.partial(link.call, "bench", raw_exists, 60))
        rows.append({"op": f"prefix probe, {tokens // 1024}k tokens ({num} keys)",
                     "kvstore": mine, "raw": raw, "ratio": mine / raw, "unit": "ms (median)"})
        for meta, _ in pages:
            await tier.delete(meta.key)
    return rows


def _decision(get_gbps: float, probe_ms: float, prefill_tokens_per_s: float) -> str:
    tokens = PROBE_TOKENS[-1]
    fetch_ms = probe_ms + tokens // BLOCK_TOKENS * PAGE_BYTES / (get_gbps * 1e9) * 1000
    recompute_ms = tokens / prefill_tokens_per_s * 1000
    choice = "fetch from the shared tier" if fetch_ms < recompute_ms else "recompute"
    return (f"cost model, {tokens // 1024}k-token prefix ({tokens // BLOCK_TOKENS} x 2 MiB): "
            f"fetch {fetch_ms:.0f} ms at the measured get rate vs recompute {recompute_ms:.0f} "
            f"ms at {prefill_tokens_per_s:.0f} prefill tokens/s -> {choice}")


class _LocalServer:
    """A throwaway redis-server on a free loopback port."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise KVStoreError("bench remote: no --url and no redis-server binary to start "
                               "(apt-get install redis-server)")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="kvstore-bench-redis-")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


async def _run(url: str, total_bytes: int, repeat: int, probe_repeat: int,
               prefill_tokens_per_s: float) -> BenchReport:
    config = RemoteConfig(url=url, key_prefix=f"bench{secrets.token_hex(3)}",
                          capacity_bytes=max(4 * total_bytes, 1 << 30), timeout_s=5.0,
                          directory=False)
    tier = RemoteTier(config)
    for _ in range(100):  # a server just started may need a moment
        await tier.open()
        if tier.health() == "":
            break
        await tier.close()
        tier = RemoteTier(config)
        await asyncio.sleep(0.05)
    try:
        rows = await _throughput(tier, total_bytes, repeat)
        rows += await _probes(tier, probe_repeat)
        kind = "cluster" if tier._link.is_cluster else "standalone"
    finally:
        await tier.close()
    notes = ((f"{config.safe_url} ({kind}); the same client, pipelines of "
              f"{config.pipeline_bytes >> 20} MiB; best of {repeat} passes for GB/s"),
             _decision(rows[1]["kvstore"], rows[-1]["kvstore"], prefill_tokens_per_s))
    return BenchReport(name="remote", title="remote tier vs raw redis-py", columns=COLUMNS,
                       rows=tuple(rows), notes=notes,
                       params={"url": config.safe_url, "total_bytes": total_bytes,
                               "repeat": repeat, "probe_repeat": probe_repeat,
                               "prefill_tokens_per_s": prefill_tokens_per_s, "mode": kind})


def run_remote_bench(url: str | None = None, total_bytes: int = 256 << 20, repeat: int = 3,
                     probe_repeat: int = 50, prefill_tokens_per_s: float = 20000.0
                     ) -> BenchReport:
    """Run the benchmark against ``url`` (or a throwaway local redis-server)."""
    server = _LocalServer() if url is None else None
    try:
        return asyncio.run(_run(url or server.url, total_bytes, repeat, probe_repeat,
                                prefill_tokens_per_s))
    finally:
        if server is not None:
            server.stop()
