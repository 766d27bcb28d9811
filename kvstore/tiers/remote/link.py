"""One connection to a Redis or Valkey server or cluster, with bounded calls, retries and a
circuit breaker, shared by the remote tier's pages and its directory.

Every call goes through ``RedisLink.call``: it waits at most ``timeout_s`` per attempt, retries
connection errors and timeouts with exponential backoff (a redis-py ``Retry`` object), and
answers None instead of raising when the store is unreachable, so a caller turns that into a
miss or a refused write. A failed password is different: it will not heal by itself, so it is
raised at ``open`` as a ConfigError naming the field.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError

from kvstore.config import RemoteConfig
from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.tiers.remote")

T = TypeVar("T")
Client = aioredis.Redis | RedisCluster
# What a call survives by retrying: lost connections and timeouts (redis-py's, asyncio's, the
# socket's). Anything else (a wrong password, a bad command) is not retried.
_RETRYABLE = (RedisError, RedisClusterException, OSError, TimeoutError)
_TAG_PERSON = b"kvstore.tenant"


@functools.lru_cache(maxsize=4096)
def tenant_tag(tenant: str) -> str:
    """The 16 hex digits that scope ``tenant``'s keys in the shared store."""
    return hashlib.blake2b(tenant.encode(), digest_size=8, person=_TAG_PERSON).hexdigest()


