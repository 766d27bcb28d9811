"""Published steps given back while a client process may still map them.

A published step is sealed against writers (``F_SEAL_FUTURE_WRITE``), which also refuses to
free its memory while anything maps it: once the tier gives a step back, its memory lives on
for as long as a client keeps a mapping or a descriptor of it. Honest clients drop them at
once (the daemon tells their sessions); one that does not would hold memory the budget has
already lent to another tenant, without bound. So a step that went to client processes stays
charged to the budget until none of them maps it or holds its descriptor any more, as their
``/proc/<pid>/maps`` and ``/proc/<pid>/fd`` show.

What this cannot see, and so takes on trust as before: a process it was never told of (a
client in another pid namespace, whose peer pid is 0), one whose ``/proc`` entries it may not
read (another user's, for a daemon that is not root), and a child a client forked after
mapping the step.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field

from kvstore.errors import shown

log = logging.getLogger("kvstore.tiers.dram")  # the DRAM tier's logger: these are its messages

# A step remembers at most this many client processes it went to (each asked for its
# descriptor): a tenant's engine processes, a few dozen at most on one host.
MAX_FETCHERS = 1024


@dataclass(slots=True)
class Lingering:
    """One given-back step still held: its bytes, whose it was, who may hold it."""

    region: str
    nbytes: int
    tenant: str
    pids: set[int] = field(default_factory=set)
    warned: bool = False


class LingeringSteps:
    """The given-back steps whose memory client processes may still hold. Not thread-safe:
    the tier adds and forgets on its event loop; ``holders`` (blocking) runs in a thread."""

    def __init__(self) -> None:
        self._steps: dict[str, Lingering] = {}

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def nbytes(self) -> int:
        return sum(step.nbytes for step in self._steps.values())

    def nbytes_of(self, tenant: str) -> int:
        """Bytes of ``tenant``'s steps still held (its clients keep that memory: it is the
        tenant's, charged to its share, and the tenant takes no other tenant's memory)."""
        return sum(step.nbytes for step in self._steps.values() if step.tenant == tenant)

    def nbytes_by_tenant(self) -> dict[str, int]:
        """``nbytes_of`` every tenant holding some."""
        held: dict[str, int] = {}
        for step in self._steps.values():
            held[step.tenant] = held.get(step.tenant, 0) + step.nbytes
        return held

    def add(self, region: str, nbytes: int, tenant: str, pids: set[int]) -> None:
        self._steps[region] = Lingering(region, nbytes, tenant, set(pids))

    def snapshot(self) -> list[Lingering]:
        """The steps held now (copies: a thread may look at them while the loop adds more)."""
        return [Lingering(s.region, s.nbytes, s.tenant, set(s.pids))
                for s in self._steps.values()]

    def release(self, still_held: dict[str, set[int]]) -> int:
        """Forget the steps that no process holds any more, given ``still_held`` (region ->
        the pids still holding it, from ``holders``); return the bytes they free."""
        freed = 0
        for region, pids in still_held.items():
            step = self._steps.get(region)
            if step is None:
                continue
            if pids:
                step.pids = pids
                continue
            del self._steps[region]
            freed += step.nbytes
        return freed

    def warn(self) -> None:
        """Log each step still held once (a client that keeps them is worth an operator's
        look; saying so at every write that needs room is not)."""
        for step in self._steps.values():
            if step.warned:
                continue
            step.warned = True
            log.warning("dram: tenant %s's published step %s (%d bytes) was given back, but "
                        "process(es) %s still map it: its memory stays charged to the tier",
                        shown(step.tenant), step.region, step.nbytes, sorted(step.pids))

    def clear(self) -> None:
        self._steps.clear()


def holders(steps: list[Lingering]) -> dict[str, set[int]]:
    """For each step, the processes of its ``pids`` that still map its memfd or hold a
    descriptor of it. Blocking: reads ``/proc``. A process that is gone holds nothing; one
    whose entries may not be read is taken at its word, like any process this cannot see."""
    return {step.region: {pid for pid in step.pids if _holds(pid, step.region)}
            for step in steps}


def _holds(pid: int, region: str) -> bool:
    # /proc shows a memfd as "/memfd:<name> (deleted)"; the tier names a step's memfd
    # "kvstore-<region>", and region names are unique.
    name = f"/memfd:kvstore-{region} "
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            if any(name in line for line in maps):
                return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                if f"{os.readlink(f'/proc/{pid}/fd/{fd}')} ".startswith(name):
                    return True
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
        pass  # gone, or not ours to see (taken on trust)
    return False
