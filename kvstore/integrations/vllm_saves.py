"""The vLLM connector's worker-side saves: puts on a background thread, finished per request.

vLLM 0.32 calls ``wait_for_save`` once per step on the worker's own thread, and a request's
blocks may be reused once the scheduler frees them. So the worker gathers the blocks a step
completed out of the engine's cache into a host tensor of their own (``submit``: that copy is
the part that must happen before the blocks change) and hands the put to one background
thread; the step goes on at once. The scheduler side answers ``request_finished`` with True
(delay freeing) for a request it planned saves for, and ``finished`` names such a request to
vLLM (``get_finished``) only once every put of it completed, failed or was dropped, so its
blocks are freed only then.

Contract:
- ``submit``, ``finished``, ``take_stats`` and ``close`` are called from the worker's thread
  only; the background thread only runs puts and updates counters under the lock.
- Nothing here blocks the step: beyond ``max_queued_bytes`` of gathered tensors queued or
  being put, a save is dropped and counted, never waited for.
- Puts run in submission order on one thread, so a request's blocks are added behind the
  prefix it stored before. A save dropped or failed breaks that chain: the request's next save
  is gathered and put from block 0 (``restarts``), and a put that finds its prefix gone fails
  with NotFound rather than store a gap: kvstore stores whole blocks of a prefix or nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.errors import InvalidArgument, KVStoreError, NotFound
from kvstore.keys import Namespace

logger = logging.getLogger(__name__)

# A 32k-token prompt of an 8B-shaped model (32 layers, 8 KV heads of 128, bf16) is 4 GiB of
# K/V; a step completes at most the chunked-prefill budget (vLLM's max_num_batched_tokens,
# 16,384 tokens by default for an offline engine on an H200: 2 GiB of such blocks). The queue
# holds two such steps (``step_queue_bytes``), at least 1 GiB: a save larger than the whole
# queue could never be taken, and the request would never be stored (seen on an H200 with a
# fixed 1 GiB cap: no 32k-token prompt was stored).
DEFAULT_SAVE_QUEUE_BYTES = 1 << 30
# A step's save is queued in pieces of at most this many bytes: each piece's put starts once
# its copy landed, instead of the first put waiting for the whole step's copy.
SAVE_PIECE_BYTES = 256 << 20
DEFAULT_SAVE_TIMEOUT_MS = 10_000.0  # a put that takes longer fails; its request is freed then
CLOSE_GRACE_S = 10.0  # how long shutdown waits for queued puts to land


@dataclass(frozen=True, slots=True)
class SaveLimits:
    """How much the background saves may hold, and for how long."""

    max_queued_bytes: int = DEFAULT_SAVE_QUEUE_BYTES  # gathered tensors queued or being put
    put_timeout_ms: float = DEFAULT_SAVE_TIMEOUT_MS  # deadline of each put's calls

    def __post_init__(self) -> None:
        if isinstance(self.max_queued_bytes, bool) or not isinstance(self.max_queued_bytes, int) \
                or not 0 <= self.max_queued_bytes <= 1 << 40:
            raise InvalidArgument(f"save max_queued_bytes must be an integer in [0, 2**40], "
                                  f"got {self.max_queued_bytes!r}")
        if isinstance(self.put_timeout_ms, bool) or \
                not isinstance(self.put_timeout_ms, (int, float)) or \
                not 1 <= self.put_timeout_ms <= 600_000:
            raise InvalidArgument(f"save put_timeout_ms must be a number in [1, 600000], "
                                  f"got {self.put_timeout_ms!r}")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any], step_bytes: int = 0) -> SaveLimits:
        """From ``kv_connector_extra_config``'s ``save_queue_bytes`` and ``save_timeout_ms``;
        the queue's default holds two steps of ``step_bytes`` (``step_queue_bytes``)."""
        return cls(max_queued_bytes=extra.get("save_queue_bytes", step_queue_bytes(step_bytes)),
                   put_timeout_ms=extra.get("save_timeout_ms", DEFAULT_SAVE_TIMEOUT_MS))


def step_queue_bytes(step_bytes: int) -> int:
    """The default save queue: two steps' worth of blocks (``step_bytes`` each), at least
    ``DEFAULT_SAVE_QUEUE_BYTES``."""
    return max(DEFAULT_SAVE_QUEUE_BYTES, 2 * step_bytes)


