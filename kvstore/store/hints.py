"""Prefetch hints: promote a queued request's stored prefix into the fastest tier before its
deadline. A hint lives until its blocks have landed, its deadline passes (``timeout`` and
``wait``), its request arrives (a lookup or acquire of the same prefix by the same tenant) or it
is cancelled (the request was dropped); every scheduled block ends counted once: landed, late or
cancelled. Blocks that could not arrive in time are never scheduled and count as skipped.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, Namespace
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.placement import Count, Link, Placement


class HintPolicy(enum.Enum):
    """What a hint does about its deadline."""

    BEST_EFFORT = "best_effort"  # return at once; promotions still running go on past it (late)
    TIMEOUT = "timeout"  # return at once; what has not landed at the deadline is given up
    WAIT = "wait"  # as timeout, but the call returns once the hint has ended: blocks landed


HINT_POLICIES = tuple(p.value for p in HintPolicy)


def hint_policy(name: str | HintPolicy) -> HintPolicy:
    """The policy called ``name`` (one of ``HINT_POLICIES``); InvalidArgument otherwise."""
    if isinstance(name, HintPolicy):
        return name
    try:
        return HintPolicy(name)
    except ValueError:
        raise InvalidArgument(f"hint policy must be one of {HINT_POLICIES}, got {name!r}"
                              ) from None


@dataclass(slots=True, eq=False)
class _Hint:
    tenant: str
    last_key: BlockKey  # the hinted prefix ends here: a request whose prefix covers it arrived
    plan: list[tuple[BlockEntry, Link]]
    num_landed: int = 0
    num_late: int = 0
    task: asyncio.Task[None] | None = None
    pending: list[int] = field(default_factory=list)  # bytes still queued per planned block


class Hints:
    """The pending hints of one store. Called from its event loop.

    Args:
        directory: the store's block directory.
        placement: moves blocks along the chain (``promote``) and knows each tier's path.
        count: adds to the store's counters for a tenant.
        spawn: runs a coroutine as one of the store's background tasks and returns the task
            (the store cancels it on close).
    """

    def __init__(self, directory: BlockDirectory, placement: Placement, count: Count,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]) -> None:
        self._dir = directory
        self._placement = placement
        self._count = count
        self._spawn = spawn
        self._by_tenant: dict[str, set[_Hint]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # running, or ended and not yet counted
        # The promotion of each block some hint is moving now: a hint that reaches a block
        # already on its way waits for that move instead of reading the block again (50 hints
        # of one prefix read it 50 times over, 2,230-2,745 SSD reads, before).
        self._moving: dict[BlockKey, asyncio.Task[bool]] = {}

    async def settle(self) -> None:
        """Wait until every hint started so far has ended and been counted, and the moves
        they started have finished."""
        while self._tasks or self._moving:
            await asyncio.wait(self._tasks | set(self._moving.values()))
            await asyncio.sleep(0)  # let the done callbacks count them

    async def hint(self, ns: Namespace, keys: list[BlockKey], deadline_s: float,
                   policy: HintPolicy = HintPolicy.BEST_EFFORT) -> int:
        """Schedule the prefix's blocks that can arrive before the deadline over their path
        (behind what is already queued on it), in prefix order.

        Returns:
            How many blocks were scheduled; with ``wait``, how many landed in time.
        """
        if deadline_s <= 0:
            raise InvalidArgument(f"deadline_s must be > 0, got {deadline_s}")
        plan, num_todo = self._plan(keys, deadline_s)
        self._count(ns.tenant, hint_blocks=len(plan), hint_skipped=num_todo - len(plan))
        if not plan:
            return 0
        hint = _Hint(ns.tenant, keys[-1], plan)
        hint.pending = [entry.sizes[source.name] for entry, source in plan]
        for (_, source), nbytes in zip(plan, hint.pending):  # later advice sees the queue
            source.path.queued_bytes += nbytes
        self._by_tenant.setdefault(ns.tenant, set()).add(hint)
        hint.task = task = self._spawn(self._run(hint, deadline_s, policy))
        self._tasks.add(task)
        # Counted when the task ends however it ends, even cancelled before it ran.
        task.add_done_callback(lambda _: self._end(hint))
        if policy is not HintPolicy.WAIT:
            return len(plan)
        await asyncio.wait({hint.task})  # the hint ends itself at the deadline
        return hint.num_landed

    def is_pending(self, tenant: str) -> bool:
        """Whether ``tenant`` has a hint still running."""
        return bool(self._by_tenant.get(tenant))

    def arrived(self, tenant: str, keys: Sequence[BlockKey]) -> int:
        """The tenant's request for ``keys`` arrived (or was dropped): end every pending hint
        whose prefix it covers; what had not landed is counted cancelled. Returns how many
        hints ended."""
        pending = self._by_tenant.get(tenant)
        if not pending or not keys:
            return 0
        covered = set(keys)
        ended = [h for h in pending if h.last_key in covered]
        for hint in ended:
            pending.discard(hint)
            if hint.task is not None:
                hint.task.cancel()
        if not pending:
            del self._by_tenant[tenant]
        return len(ended)

    def _plan(self, keys: list[BlockKey], deadline_s: float
              ) -> tuple[list[tuple[BlockEntry, Link]], int]:
        first = self._placement.links[0]
        todo = [e for e in self._dir.match_prefix(keys) if first.name not in e.sizes]
        plan: list[tuple[BlockEntry, Link]] = []
        arrival_s = 0.0
        for entry in todo:
            source = self._placement.fastest_holder(entry)
            arrival_s += source.path.time_s(entry.sizes[source.name])
            if arrival_s > deadline_s:
                break
            plan.append((entry, source))
        return plan, len(todo)

    async def _run(self, hint: _Hint, deadline_s: float, policy: HintPolicy) -> None:
        """Promote the plan in prefix order (``_end`` counts the outcome)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        target = self._placement.links[0]
        try:
            async with asyncio.timeout_at(None if policy is HintPolicy.BEST_EFFORT
                                          else deadline):
                for i, (entry, source) in enumerate(hint.plan):
                    landed = await self._promote_once(entry, target)
                    source.path.queued_bytes -= hint.pending[i]
                    hint.pending[i] = 0
                    if landed and loop.time() <= deadline:
                        hint.num_landed += 1
                    else:
                        hint.num_late += 1
        except TimeoutError:
            pass  # given up at the deadline: _end counts what had not moved as late

    async def _promote_once(self, entry: BlockEntry, target: Link) -> bool:
        """``placement.promote(entry, target)``, shared with every hint that reaches the block
        while it moves. The move is a store task of its own: a hint that ends (its request
        arrived) stops waiting for it, and the others still get it."""
        key = entry.meta.key
        move = self._moving.get(key)
        if move is None:
            move = self._moving[key] = self._spawn(self._placement.promote(entry, target))
            move.add_done_callback(lambda done: self._moved(key, done))
        return await asyncio.shield(move)

    def _moved(self, key: BlockKey, move: asyncio.Task[bool]) -> None:
        if self._moving.get(key) is move:
            del self._moving[key]
        if not move.cancelled():
            move.exception()  # retrieved: each waiting hint got it already

    def _end(self, hint: _Hint) -> None:
        """The hint's task ended: give back its queued bytes and count each block once."""
        self._tasks.discard(hint.task)  # type: ignore[arg-type]
        for (_, source), nbytes in zip(hint.plan, hint.pending):
            source.path.queued_bytes -= nbytes
        unfinished = sum(1 for nbytes in hint.pending if nbytes)
        hint.pending = [0] * len(hint.plan)
        pending = self._by_tenant.get(hint.tenant)
        was_pending = pending is not None and hint in pending
        if was_pending:  # ran to its end or its deadline
            pending.discard(hint)
            if not pending:
                del self._by_tenant[hint.tenant]
        # A hint ended by its request (or a cancel) counts what it had not moved as cancelled;
        # one that reached its deadline, as late.
        late = hint.num_late + (unfinished if was_pending else 0)
        self._count(hint.tenant, hint_landed=hint.num_landed, hint_late=late,
                    hint_cancelled=0 if was_pending else unfinished)
