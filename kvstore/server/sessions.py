"""Client sessions: the leases and reservations a client process holds, given back the moment
the process goes away.

A client opens a session with the ``Hold`` call (a server stream it keeps open for its
lifetime) under a random id of its own, and names that id in the ``kvstore-session`` metadata
of its ``Acquire`` and ``Reserve`` calls. When the stream ends (the process exited or crashed,
or closed its client) the daemon releases every lease and aborts every reservation granted
under the session, instead of waiting for their deadlines: a dead engine's pinned blocks and
slots serve others at once. A session belongs to the tenant that opened it; another tenant's
call naming it is refused.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.errors import CapacityError, InvalidArgument, LeaseNotFound, PermissionDenied, shown
from kvstore.rpc.metadata import SESSION_HEADER
from kvstore.server.auth import Caller
from kvstore.store import Store

log = logging.getLogger("kvstore.server.sessions")

HEARTBEAT_S = 5.0  # a Hold stream sends an event this often
# A session is one client process (an engine's scheduler and each of its workers): a few per
# tenant and host. Each holds one call slot of server.max_concurrent_rpcs for its lifetime, so
# one tenant may open this many, and all together at most a quarter of the slots: sessions
# can never crowd out the calls they exist for.
MAX_SESSIONS_PER_TENANT = 64
SESSION_SHARE_OF_CALLS = 4
_SESSION_ID = re.compile(r"[0-9a-f]{32,64}")


@dataclass(slots=True, eq=False)
class Session:
    session_id: str
    tenant: str | None  # None: the admin or a local-trust caller
    leases: set[str] = field(default_factory=set)
    reservations: set[str] = field(default_factory=set)
    # Set when the daemon gave back memory the tenant's clients may map: the Hold stream tells
    # its client at once (``HoldEvent.regions_retired``).
    retired: asyncio.Event = field(default_factory=asyncio.Event)


class Sessions:
    """The open sessions of one daemon and what was granted under each."""

    def __init__(self, store: Store, max_concurrent_rpcs: int = 4096) -> None:
        self._store = store
        self._max_open = max(1, max_concurrent_rpcs // SESSION_SHARE_OF_CALLS)
        self._open: dict[str, Session] = {}
        self._per_tenant: dict[str | None, int] = {}
        self._by_grant: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, session_id: str, caller: Caller) -> Session:
        if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
            raise InvalidArgument(f"session id {shown(session_id, 24)} must be 32 to 64 "
                                  "lowercase hex digits")
        if session_id in self._open:
            raise InvalidArgument("that session is already open")
        count = self._per_tenant.get(caller.tenant, 0)
        if count >= MAX_SESSIONS_PER_TENANT:
            raise CapacityError(f"tenant {shown(caller.tenant)} holds {count} open sessions, "
                                "the most one tenant may")
        if len(self._open) >= self._max_open:
            raise CapacityError(f"{len(self._open)} sessions are open, the most this daemon "
                                "keeps (a quarter of server.max_concurrent_rpcs)")
        session = self._open[session_id] = Session(session_id, caller.tenant)
        self._per_tenant[caller.tenant] = count + 1
        return session

    def of_call(self, metadata: Sequence[tuple[str, str | bytes]] | None, caller: Caller
                ) -> Session | None:
        """The session a call names in its metadata (None if it names none)."""
        named = next((v for k, v in metadata or () if k == SESSION_HEADER), None)
        if named is None:
            return None
        session = self._open.get(named if isinstance(named, str) else named.decode(
            errors="replace"))
        if session is None:
            raise InvalidArgument("the call names a session that is not open (open it with "
                                  "Hold first, or it ended)")
        if session.tenant != caller.tenant:
            raise PermissionDenied("the call names a session of another tenant")
        return session

    def note(self, session: Session | None, grant_id: str, is_lease: bool) -> None:
        """``grant_id`` was granted under ``session``."""
        if session is None or session.session_id not in self._open:
            return
        (session.leases if is_lease else session.reservations).add(grant_id)
        self._by_grant[grant_id] = session

    def regions_retired(self, tenant: str) -> None:
        """Tell the sessions of ``tenant``, and those that may map any tenant's memory (the
        admin's, local trust's), that regions it may have mapped were given back."""
        for session in self._open.values():
            if session.tenant in (tenant, None):
                session.retired.set()

    def forget(self, grant_id: str) -> None:
        """``grant_id`` was released, committed or aborted by its holder."""
        session = self._by_grant.pop(grant_id, None)
        if session is not None:
            session.leases.discard(grant_id)
            session.reservations.discard(grant_id)

    async def close(self, session: Session) -> int:
        """End ``session``: give back what is still granted under it; returns how many."""
        if self._open.pop(session.session_id, None) is None:
            return 0
        left = self._per_tenant[session.tenant] - 1
        if left:
            self._per_tenant[session.tenant] = left
        else:
            del self._per_tenant[session.tenant]
        returned = 0
        for lease_id in list(session.leases):
            self._by_grant.pop(lease_id, None)
            try:
                await self._store.release(lease_id)
                returned += 1
            except LeaseNotFound:  # expired meanwhile
                pass
        for reservation_id in list(session.reservations):
            self._by_grant.pop(reservation_id, None)
            try:
                await self._store.abort(reservation_id)
                returned += 1
            except LeaseNotFound:
                pass
        if returned:
            log.info("session of tenant %s ended: gave back %d leases and reservations",
                     shown(session.tenant), returned)
        return returned