def pieces(num_blocks: int, block_bytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` block ranges of at most ``SAVE_PIECE_BYTES`` (one block at least)
    covering ``num_blocks`` blocks."""
    step = max(1, SAVE_PIECE_BYTES // max(1, block_bytes))
    return [(i, min(num_blocks, i + step)) for i in range(0, num_blocks, step)]


@dataclass(slots=True)
class SaveJob:
    """One put: ``kv`` holds the blocks from ``first_block`` on of ``token_ids``."""

    req_id: str
    ns: Namespace
    token_ids: list[int]
    kv: torch.Tensor
    first_block: int
    ready: Any = None  # a CUDA event: ``kv`` holds the blocks once it passed (the put waits)
    event: Any = None  # reported once the put landed (``AsyncSaves.take_events``)

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(slots=True)
class SaveCounters:
    """What the saves did since the counters were last taken."""

    saved_blocks: int = 0  # blocks whose put landed
    saved_bytes: int = 0
    dropped_saves: int = 0  # saves over the queue cap, never gathered
    failed_saves: int = 0  # puts that raised (daemon down, timeout, prefix evicted)

    def to_dict(self) -> dict[str, int]:
        return {"saved_blocks": self.saved_blocks, "saved_bytes": self.saved_bytes,
                "dropped_saves": self.dropped_saves, "failed_saves": self.failed_saves}


@dataclass(slots=True)
class _Request:
    """A request's saves, from its first submission until vLLM is told it finished."""

    num_in_flight: int = 0
    restart: bool = False  # a save was dropped or failed: put the next one from block 0
    finished: bool = False  # vLLM named it in ``finished_req_ids``


@dataclass(slots=True)
class _State:
    requests: dict[str, _Request] = field(default_factory=dict)
    queued_bytes: int = 0
    counters: SaveCounters = field(default_factory=SaveCounters)
    events: list[Any] = field(default_factory=list)  # of the puts that landed


Put = Callable[[Namespace, list[int], torch.Tensor, int], object]


class AsyncSaves:
    """Saves queued for one background thread; requests reported once their puts are done.

    Args:
        put: ``put(ns, token_ids, kv, first_block)``, a client's put (its own client: the
            worker's is busy with loads on the worker's thread).
        limits: the queue cap and the put deadline.
    """

    def __init__(self, put: Put, limits: SaveLimits) -> None:
        self._put = put
        self._max_queued_bytes = limits.max_queued_bytes
        self._lock = threading.Lock()
        self._state = _State()
        self._queue: queue.SimpleQueue[SaveJob | None] = queue.SimpleQueue()
        # A daemon thread: a process that exits without shutdown is not held by a hung put.
        self._thread = threading.Thread(target=self._run, name="kvstore-save", daemon=True)
        self._thread.start()

    def seen(self, req_id: str) -> None:
        """``req_id`` had a save planned (the scheduler delays freeing its blocks), whether
        or not it is submitted: it must be reported in ``finished``."""
        with self._lock:
            self._state.requests.setdefault(req_id, _Request())

    def restarts(self, req_id: str) -> bool:
        """Whether the request's next save must hold its blocks from block 0."""
        with self._lock:
            entry = self._state.requests.get(req_id)
            return entry is not None and entry.restart

    def submit(self, req_id: str, num_bytes: int, gather: Callable[[], SaveJob]) -> bool:
        """Gather and queue one save, or drop it (False) when ``num_bytes`` more would pass
        the cap. ``gather`` copies the blocks out of the engine's cache, on this thread."""
        with self._lock:
            state = self._state
            entry = state.requests.setdefault(req_id, _Request())
            if state.queued_bytes + num_bytes > self._max_queued_bytes:
                state.counters.dropped_saves += 1
                entry.restart = True
                return False
            state.queued_bytes += num_bytes
            entry.num_in_flight += 1
            entry.restart = False
        try:
            job = gather()
        except BaseException:
            self._done(req_id, num_bytes, ok=False)
            raise
        self._queue.put(job)
        return True

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests vLLM named finished (now or before), those with a save planned
        whose puts are all done; each is named once, then forgotten."""
        done: set[str] = set()
        with self._lock:
            requests = self._state.requests
            for req_id in finished_req_ids:
                if req_id in requests:
                    requests[req_id].finished = True
            for req_id, entry in list(requests.items()):
                if entry.finished and entry.num_in_flight == 0:
                    done.add(req_id)
                    del requests[req_id]
        return done

    def take_events(self) -> list[Any]:
        """The events of the jobs whose puts landed since the last call."""
        with self._lock:
            events, self._state.events = self._state.events, []
        return events

    def take_stats(self) -> SaveCounters:
        """The counters since the last call, reset."""
        with self._lock:
            counters, self._state.counters = self._state.counters, SaveCounters()
        return counters

    @property
    def queued_bytes(self) -> int:
        with self._lock:
            return self._state.queued_bytes

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Let the queued puts land within ``grace_s``, then stop the thread."""
        self._queue.put(None)
        self._thread.join(grace_s)

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if job.ready is not None:
                    job.ready.synchronize()  # the copy out of the engine's cache landed
                self._put(job.ns, job.token_ids, job.kv, job.first_block)
            except NotFound:
                logger.info("kvstore save of %s: its stored prefix is gone; the next save "
                            "puts it whole", job.req_id)
                self._done(job.req_id, job.num_bytes, ok=False)
            except KVStoreError as exc:  # a lost save is a later miss, not an engine error
                logger.warning("kvstore save of %s failed: %s", job.req_id, exc)
                self._done(job.req_id, job.num_bytes, ok=False)
            except Exception:  # never let the thread die: every request must be reported
                logger.exception("kvstore save of %s failed", job.req_id)
                self._done(job.req_id, job.num_bytes, ok=False)
            else:
                self._done(job.req_id, job.num_bytes, ok=True,
                           num_blocks=job.kv.shape[2] // job.ns.spec.block_tokens,
                           event=job.event)

    def _done(self, req_id: str, num_bytes: int, *, ok: bool, num_blocks: int = 0,
              event: Any = None) -> None:
        with self._lock:
            state = self._state
            state.queued_bytes -= num_bytes
            entry = state.requests.get(req_id)
            if entry is not None:
                entry.num_in_flight -= 1
                entry.restart = entry.restart or not ok
            if ok:
                if event is not None:
                    state.events.append(event)
                state.counters.saved_blocks += num_blocks
                state.counters.saved_bytes += num_bytes
            else:
                state.counters.failed_saves += 1