class Breaker:
    """Opens after ``failures`` failed calls in a row; while open, calls are refused at once.
    After ``reset_s`` one trial call is let through (half-open): success closes it, failure
    opens it for another ``reset_s``."""

    def __init__(self, failures: int, reset_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = failures
        self._reset_s = reset_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial = False

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def allows(self) -> bool:
        """Whether a call may go out now (closed, or the one trial call of a half-open breaker)."""
        if self._opened_at is None:
            return True
        if self._trial or self._clock() - self._opened_at < self._reset_s:
            return False
        self._trial = True
        return True

    def succeeded(self) -> None:
        self._failures, self._opened_at, self._trial = 0, None, False

    def failed(self) -> None:
        self._failures += 1
        self._trial = False
        if self._opened_at is not None or self._failures >= self._limit:
            self._opened_at = self._clock()


def _client_options(config: RemoteConfig) -> dict[str, Any]:
    # The client itself never retries: RedisLink does, inside its own time bound.
    return {"socket_timeout": config.timeout_s, "socket_connect_timeout": config.timeout_s,
            "retry": Retry(NoBackoff(), 0), "max_connections": config.max_connections,
            "health_check_interval": 0}


class RedisLink:
    """A pooled client (standalone or cluster) behind a time bound, retries and a breaker.

    Args:
        config: the remote tier's settings (url, mode, timeouts, retries, breaker).
    """

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.is_cluster = config.mode == "cluster"
        self._client: Client | None = None
        self._connecting: asyncio.Lock | None = None
        # Calls in flight, at most one per pooled connection (a cluster node's pool raises
        # rather than waits when it runs out): the rest queue here, outside the time bound.
        self._slots: asyncio.Semaphore | None = None
        self._breaker = Breaker(config.breaker_failures, config.breaker_reset_s)
        self._retry = Retry(ExponentialBackoff(cap=config.backoff_cap_s,
                                               base=config.backoff_base_s),
                            config.retries, supported_errors=_RETRYABLE)
        self.last_error = ""  # what the last failed call said; "" once a call succeeds
        self.counts = {"errors": 0, "timeouts": 0, "short_circuits": 0, "calls": 0}

    # ------------------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Connect and check the credentials. An unreachable store is not an error (calls miss
        until it answers); a refused password is (ConfigError)."""
        self._connecting = asyncio.Lock()
        self._slots = asyncio.Semaphore(self.config.max_connections)
        if await self.call("connect", lambda client: client.ping()) is None:
            log.warning("remote store %s unreachable at start (%s); serving from local tiers "
                        "until it answers", self.config.safe_url, self.last_error)

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    @property
    def is_available(self) -> bool:
        """Whether the last call reached the store (and the breaker is closed)."""
        return not self._breaker.is_open and not self.last_error

    @property
    def breaker_open(self) -> bool:
        return self._breaker.is_open

    # ------------------------------------------------------------------------------ calls

    async def call(self, what: str, op: Callable[[Client], Awaitable[T]],
                   timeout_s: float | None = None) -> T | None:
        """``op(client)`` within the time bound, retried; None if the store cannot answer.

        Raises ConfigError if the store refuses the credentials in ``url``.
        """
        self.counts["calls"] += 1
        if not self._breaker.allows():
            self.counts["short_circuits"] += 1
            return None
        bound = timeout_s or self.config.timeout_s

        async def attempt() -> T:
            async with asyncio.timeout(bound):
                return await op(await self._connected())

        assert self._slots is not None, "RedisLink.open() first"
        try:
            async with self._slots:
                result = await self._retry.call_with_retry(attempt, self._on_retry,
                                                           is_retryable=_is_retryable)
        except AuthenticationError as exc:
            self._failed(what, exc)
            raise ConfigError(f"remote.url: {self.config.safe_url} refused the credentials "
                              f"({exc}); check the user and password in remote.url") from None
        except _RETRYABLE as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # redis-py turns a cancellation inside a read into a connection error: keep
                # the cancellation, or the cancelled caller would carry on as if it were not.
                raise asyncio.CancelledError from exc
            self._failed(what, exc)
            return None
        if self.last_error or self._breaker.is_open:
            log.info("remote store %s answers again", self.config.safe_url)
        self._breaker.succeeded()
        self.last_error = ""
        return result

    async def pipeline(self, what: str, commands: Sequence[Callable[[Any], Any]],
                       timeout_s: float | None = None) -> list[Any] | None:
        """Run ``commands`` (each queues one command on a pipeline) in one pipeline: per
        command its result or the exception it raised; None if nothing could be sent. A
        cluster pipeline sends each node its commands in one round trip, all nodes at once."""

        async def run(client: Client) -> list[Any]:
            pipe = client.pipeline() if self.is_cluster else client.pipeline(transaction=False)
            async with pipe:
                for queue in commands:
                    queue(pipe)
                results = await pipe.execute(raise_on_error=False)
            if results and all(isinstance(r, Exception) for r in results):
                raise results[0]  # nothing reached the store: retry (or fail) the whole batch
            return results

        return await self.call(what, run, timeout_s)

    # ------------------------------------------------------------------------------ internals

    async def _connected(self) -> Client:
        if self._client is not None:
            return self._client
        assert self._connecting is not None, "RedisLink.open() first"
        async with self._connecting:
            if self._client is None:
                self._client = await self._connect()
            return self._client

    async def _connect(self) -> Client:
        """A standalone client, or a cluster client when the server says it is one."""
        options = _client_options(self.config)
        if self.config.mode == "cluster":
            return RedisCluster.from_url(self.config.url, **options)
        client = aioredis.from_url(self.config.url, **options)
        if self.config.mode == "auto":
            try:
                info = await client.info("cluster")
            except BaseException:
                await client.aclose()
                raise
            if info.get("cluster_enabled"):
                await client.aclose()
                self.is_cluster = True
                return RedisCluster.from_url(self.config.url, **options)
        return client

    async def _on_retry(self, error: BaseException) -> None:
        if isinstance(error, TimeoutError):
            self.counts["timeouts"] += 1

    def _failed(self, what: str, exc: BaseException) -> None:
        self.counts["errors"] += 1
        if isinstance(exc, TimeoutError):
            self.counts["timeouts"] += 1
        was_available = self.is_available
        self._breaker.failed()
        detail = str(exc) or type(exc).__name__
        self.last_error = f"{what}: {type(exc).__name__}: {detail}"[:300]
        if was_available:
            log.warning("remote store %s failed: %s", self.config.safe_url, self.last_error)


def _is_retryable(error: BaseException) -> bool:
    return not isinstance(error, AuthenticationError)


def result_ok(result: Any) -> bool:
    """Whether one pipelined command's result is an answer (not the error it met)."""
    return not isinstance(result, BaseException)
