"""32 concurrent clients, mixed put/lookup/get over TCP loopback for a few seconds: no errors.
Latency percentiles are printed, not asserted."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict

import numpy as np
import torch

from kvstore.client import NO_RETRY, AsyncClient

from ..conftest import random_kv, random_tokens
from .helpers import DaemonProcess, small_config

NUM_CLIENTS = 32
DURATION_S = 3.0
PROMPT_TOKENS = 64


async def _worker(address: str, seed: int, ns, spec, latencies, errors, stop_at: float):
    rng = random.Random(seed)
    stored: list[tuple[list[int], torch.Tensor]] = []
    async with AsyncClient(address, token="tok-load", retry=NO_RETRY, timeout_s=30) as client:
        while time.monotonic() < stop_at:
            op = "put" if not stored or rng.random() < 0.3 else rng.choice(["lookup", "get"])
            start = time.perf_counter()
            try:
                if op == "put":
                    tokens = random_tokens(PROMPT_TOKENS, seed=seed * 100_000 + len(stored))
                    kv = random_kv(spec, PROMPT_TOKENS, seed=len(stored))
                    await client.put(ns, tokens, kv)
                    stored.append((tokens, kv))
                elif op == "lookup":
                    tokens, _ = rng.choice(stored)
                    result = await client.lookup(ns, tokens)
                    if result.matched_tokens != PROMPT_TOKENS:
                        errors.append(f"lookup matched {result.matched_tokens}")
                else:
                    tokens, kv = rng.choice(stored)
                    got = await client.get(ns, tokens)
                    if got is None or not torch.equal(got, kv):
                        errors.append("get returned different K/V")
            except Exception as exc:  # noqa: BLE001 - every failure is counted, none expected
                errors.append(f"{op}: {exc!r}")
            latencies[op].append(time.perf_counter() - start)


def test_concurrent_clients_mixed_load(root, ns, spec, capsys):
    config = small_config(root, dram_bytes=64 << 20, tcp_address="127.0.0.1:0",
                          tenant_tokens={"acme": "tok-load"}, log_level="INFO")
    proc = DaemonProcess(config, root)
    try:
        proc.wait_ready()
        address = proc.tcp_address()
        latencies: dict[str, list[float]] = defaultdict(list)
        errors: list[str] = []

        async def run() -> None:
            stop_at = time.monotonic() + DURATION_S
            await asyncio.gather(*(_worker(address, i, ns, spec, latencies, errors, stop_at)
                                   for i in range(NUM_CLIENTS)))

        asyncio.run(run())
        assert proc.terminate() == 0
    finally:
        proc.kill()
    assert not errors, errors[:5]
    assert all(latencies[op] for op in ("put", "lookup", "get"))
    with capsys.disabled():
        print(f"\n{NUM_CLIENTS} clients, {DURATION_S:.0f} s over TCP loopback "
              f"(block {spec.block_bytes} B, {PROMPT_TOKENS}-token prompts)")
        for op, values in sorted(latencies.items()):
            p50, p90, p99 = np.percentile(np.array(values) * 1e3, [50, 90, 99])
            print(f"  {op:6s} n={len(values):5d}  p50 {p50:6.2f} ms  p90 {p90:6.2f} ms  "
                  f"p99 {p99:6.2f} ms  ({len(values) / DURATION_S:.0f}/s)")
