"""The one record of open leases and reservations: who holds each, tenants' quotas, expiry."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from kvstore.api import MAX_LEASE_S
from kvstore.config import QuotaConfig
from kvstore.errors import CapacityError, InvalidArgument, LeaseNotFound, PermissionDenied, shown
from kvstore.keys import BlockKey, Namespace
from kvstore.store.directory import BlockEntry
from kvstore.store.placement import Link
from kvstore.tiers.base import Slot


@dataclass(slots=True)
class LeaseHold:
    """Pinned entries of a lease."""

    KIND: ClassVar[str] = "lease"

    held_id: str
    deadline: float
    tenant: str  # the holder: the tenant of the namespace it was granted in
    entries: list[BlockEntry]


@dataclass(slots=True)
class ReservedSlot:
    """A slot lent for one block of a reservation."""

    key: BlockKey
    block_index: int
    parent: BlockKey | None
    link: Link
    slot: Slot


@dataclass(slots=True)
class ReservationHold:
    KIND: ClassVar[str] = "reservation"

    held_id: str
    deadline: float
    ns: Namespace
    slots: list[ReservedSlot]
    # The prompt's keys: what was stored of them up to its last reserved block stays while
    # the commit makes room (a put in pieces never evicts its own head), and the commit
    # records them as sightings, as a streamed put does.
    keys: tuple[BlockKey, ...] = ()

    @property
    def head(self) -> tuple[BlockKey, ...]:
        """The prompt's keys before its last reserved block."""
        return self.keys[:self.slots[-1].block_index] if self.slots else ()

    @property
    def tenant(self) -> str:
        """The holder: the tenant of the namespace it was granted in."""
        return self.ns.tenant


Hold = LeaseHold | ReservationHold
H = TypeVar("H", LeaseHold, ReservationHold)


class HeldTable:
    """Open leases and reservations by id, each held by the tenant of the namespace it was
    granted in, expiring at their deadline.

    ``check_holder`` is the owner check a call that ends one (release, commit, abort) passes
    first: a caller of another tenant is refused (PermissionDenied) and changes nothing; a
    caller of no tenant (the admin, a local-trust caller) may end any. An id that expired stays
    known by its holder for ``GRACE_S`` past its deadline, so another tenant's late call is
    still refused as another tenant's rather than told that it expired.

    Args:
        quota: how many leases and reservations one tenant may hold open at once.
        lease_timeout_s: the length of a lease or reservation whose caller asks for none.
    """

    GRACE_S = 60.0

    def __init__(self, quota: QuotaConfig, lease_timeout_s: float) -> None:
        self._max_per_tenant = {"lease": quota.max_open_leases,
                                "reservation": quota.max_open_reservations}
        self._lease_timeout_s = lease_timeout_s
        self._held: dict[str, Hold] = {}
        self._num = dict.fromkeys(self._max_per_tenant, 0)
        self._per_tenant: dict[tuple[str, str], int] = {}
        self._expired_holders: dict[str, tuple[str, float]] = {}  # id -> (tenant, deadline)

    def count(self, kind: str) -> int:
        """How many ``kind``s are open."""
        return self._num[kind]

    def deadline(self, lease_s: float | None) -> float:
        """When a holding asked for ``lease_s`` seconds (None: the default) ends."""
        if lease_s is None:
            lease_s = self._lease_timeout_s
        elif not 0 < lease_s <= MAX_LEASE_S:
            raise InvalidArgument(f"lease_s must be in (0, {MAX_LEASE_S}], got {lease_s}")
        return time.time() + lease_s

    def check_room(self, kind: str, tenant: str) -> None:
        """CapacityError if ``tenant`` already holds as many ``kind``s as it may."""
        limit = self._max_per_tenant[kind]
        if self._per_tenant.get((kind, tenant), 0) >= limit:
            raise CapacityError(f"tenant {shown(tenant)} holds {limit} open {kind}s, its quota; "
                                "release or commit some first")

    def add(self, held: H) -> H:
        self._held[held.held_id] = held
        self._num[held.KIND] += 1
        counted = (held.KIND, held.tenant)
        self._per_tenant[counted] = self._per_tenant.get(counted, 0) + 1
        return held

    def get(self, held_id: str, cls: type[H]) -> H | None:
        """The open ``cls`` of ``held_id`` (None if unknown or of another kind)."""
        held = self._held.get(held_id)
        return held if isinstance(held, cls) else None

    def pop(self, held_id: str, cls: type[H]) -> H:
        """Remove and return a holding; one past its deadline but not yet reaped still counts.
        LeaseNotFound if no ``cls`` of that id is open."""
        held = self._held.get(held_id)
        if not isinstance(held, cls):
            raise LeaseNotFound(f"{cls.KIND} {shown(held_id)} does not exist or has expired")
        del self._held[held_id]
        self._forget(held)
        return held

    def expired(self, cls: type[H], now: float | None = None) -> list[H]:
        """Remove and return every ``cls`` past its deadline."""
        now = time.time() if now is None else now
        gone = [h for h in self._held.values() if isinstance(h, cls) and h.deadline < now]
        for held in gone:
            del self._held[held.held_id]
            self._forget(held)
            self._expired_holders[held.held_id] = (held.tenant, held.deadline)
        cutoff = now - self.GRACE_S
        if any(deadline < cutoff for _, deadline in self._expired_holders.values()):
            self._expired_holders = {k: v for k, v in self._expired_holders.items()
                                     if v[1] >= cutoff}
        return gone

    def check_holder(self, held_id: str, kind: str, caller_tenant: str | None) -> None:
        """PermissionDenied if ``held_id`` names a lease or reservation (of either kind: the
        message says ``kind``, the one the caller named) that another tenant holds or held
        until it expired; a caller of no tenant may name any."""
        if caller_tenant is None:
            return
        held = self._held.get(held_id)
        if held is not None:
            holder = held.tenant
        else:
            holder = self._expired_holders.get(held_id, (caller_tenant, 0.0))[0]
        if holder != caller_tenant:
            raise PermissionDenied(f"{kind} {shown(held_id)} belongs to another tenant")

    def _forget(self, held: Hold) -> None:
        counted = (held.KIND, held.tenant)
        left = self._per_tenant[counted] - 1
        if left:
            self._per_tenant[counted] = left
        else:
            del self._per_tenant[counted]
        self._num[held.KIND] -= 1
