"""What one tenant's heavy calls cost the others: the loop's longest stall in a Lookup of
262,144 stored blocks (in the store, and asked by a client over a call channel, with the 4 MB
request and reply), Health and a small Lookup of a second tenant while a first floods 1M-token
Lookups on many call channels, and SSD reads for 50 hints of one prefix.

From the repository root: ``PYTHONPATH=. python bench/fairness.py [stall|rpc|flood|hints]``
(all four by default); one JSON line each. The flood's tenants run in processes of their own, so their CPU
is not the daemon's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Self

import numpy as np

from kvstore.client import NO_RETRY, AsyncClient
from kvstore.config import DramConfig, KVStoreConfig, QuotaConfig, ServerConfig, SsdConfig
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from kvstore.store import Store

MiB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[1]
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=4)  # 1M tokens: 262,144 blocks
FLOOD_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16)
TOKENS = {"a": "tok-a", "b": "tok-b"}


def _child_env() -> dict[str, str]:
    """The environment of a client process: this checkout first on its path."""
    path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path}


class LoopProbe:
    """A coroutine on the loop that wakes every millisecond and keeps the longest gap: in wall
    time (``longest_s``), and in the loop thread's own CPU time (``longest_cpu_s``: what the
    loop ran between two wakes, without the time a busy host kept the thread waiting)."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self.longest_cpu_s = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last, last_cpu = loop.time(), time.thread_time()
        while True:
            await asyncio.sleep(0.001)
            now, cpu = loop.time(), time.thread_time()
            self.longest_s = max(self.longest_s, now - last - 0.001)
            self.longest_cpu_s = max(self.longest_cpu_s, cpu - last_cpu)
            last, last_cpu = now, cpu

    def __enter__(self) -> Self:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def config(root: Path, ssd: bool = True, **server) -> KVStoreConfig:
    """1.5 GiB of DRAM (262,144 blocks of ``SPEC`` take 1 GiB of 4 KiB pages); without
    ``ssd``, nothing is written behind a put while a lookup is timed."""
    return KVStoreConfig(
        dram=DramConfig(capacity_bytes=1536 * MiB, chunk_bytes=8 * MiB),
        ssd=SsdConfig(path=str(root / "ssd"), capacity_bytes=256 * MiB, segment_bytes=8 * MiB,
                      admit_after_accesses=1, fsync="never", enabled=ssd),
        server=ServerConfig(socket_path=str(root / "run" / "kv.sock"), log_level="WARNING",
                            **server))


async def stall(root: Path) -> dict:
    """A Lookup matching 262,144 stored blocks: the loop's longest stall while it runs."""
    ns = Namespace(model_id="m", spec=SPEC, tenant="a")
    tokens = np.random.default_rng(0).integers(0, 50_000, 1 << 20, dtype=np.uint32)
    import torch
    async with Store(config(root, ssd=False)) as store:
        for end in range(1 << 16, tokens.size + 1, 1 << 16):  # 16 puts of 16k more blocks
            await store.put(ns, tokens[:end], torch.zeros(SPEC.shape(end), dtype=SPEC.torch_dtype))
        result = {}
        for run in range(3):
            with LoopProbe() as probe:
                t0 = time.perf_counter()
                found = await store.lookup(ns, tokens)
                took = time.perf_counter() - t0
                await asyncio.sleep(0.05)  # the touch applied on the next turn
            result.setdefault("stall_ms", []).append(round(probe.longest_s * 1e3, 1))
            result.setdefault("stall_cpu_ms", []).append(round(probe.longest_cpu_s * 1e3, 1))
            result.setdefault("lookup_ms", []).append(round(took * 1e3, 1))
        result["matched_blocks"] = found.matched_tokens // SPEC.block_tokens
    return {"what": "stall", **result}


