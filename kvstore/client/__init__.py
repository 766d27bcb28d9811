"""Clients of the kvstore daemon: ``Client`` (blocking) and ``AsyncClient`` (asyncio)."""

from kvstore.api import HealthInfo
from kvstore.client.aio import AsyncClient
from kvstore.client.base import NO_RETRY, RetryPolicy, default_address
from kvstore.client.sync import Client

__all__ = ["NO_RETRY", "AsyncClient", "Client", "HealthInfo", "RetryPolicy", "default_address"]
