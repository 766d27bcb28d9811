"""Published steps given back whose memory the tier could not free yet, charged until it can.

A published step goes back by being cut down to its header page (``SealedStep.retire``): that
frees its memory for real, whoever else still maps it or holds its descriptor, a client
process the daemon never saw included (one a client passed the descriptor on to over a Unix
socket, in another pid namespace, of another user). The kernel says so: the memfd's block
count (``SealedStep.held_bytes``) drops to the header page the moment it is cut. So the
budget no longer has to guess from ``/proc/<pid>/maps`` who still holds a step.

What it cannot cut at once is a step this process itself still reads: a reader that took a
page's view before the page was deleted (a streamed Get, a copy down the chain) keeps the
daemon's mapping open, and cutting the memory under it would kill the daemon with SIGBUS. Such
a step lingers here, charged to the budget, until its last view here is gone; the tier tries
again before it next takes memory back, at most every ``LINGER_CHECK_S``.

What a holder still keeps of a step given back is its header page (4 KiB of a 64 MiB step),
and pages it pinned before the cut (cudaHostRegister, vmsplice, io_uring buffers), which the
kernel frees only when it unpins them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvstore.errors import shown
from kvstore.tiers.dram.arena import SealedStep

log = logging.getLogger("kvstore.tiers.dram")  # the DRAM tier's logger: these are its messages


@dataclass(slots=True)
class Lingering:
    """One given-back step not freed yet: its memory, whose it was."""

    region: str
    memory: SealedStep
    tenant: str
    warned: bool = False

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes


class LingeringSteps:
    """The given-back steps whose memory is still held here. Not thread-safe: the tier adds
    and forgets on its event loop (``try_free`` blocks: it runs in a thread)."""

    def __init__(self) -> None:
        self._steps: dict[str, Lingering] = {}
        self._freeing = threading.Lock()  # two looks at once must not close a step twice

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def nbytes(self) -> int:
        return sum(step.nbytes for step in self._steps.values())

    def nbytes_of(self, tenant: str) -> int:
        """Bytes of ``tenant``'s steps still held (charged to its share)."""
        return sum(step.nbytes for step in self._steps.values() if step.tenant == tenant)

    def nbytes_by_tenant(self) -> dict[str, int]:
        """``nbytes_of`` every tenant holding some."""
        held: dict[str, int] = {}
        for step in self._steps.values():
            held[step.tenant] = held.get(step.tenant, 0) + step.nbytes
        return held

    def add(self, region: str, memory: SealedStep, tenant: str) -> None:
        self._steps[region] = Lingering(region, memory, tenant)

    def try_free(self) -> list[str]:
        """Cut the steps no view here reads any more; return their regions (``forget``
        them). Blocking: run it in a thread; it changes nothing the loop reads."""
        with self._freeing:
            return [region for region, step in list(self._steps.items())
                    if step.memory.retire()]

    def forget(self, regions: list[str]) -> int:
        """Forget ``regions`` (cut by ``try_free``); the bytes they free."""
        freed = 0
        for region in regions:
            step = self._steps.pop(region, None)
            if step is not None:
                freed += step.nbytes
        return freed

    def warn(self) -> None:
        """Log each step still held once (a view kept past its page is worth a look; saying
        so at every write that needs room is not)."""
        for step in self._steps.values():
            if not step.warned:
                step.warned = True
                log.warning("dram: tenant %s's published step %s (%d bytes) was given back, "
                            "but a reader here still holds a view of it: its memory stays "
                            "charged to the tier until that view goes", shown(step.tenant),
                            step.region, step.nbytes)

    def take_all(self) -> list[Lingering]:
        """Forget every step (the tier closing: they go with their last view)."""
        steps = list(self._steps.values())
        self._steps.clear()
        return steps
