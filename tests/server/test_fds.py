"""The daemon's descriptor budget (server/fds.py) and the share of connections waiting to
authenticate (server/pending.py)."""

from __future__ import annotations

import asyncio
import resource

import pytest

from kvstore.config import ServerConfig
from kvstore.errors import ConfigError
from kvstore.server.fds import MIN_RESERVED_FDS, ConnectionBudget, raise_nofile_limit
from kvstore.server.pending import PendingConnections


def _total(budget: ConnectionBudget, server: ServerConfig) -> int:
    listeners = 1 + bool(server.tcp_address)
    return (budget.grpc_connections * listeners + budget.data_connections * listeners
            + budget.descriptor_connections + budget.metrics_connections)


def test_caps_stay_as_configured_under_a_high_limit():
    server = ServerConfig(tcp_address="127.0.0.1:0", metrics_port=9100)
    budget = ConnectionBudget.split(1 << 20, server)
    assert budget.grpc_connections == budget.data_connections == server.max_connections


@pytest.mark.parametrize("limit", [256, 1024, 4096])
def test_all_listeners_at_their_caps_leave_the_reserve(limit):
    """1,024 descriptors (the usual soft limit) with TCP on: the caps are lowered so that
    every listener full still leaves a quarter (at least MIN_RESERVED_FDS) for the tiers."""
    server = ServerConfig(tcp_address="127.0.0.1:0", metrics_port=9100)
    budget = ConnectionBudget.split(limit, server)
    assert budget.reserved_fds >= max(MIN_RESERVED_FDS, limit // 4)
    assert _total(budget, server) <= limit - budget.reserved_fds
    assert budget.grpc_connections < server.max_connections
    assert 1 <= budget.unauthenticated_share < budget.grpc_connections


def test_soft_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        assert raise_nofile_limit() == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_unauthenticated_timeout_is_validated():
    with pytest.raises(ConfigError, match="server.unauthenticated_timeout_s"):
        ServerConfig(unauthenticated_timeout_s=0)


async def test_a_full_share_drops_the_oldest_of_the_largest_peer():
    """Two waiting from "flood", one from "client": a fourth drops flood's oldest, never the
    client's, and a connection that authenticated leaves the share."""
    pending = PendingConnections(3, "test socket")
    tasks = [asyncio.ensure_future(asyncio.sleep(60)) for _ in range(4)]
    pending.admit("flood", tasks[0])
    pending.admit("client", tasks[1])
    pending.admit("flood", tasks[2])
    pending.admit("newcomer", tasks[3])
    await asyncio.sleep(0)
    assert tasks[0].cancelled() and not any(t.done() for t in tasks[1:])
    assert len(pending) == 3 and pending.num_dropped == 1
    pending.settle(tasks[1])
    assert len(pending) == 2
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert len(pending) == 0
