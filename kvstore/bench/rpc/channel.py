"""The small calls on a call channel against the same calls over gRPC, from two clients of
this process alternating call by call: Lookup latency (beside the plain-Python floor), one
2 MiB block through shared memory, and small-call throughput."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvstore.bench.rpc.common import (
    BLOCK_SPEC,
    LOOKUP_PREFIXES,
    LOOKUP_SPEC,
    MAX_MESSAGE_BYTES,
    calls_per_second,
    python_lookup_floor,
)
from kvstore.client import NO_RETRY, AsyncClient, Client
from kvstore.keys import Namespace

_CHANNEL_SECTION = "call channel against gRPC, alternated call by call"
CHANNEL_ROUNDS = 5  # rounds of the paired channel/gRPC rows; ratios are medians over rounds


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
                rates[path].append(await calls_per_second(
                    lambda client=client: client.lookup(ns, tokens), seconds / rounds,
                    concurrency))
    ratios = [c / g for c, g in zip(rates["channel"], rates["grpc"], strict=True)]
    return [_channel_row(f"small calls (Lookup, 1 block, {concurrency} in flight), channel vs "
                         "gRPC", statistics.median(rates["channel"]),
                         statistics.median(rates["grpc"]), "calls/s", ratios)]


def channel_rows(address: str, repeats: int, small_call_s: float, concurrency: int,
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