async def _rpc_client(address: str, runs: int) -> None:
    ns = Namespace(model_id="m", spec=SPEC, tenant="a")
    tokens = np.random.default_rng(0).integers(0, 50_000, 1 << 20, dtype=np.uint32)
    took = []
    async with AsyncClient(address, token=TOKENS["a"], retry=NO_RETRY) as client:
        await client.lookup(ns, tokens[:SPEC.block_tokens])  # the channel is open
        for _ in range(runs):
            t0 = time.perf_counter()
            found = await client.lookup(ns, tokens)
            took.append(round((time.perf_counter() - t0) * 1e3, 1))
            print(json.dumps({"took_ms": took[-1],
                              "matched_blocks": found.matched_tokens // SPEC.block_tokens}),
                  flush=True)
            await asyncio.sleep(0.5)  # the probe reports between runs


async def rpc(root: Path, runs: int = 3) -> dict:
    """The Lookup of ``stall``, asked by a client (its own process) over a call channel: the
    daemon's loop also parses the 4 MB request and builds and sends the 4 MB reply."""
    import torch

    from kvstore.server.daemon import serve
    ns = Namespace(model_id="m", spec=SPEC, tenant="a")
    tokens = np.random.default_rng(0).integers(0, 50_000, 1 << 20, dtype=np.uint32)
    # tenant a may fill all of DRAM (two tenants would get half each by default)
    daemon = await serve(dataclasses.replace(config(root, ssd=False, tenant_tokens=TOKENS),
                                             quota=QuotaConfig(tier_share=1.0)))
    try:
        for end in range(1 << 16, tokens.size + 1, 1 << 16):
            await daemon.store.put(ns, tokens[:end],
                                   torch.zeros(SPEC.shape(end), dtype=SPEC.torch_dtype))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "_rpc", daemon.unix_address, str(runs), "0",
            stdout=subprocess.PIPE, env=_child_env())
        result: dict = {}
        for _ in range(runs):  # a probe for each run, and the touch applied after its reply
            with LoopProbe() as probe:
                run = json.loads(await proc.stdout.readline())
                await asyncio.sleep(0.3)
            result.setdefault("stall_ms", []).append(round(probe.longest_s * 1e3, 1))
            result.setdefault("stall_cpu_ms", []).append(round(probe.longest_cpu_s * 1e3, 1))
            result.setdefault("lookup_ms", []).append(run["took_ms"])
            result["matched_blocks"] = run["matched_blocks"]
        await proc.wait()
        return {"what": "rpc", **result}
    finally:
        await daemon.stop(1.0)


async def _flood(address: str, seconds: float, channels: int) -> None:
    ns = Namespace(model_id="m", spec=FLOOD_SPEC, tenant="a")
    tokens = np.random.default_rng(1).integers(0, 50_000, 1 << 20, dtype=np.uint32)
    clients = [AsyncClient(address, token=TOKENS["a"], retry=NO_RETRY) for _ in range(channels)]
    deadline = time.monotonic() + seconds
    done = [0, 0]

    async def one(client: AsyncClient) -> None:
        while time.monotonic() < deadline:
            try:
                await client.lookup(ns, tokens)
                done[0] += 1
            except Exception:  # noqa: BLE001 - a rate-limited or refused call is counted
                done[1] += 1
                await asyncio.sleep(0.01)

    await asyncio.gather(*map(one, clients))
    for client in clients:
        await client.aclose()
    print(json.dumps({"a_lookups": done[0], "a_refused": done[1]}))


async def _victim(address: str, seconds: float) -> None:
    ns = Namespace(model_id="m", spec=FLOOD_SPEC, tenant="b")
    tokens = list(range(1024))
    health, lookups = [], []
    async with AsyncClient(address, token=TOKENS["b"], retry=NO_RETRY) as client:
        await client.lookup(ns, tokens)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            await client.health()
            health.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await client.lookup(ns, tokens)
            lookups.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    ms = lambda xs: [round(statistics.median(xs) * 1e3, 2), round(max(xs) * 1e3, 1)]
    print(json.dumps({"health_median_max_ms": ms(health), "b_lookup_median_max_ms": ms(lookups),
                      "b_calls": len(health) + len(lookups)}))


async def flood(root: Path, seconds: float = 10.0, channels: int = 64) -> dict:
    """Tenant a floods 1M-token Lookups on ``channels`` clients; tenant b times Health and a
    1k-token Lookup; the daemon runs here, with a probe on its loop."""
    from kvstore.server.daemon import serve
    daemon = await serve(config(root, tenant_tokens=TOKENS))
    try:
        address = daemon.unix_address
        with LoopProbe() as probe:
            procs = [await asyncio.create_subprocess_exec(
                sys.executable, __file__, role, address, str(seconds), str(channels),
                stdout=subprocess.PIPE, env=_child_env()) for role in ("_flood", "_victim")]
            outs = [json.loads((await p.communicate())[0]) for p in procs]
        return {"what": "flood", "loop_stall_ms": round(probe.longest_s * 1e3, 1),
                "loop_stall_cpu_ms": round(probe.longest_cpu_s * 1e3, 1),
                **outs[0], **outs[1]}
    finally:
        await daemon.stop(1.0)


async def hints(root: Path, num_hints: int = 50, num_blocks: int = 48) -> dict:
    """A prefix on SSD only, then ``num_hints`` hints of it at once: the SSD's reads."""
    import torch
    ns = Namespace(model_id="m", spec=FLOOD_SPEC, tenant="a")
    tokens = list(range(num_blocks * FLOOD_SPEC.block_tokens))
    cfg = config(root)
    async with Store(cfg) as store:
        await store.put(ns, tokens, torch.ones(FLOOD_SPEC.shape(len(tokens)),
                                               dtype=FLOOD_SPEC.torch_dtype))
    async with Store(cfg) as store:  # reopened: the blocks are on SSD only
        before = store.stats().tiers["ssd"].hits
        got = await asyncio.gather(*(store.hint(ns, tokens, 60.0, "wait")
                                     for _ in range(num_hints)))
        reads = store.stats().tiers["ssd"].hits - before
    return {"what": "hints", "num_hints": num_hints, "num_blocks": num_blocks,
            "ssd_reads": reads, "landed_per_hint": sorted(set(got))}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        role, address, seconds, channels = sys.argv[1:5]
        run = {"_flood": lambda: _flood(address, float(seconds), int(channels)),
               "_victim": lambda: _victim(address, float(seconds)),
               "_rpc": lambda: _rpc_client(address, int(seconds))}[role]()
        asyncio.run(run)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="*", default=["stall", "rpc", "flood", "hints"])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    for what in args.what:
        root = Path(tempfile.mkdtemp(prefix="kvf", dir="/tmp"))
        try:
            run = {"stall": partial(stall, root), "rpc": partial(rpc, root),
                   "hints": partial(hints, root),
                   "flood": partial(flood, root, args.seconds)}[what]
            print(json.dumps(asyncio.run(run())), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
