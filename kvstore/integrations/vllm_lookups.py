"""The vLLM connector's scheduler-side lookups, answered within a deadline or left pending.

vLLM 0.32's scheduler asks ``get_num_new_matched_tokens`` on its own thread once per waiting
request per step; a ``None`` answer makes it skip the request this step and ask again the
next (``KVConnectorBase_V1``: "the connector needs more time"). A lookup may wait on a slow
tier (the shared Redis tier answers within about 0.5 s, a stopped daemon only at the client's
timeout), so each runs on a worker thread: the scheduler waits for it at most
``deadline_s``, and past that is told to come back; a lookup still unanswered after
``give_up_s`` counts as a miss, so a request is never held longer than that.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from kvstore.api import LookupResult
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import Namespace

logger = logging.getLogger(__name__)

# A lookup of a 32k-token prompt in a local daemon takes about 1 ms (hashing, one round trip:
# BENCHMARKS.md, "Lookup against a plain Python floor"), so 5 ms answers every local lookup in the step
# it was asked and costs the scheduler at most that per new request.
DEFAULT_LOOKUP_DEADLINE_MS = 5.0
DEFAULT_LOOKUP_GIVE_UP_MS = 2000.0  # beyond the shared tier's ~0.5 s, below a client timeout


class Pending(enum.Enum):
    """The lookup is still running: answer vLLM ``None`` and be asked again."""

    PENDING = "pending"


@dataclass(frozen=True, slots=True)
class LookupDeadlines:
    """How long the scheduler waits for a lookup."""

    deadline_ms: float = DEFAULT_LOOKUP_DEADLINE_MS  # per ask; past it the answer is pending
    give_up_ms: float = DEFAULT_LOOKUP_GIVE_UP_MS  # since the first ask; past it a miss

    def __post_init__(self) -> None:
        for name in ("deadline_ms", "give_up_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0 <= value <= 60_000:
                raise InvalidArgument(f"lookup {name} must be a number in [0, 60000], "
                                      f"got {value!r}")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> LookupDeadlines:
        """From ``kv_connector_extra_config``'s ``lookup_deadline_ms`` and
        ``lookup_give_up_ms``."""
        return cls(deadline_ms=extra.get("lookup_deadline_ms", DEFAULT_LOOKUP_DEADLINE_MS),
                   give_up_ms=extra.get("lookup_give_up_ms", DEFAULT_LOOKUP_GIVE_UP_MS))


class DeadlineLookups:
    """Lookups by request id, each on one worker thread, polled by the scheduler.

    Called only from vLLM's scheduler thread; the worker thread only runs ``lookup``.
    """

    def __init__(self, lookup: Callable[[Namespace, list[int]], LookupResult],
                 deadlines: LookupDeadlines) -> None:
        self._lookup = lookup
        self._deadline_s = deadlines.deadline_ms / 1000
        self._give_up_s = deadlines.give_up_ms / 1000
        # One thread: lookups keep the order they were asked in, and a hung daemon holds
        # one thread, not one per request.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-lookup")
        self._pending: dict[str, tuple[Future[LookupResult], float]] = {}

    def ask(self, req_id: str, ns: Namespace, ids: list[int]) -> LookupResult | Pending | None:
        """The lookup's result; ``PENDING`` while it runs within ``give_up_s``; None where it
        failed or gave up (a miss)."""
        entry = self._pending.get(req_id)
        if entry is None:
            entry = self._pending[req_id] = (self._executor.submit(self._lookup, ns, ids),
                                             time.monotonic())
        future, started = entry
        try:
            result = future.result(timeout=self._deadline_s)
        except FutureTimeout:
            if time.monotonic() - started < self._give_up_s:
                return Pending.PENDING
            logger.warning("kvstore lookup of %s unanswered after %.0f ms: computing it",
                           req_id, self._give_up_s * 1000)
            result = None
        except KVStoreError as exc:  # the daemon is down: compute everything, serve on
            logger.warning("kvstore lookup failed, computing the prompt: %s", exc)
            result = None
        self._pending.pop(req_id, None)
        return result

    def forget(self, req_id: str) -> None:
        """Drop a request's lookup (it finished or was aborted while waiting)."""
        entry = self._pending.pop(req_id, None)
        if entry is not None:
            entry[0].cancel()  # a lookup not yet started never runs

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
