"""What one caller may make the daemon do: calls per second (a token bucket per caller) and
how long a request stream may go without progress.

Both run on the daemon's event loop, before or while a request body is read, so they must stay
cheap: a dict lookup and some arithmetic per call, one timer per message read.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from kvstore.errors import DeadlineExceeded, RateLimited, shown

T = TypeVar("T")

# A stream only counts as making progress once it has brought this many bytes since the last
# time it did (or finished): a trickle of tiny chunks is as idle as silence. 64 KiB is the
# smallest chunk a client is ever told to send (kvstore.rpc.tensors.chunk_limit).
MIN_PROGRESS_BYTES = 64 << 10


class TokenBucket:
    """``burst`` calls at once, refilled at ``rate_per_s``."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, rate_per_s: float, burst: float, now: float) -> None:
        self._rate, self._burst = rate_per_s, burst
        self._tokens, self._stamp = burst, now

    def take(self, now: float) -> float:
        """Spend one call; 0.0 if allowed, else the seconds until one is available."""
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self._rate

    def is_full(self, now: float) -> bool:
        return self._tokens + (now - self._stamp) * self._rate >= self._burst


class RateLimiter:
    """One token bucket per caller identity (a tenant, or a peer host for callers without a
    tenant token). Buckets that have refilled are dropped once there are many, so peers that
    come and go do not grow the table without bound."""

    _PRUNE_AT = 4096

    def __init__(self, rate_per_s: float, burst: int) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s!r}")
        self.rate_per_s = rate_per_s
        self.burst = burst or max(1, math.ceil(rate_per_s))
        self._buckets: dict[str, TokenBucket] = {}

    def check(self, identity: str) -> None:
        """Charge one call to ``identity``; RateLimited (with the wait) if it has none left."""
        now = time.monotonic()
        bucket = self._buckets.get(identity)
        if bucket is None:
            if len(self._buckets) >= self._PRUNE_AT:
                self._buckets = {k: b for k, b in self._buckets.items() if not b.is_full(now)}
            bucket = self._buckets[identity] = TokenBucket(self.rate_per_s, self.burst, now)
        wait_s = bucket.take(now)
        if wait_s:
            wait_s = math.ceil(wait_s * 1000) / 1000  # whole milliseconds, never 0
            raise RateLimited(
                f"rate limit of {self.rate_per_s:g} calls/s (burst {self.burst}) exceeded for "
                f"{shown(identity)} (server.rate_limit_rps); retry in {wait_s:.3f} s",
                retry_after_s=wait_s)


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: ``ipv4:10.0.0.1:5000`` -> ``ipv4:10.0.0.1``,
    ``ipv6:[::1]:5000`` -> ``ipv6:[::1]``; a Unix peer is ``unix:`` whatever its path."""
    if peer.startswith("unix"):
        return "unix:"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() and host not in ("ipv4", "ipv6") else peer


class StreamClock:
    """The deadline by which a request stream must next make progress: ``idle_s`` after it
    last did, where progress is a message that completes a step (``advance``) or enough bytes
    since the last one (``note``), never a trickle of tiny chunks."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._pending_bytes = 0
        self.deadline = self._loop.time() + idle_s

    def advance(self) -> None:
        self._pending_bytes = 0
        self.deadline = self._loop.time() + self.idle_s

    def note(self, num_bytes: int) -> None:
        self._pending_bytes += num_bytes
        if self._pending_bytes >= MIN_PROGRESS_BYTES:
            self.advance()

    async def next(self, stream: AsyncIterator[T], what: str) -> T | None:
        """The stream's next message, None at its end; DeadlineExceeded past the deadline."""
        try:
            return await self.wait(anext(stream), what)
        except StopAsyncIteration:
            return None

    async def wait(self, step: Awaitable[T], what: str) -> T:
        """``step`` (a read of the stream), or DeadlineExceeded once the deadline passes."""
        try:
            async with asyncio.timeout_at(self.deadline):
                return await step
        except TimeoutError:
            raise DeadlineExceeded(
                f"{what}: no progress for {self.idle_s:g} s (server.stream_idle_timeout_s); "
                "the stream was ended") from None
