"""48 clients of two tenants for a minute against a daemon subprocess: puts, gets, lookups,
hints, acquire-release and zero-copy reserve-commit mixed, over TCP and the Unix socket.

Asserted: no call fails, every byte a get returns is the byte put for that tenant and prefix
(both tenants use the same token ids with different K/V, so a leak between them shows too),
and DRAM never holds more than its capacity at any Stats sample. Throughput and latency are
printed, not asserted.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from functools import cache

import torch

from kvstore.client import NO_RETRY, AsyncClient
from kvstore.keys import Namespace

from ..conftest import random_kv, random_tokens
from .helpers import DaemonProcess, small_config

NUM_CLIENTS = 48  # per tenant: 12 over TCP (streamed), 12 on the Unix socket (zero-copy)
DURATION_S = 60.0
TENANTS = {"acme": "tok-acme", "zeta": "tok-zeta"}
NUM_PROMPTS = 4096  # per tenant, shared by its clients
NUM_PREFIXES = 16  # prompts share one of these 32-token prefixes
HALF = 32  # tokens in a prefix and in a prompt's own suffix
STATS_EVERY_S = 0.2


class Corpus:
    """Prompt p of tenant t: prefix p % NUM_PREFIXES then its own suffix, the same token ids
    for both tenants, K/V determined by (tenant, prefix) and (tenant, prompt)."""

    def __init__(self, spec) -> None:
        self.spec = spec

    @cache  # noqa: B019 - one corpus per test; the cache is the point
    def tokens(self, p: int) -> list[int]:
        return (random_tokens(HALF, seed=10_000 + p % NUM_PREFIXES)
                + random_tokens(HALF, seed=100_000 + p))

    @cache  # noqa: B019
    def kv(self, tenant: int, p: int) -> torch.Tensor:
        prefix = random_kv(self.spec, HALF, seed=tenant * 1_000_000 + p % NUM_PREFIXES)
        suffix = random_kv(self.spec, HALF, seed=tenant * 1_000_000 + 1_000 + p)
        return torch.cat([prefix, suffix], dim=2)


class Tally:
    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self.bytes_checked = 0
        self.stored: dict[int, set[int]] = {0: set(), 1: set()}
        self.dram_samples: list[tuple[int, int]] = []  # (used_bytes, capacity_bytes)


async def _client_loop(client: AsyncClient, zero_copy: bool, tenant: int, ns: Namespace,
                       corpus: Corpus, tally: Tally, seed: int, stop_at: float) -> None:
    rng = random.Random(seed)
    stored = tally.stored[tenant]
    while time.monotonic() < stop_at:
        op = rng.choices(["put", "get", "lookup", "lease" if zero_copy else "hint"],
                         [3, 3, 2, 2])[0] if stored else "put"
        p = rng.randrange(NUM_PROMPTS) if op == "put" else rng.choice(tuple(stored))
        tokens, kv = corpus.tokens(p), corpus.kv(tenant, p)
        try:
            if op == "put":
                await client.put(ns, tokens, kv, zero_copy=zero_copy)
                stored.add(p)
            elif op == "get":
                got = await client.get(ns, tokens, zero_copy=zero_copy)
                if got is not None:
                    n = got.shape[2]
                    tally.bytes_checked += got.numel() * got.element_size()
                    if n % ns.spec.block_tokens or not torch.equal(got, kv[:, :, :n]):
                        tally.wrong.append(f"tenant {tenant} prompt {p}: {n} tokens differ")
            elif op == "lookup":
                result = await client.lookup(ns, tokens)
                if result.matched_tokens != len(result.keys) * ns.spec.block_tokens:
                    tally.errors.append(f"lookup: {result}")
            elif op == "lease":
                lease = await client.acquire(ns, tokens)
                await client.release(lease.lease_id)
            else:
                await client.hint(ns, tokens, deadline_s=0.5)
        except Exception as exc:  # noqa: BLE001 - every failure is counted, none expected
            tally.errors.append(f"{op} ({'unix' if zero_copy else 'tcp'}): {exc!r}")
        tally.ops[op if op not in ("put", "get") or not zero_copy else f"zero-copy {op}"] += 1


async def _sample_stats(address: str, tally: Tally, stop_at: float) -> None:
    async with AsyncClient(address, token="tok-admin", retry=NO_RETRY) as admin:
        while time.monotonic() < stop_at:
            dram = (await admin.stats()).tiers["dram"]
            tally.dram_samples.append((dram.used_bytes, dram.capacity_bytes))
            await asyncio.sleep(STATS_EVERY_S)


def test_48_clients_two_tenants_mixed_for_a_minute(root, spec, capsys):
    config = small_config(root, dram_bytes=32 << 20, ssd={"capacity_bytes": 256 << 20},
                          tcp_address="127.0.0.1:0", tenant_tokens=TENANTS,
                          admin_token="tok-admin", log_level="INFO")
    proc = DaemonProcess(config, root)
    corpus, tally = Corpus(spec), Tally()
    try:
        proc.wait_ready()
        tcp, unix = proc.tcp_address(), proc.address

        async def run() -> float:
            clients = []
            for t, (tenant, token) in enumerate(TENANTS.items()):
                for i in range(NUM_CLIENTS // 2):
                    zero_copy = i % 2 == 1
                    clients.append((AsyncClient(unix if zero_copy else tcp, token=token,
                                                retry=NO_RETRY, timeout_s=30),
                                    zero_copy, t, Namespace("load/mixed", spec, tenant=tenant)))
            started = time.monotonic()
            stop_at = started + DURATION_S
            try:
                await asyncio.gather(_sample_stats(tcp, tally, stop_at), *(
                    _client_loop(c, z, t, ns, corpus, tally, seed=i, stop_at=stop_at)
                    for i, (c, z, t, ns) in enumerate(clients)))
            finally:
                for client, *_ in clients:
                    await client.aclose()
            return time.monotonic() - started

        elapsed_s = asyncio.run(run())
        assert proc.terminate() == 0
    finally:
        proc.kill()
    max_used = max(used for used, _ in tally.dram_samples)
    capacity = tally.dram_samples[0][1]
    with capsys.disabled():
        print(f"\n{NUM_CLIENTS} clients x {elapsed_s:.0f} s, 2 tenants: "
              f"{sum(tally.ops.values())} requests {dict(tally.ops)}; errors "
              f"{len(tally.errors)}, wrong gets {len(tally.wrong)} "
              f"({tally.bytes_checked >> 20} MiB compared); DRAM max used "
              f"{max_used} of {capacity} bytes over {len(tally.dram_samples)} samples")
    assert not tally.errors, tally.errors[:5]
    assert not tally.wrong, tally.wrong[:5]
    assert all(used <= cap for used, cap in tally.dram_samples), max_used
    assert len(tally.dram_samples) >= 10
    assert all(tally.ops[op] for op in ("zero-copy put", "zero-copy get", "put", "get",
                                        "lookup", "lease", "hint")), tally.ops
