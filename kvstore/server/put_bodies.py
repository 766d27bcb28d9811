"""The bytes of Put bodies one tenant may have in flight at once, checked before any is read.

A streamed Put holds its body in the daemon's memory until the store has it: six of them
declaring 256 MiB each grew the daemon by 2.1 GiB (issue 28), and a tenant could open as many
as the call cap allows. Each Put takes its declared size from its tenant's share of
``server.max_tenant_put_bytes`` before its first chunk is read, and gives it back when the
store has let go of the body; a Put that does not fit waits, unread (its client waits on flow
control), until earlier ones of that tenant ended, and is refused with RESOURCE_EXHAUSTED
after ``server.stream_idle_timeout_s`` of waiting. One Put alone always fits (the largest one
Put may be is bounded on its own, ``service.max_put_bytes``), so a tenant's in-flight bodies
stay under its budget plus one Put, whatever it sends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvstore.errors import CapacityError, shown
from kvstore.server.heap import HEAP


class PutBodies:
    """Put bodies in flight per tenant.

    Args:
        max_tenant_bytes: the most one tenant's Puts may declare together
            (``server.max_tenant_put_bytes``); one Put alone may declare more.
        wait_s: how long a Put that does not fit waits for room.
    """

    def __init__(self, max_tenant_bytes: int, wait_s: float) -> None:
        self.max_tenant_bytes = max_tenant_bytes
        self._wait_s = wait_s
        self._held: dict[str | None, int] = {}  # tenant -> bytes its Puts declared
        self._freed = asyncio.Event()
        self.most_held_bytes = 0  # the most one tenant ever held, since the daemon started

    def held_bytes(self, tenant: str | None) -> int:
        return self._held.get(tenant, 0)

    @property
    def in_flight_bytes(self) -> int:
        return sum(self._held.values())

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str | None, num_bytes: int) -> AsyncIterator[None]:
        """``num_bytes`` of ``tenant``'s budget for the body of one Put, while it runs."""
        await self._take(tenant, num_bytes)
        try:
            yield
        finally:
            self._give(tenant, num_bytes)

    async def _take(self, tenant: str | None, num_bytes: int) -> None:
        try:
            async with asyncio.timeout(self._wait_s):
                while (held := self._held.get(tenant, 0)) and \
                        held + num_bytes > self.max_tenant_bytes:
                    self._freed.clear()
                    await self._freed.wait()
        except TimeoutError:
            raise CapacityError(
                f"tenant {shown(tenant)} has Puts of {self._held.get(tenant, 0)} bytes in "
                f"flight; this one's {num_bytes} would pass its {self.max_tenant_bytes}-byte "
                f"budget (server.max_tenant_put_bytes) and no room came within "
                f"{self._wait_s:g} s; retry once its Puts have ended") from None
        held = self._held[tenant] = self._held.get(tenant, 0) + num_bytes
        self.most_held_bytes = max(self.most_held_bytes, held)

    def _give(self, tenant: str | None, num_bytes: int) -> None:
        left = self._held[tenant] - num_bytes
        if left:
            self._held[tenant] = left
        else:
            del self._held[tenant]
        self._freed.set()
        HEAP.note_freed(num_bytes)
