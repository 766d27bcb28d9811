"""The injected retry policy: backoff on UNAVAILABLE only."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from kvstore.client import NO_RETRY, AsyncClient, Client, RetryPolicy
from kvstore.errors import InvalidArgument, LeaseNotFound, Unavailable
from tests.server.helpers import DaemonThread


@dataclasses.dataclass(frozen=True)
class CountingRetry(RetryPolicy):
    """Records each backoff it hands out (and sleeps a tenth of it, to keep tests fast)."""

    handed_out: list = dataclasses.field(default_factory=list)

    def delays(self):
        for delay in super().delays():
            self.handed_out.append(delay)
            yield delay / 10


def test_backoff_grows_and_is_bounded():
    policy = RetryPolicy(max_attempts=6, initial_backoff_s=0.1, max_backoff_s=0.5,
                         multiplier=2.0, jitter=0.0)
    assert list(policy.delays()) == [0.1, 0.2, 0.4, 0.5, 0.5]
    jittered = list(RetryPolicy(max_attempts=50, initial_backoff_s=1, max_backoff_s=1,
                                jitter=0.2).delays())
    assert all(0.8 <= d <= 1.2 for d in jittered) and len(set(jittered)) > 1
    assert list(NO_RETRY.delays()) == []


@pytest.mark.parametrize("fields", [{"max_attempts": 0}, {"multiplier": 0.5},
                                    {"jitter": 1.0}, {"initial_backoff_s": -1}])
def test_policy_validation(fields):
    with pytest.raises(InvalidArgument):
        RetryPolicy(**fields)


def test_unreachable_daemon_is_retried_then_unavailable(root):
    policy = CountingRetry(max_attempts=4, initial_backoff_s=0.05)
    with Client(f"unix://{root}/nobody.sock", retry=policy, timeout_s=2) as client, \
            pytest.raises(Unavailable):
        client.health()
    assert len(policy.handed_out) == 3
    with Client(f"unix://{root}/nobody.sock", retry=NO_RETRY) as client, \
            pytest.raises(Unavailable):
        client.health()


async def test_async_unreachable_daemon_is_unavailable(root):
    policy = CountingRetry(max_attempts=3, initial_backoff_s=0.05)
    async with AsyncClient(f"unix://{root}/nobody.sock", retry=policy, timeout_s=2) as client:
        with pytest.raises(Unavailable):
            await client.stats()
    assert len(policy.handed_out) == 2


def test_answers_other_than_unavailable_are_not_retried(config):
    policy = CountingRetry(max_attempts=5)
    with DaemonThread(config) as daemon, Client(daemon.unix_address, retry=policy) as client:
        with pytest.raises(LeaseNotFound):
            client.release("no-such-lease")
        with pytest.raises(InvalidArgument):
            client.list_blocks(tier="tape")
    assert policy.handed_out == []


def test_a_daemon_that_starts_late_is_reached(config):
    """The client's first calls find no socket; backoff carries it until the daemon is up."""
    policy = RetryPolicy(max_attempts=40, initial_backoff_s=0.05, max_backoff_s=0.2)
    starter = DaemonThread(config)
    timer = threading.Timer(0.5, starter.__enter__)
    timer.start()
    try:
        with Client(f"unix://{config.server.socket_path}", retry=policy) as client:
            started = time.monotonic()
            assert client.health().status == "SERVING"
            assert time.monotonic() - started >= 0.3
    finally:
        timer.join()
        starter.__exit__(None, None, None)
