"""Retries of failed calls: an injected backoff policy for transport failures (UNAVAILABLE)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

from kvstore.errors import InvalidArgument
from kvstore.rpc.status import translate

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, applied to UNAVAILABLE only (every other status is an
    answer, not a transport failure). ``max_attempts=1`` disables retries."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2  # each delay is scaled by a random factor in [1 - jitter, 1 + jitter]

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidArgument(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise InvalidArgument("RetryPolicy backoffs must be >= 0 and multiplier >= 1")
        if not 0 <= self.jitter < 1:
            raise InvalidArgument(f"RetryPolicy.jitter must be in [0, 1), got {self.jitter}")

    def should_retry(self, code: grpc.StatusCode | None) -> bool:
        return code == grpc.StatusCode.UNAVAILABLE

    def delays(self) -> Iterator[float]:
        """The sleep before each retry (``max_attempts - 1`` of them)."""
        delay = self.initial_backoff_s
        for _ in range(self.max_attempts - 1):
            yield min(delay, self.max_backoff_s) * random.uniform(1 - self.jitter, 1 + self.jitter)
            delay *= self.multiplier


NO_RETRY = RetryPolicy(max_attempts=1)


def rpc_code(err: grpc.RpcError) -> grpc.StatusCode | None:
    return err.code() if hasattr(err, "code") else None


def next_delay(policy: RetryPolicy, delays: Iterator[float], err: grpc.RpcError) -> float:
    """The sleep before retrying a call that failed with ``err``.

    Args:
        policy: the client's retry policy.
        delays: the call's own ``policy.delays()``, shared by all its attempts.
        err: what the last attempt raised.

    Raises:
        KVStoreError: the kvstore exception for ``err`` when it is not retried (another status,
            or the attempts are spent).
    """
    delay = next(delays, None) if policy.should_retry(rpc_code(err)) else None
    if delay is None:
        raise translate(err) from None
    return delay


def retrying(policy: RetryPolicy, attempt: Callable[[], T]) -> T:
    """``attempt()``, made again after ``next_delay`` while it fails with a retried status."""
    delays = policy.delays()
    while True:
        try:
            return attempt()
        except grpc.RpcError as err:
            time.sleep(next_delay(policy, delays, err))


async def retrying_async(policy: RetryPolicy, attempt: Callable[[], Awaitable[T]]) -> T:
    """The asyncio twin of :func:`retrying`."""
    delays = policy.delays()
    while True:
        try:
            return await attempt()
        except grpc.RpcError as err:
            await asyncio.sleep(next_delay(policy, delays, err))
