"""What the RPC bench's measurements share: block shapes, message limits, timers and the
plain-Python lookup floor."""

from __future__ import annotations

import array
import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import numpy as np

from kvstore.spec import KVSpec

MiB = 1 << 20
T = TypeVar("T")
# 32 layers x 8 kv heads x 128 head dim x 16 tokens x K,V x bf16 = 2 MiB per block (a 7-8B model)
BLOCK_SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)
# Lookup cost depends on the number of blocks, not their size: tiny blocks keep setup cheap.
LOOKUP_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=16)
PROMPT_BLOCKS = 16  # blocks per put/get call (32 MiB)
LOOKUP_PREFIXES = (8192, 32768)
MAX_MESSAGE_BYTES = 256 * MiB
BENCH_TOKEN = "kvstore-bench-admin"  # the daemon's TCP port is never served without a token


def latencies_ms(call: Callable[[], object], repeats: int) -> np.ndarray:
    """Milliseconds of each of ``repeats`` calls, after up to ten untimed ones."""
    for _ in range(min(10, repeats)):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return np.array(times) * 1e3


def each(prompts: Iterable[T], get: Callable[[T], object]) -> None:
    """``get(prompt)`` for each prompt, each result dropped before the next get: a caller
    holds one prompt's K/V at a time, as Redis's side holds one pipeline's values. (Keeping a
    pass's results, 1 GiB, made every get write memory the process never had: on the 2-core
    box, a VM, that first touch cost 80 ms per 32 MiB against 5 ms, 2026-12-01.)"""
    for prompt in prompts:
        get(prompt)


def seconds_of(call: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start



def python_lookup_floor(fingerprint: bytes, tokens: list[int], index: dict[bytes, None],
                        block_tokens: int, record: bool = False) -> int:
    """A lookup in plain Python, the floor Lookup is measured against: the tokens as uint32
    bytes, a loop of chained blake2b-128 over their blocks, a dict probe per key (stopping at
    the first miss). Returns the blocks matched; ``record`` adds every key to ``index``."""
    data = array.array("I", tokens).tobytes()
    step = 4 * block_tokens
    parent, matched = fingerprint, 0
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.blake2b(parent + data[start:start + step], digest_size=16).digest()
        if record:
            index[parent] = None
        elif parent not in index:
            break
        matched += 1
    return matched



async def calls_per_second(call: Callable[[], Awaitable[object]], seconds: float,
                           concurrency: int) -> float:
    """Calls per second of ``call`` over ``seconds``, ``concurrency`` of them in flight."""
    done = 0
    stop_at = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await call()
            done += 1

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.monotonic() - start)

