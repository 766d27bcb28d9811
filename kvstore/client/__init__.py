"""Clients of the kvstore daemon: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Both plan their calls through ``requests.py`` (request building, response parsing) and make
them through one ``transport.py`` seam (gRPC, or the call channels of ``channels.py``);
``releases.py`` sends their leases' Releases late, ``mappings.py`` holds the zero-copy page
paths through the daemon's regions, ``engine.py`` (with ``staging.py``) an engine's GPU path;
``address.py`` and ``retry.py`` say how to reach the daemon and when to try again,
``tracing.py`` what calls carry for the daemon's request spans (``for_request``), ``events.py``
a KV event subscription (``subscribe_events``) read as typed batches. Nothing
here imports the store, its tiers or the server: the wire forms come from ``kvstore.rpc``.
"""

from kvstore.api import HealthInfo
from kvstore.client.address import default_address
from kvstore.client.aio import AsyncClient
from kvstore.client.retry import NO_RETRY, RetryPolicy
from kvstore.client.sync import Client
from kvstore.client.tracing import for_request

__all__ = ["NO_RETRY", "AsyncClient", "Client", "HealthInfo", "RetryPolicy", "default_address",
           "for_request"]
