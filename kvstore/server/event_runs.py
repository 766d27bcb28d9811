"""Runs of block events: a stored chain in one tier, or removals from one tier, grouped for the
publishers (``kv_events.py`` for gRPC subscribers, ``vllm_events.py`` for vLLM's ZMQ format)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.keys import BlockKey
from kvstore.store.events import BlockEvent, EventKind


@dataclass(slots=True)
class EventRun:
    """Events in a row of one kind, tier and namespace (stored: one chain, parent first)."""

    first: BlockEvent
    keys: list[BlockKey] = field(default_factory=list)
    # Where the blocks' tokens are, when all have them: [array, start, end] stretches (a put's
    # blocks lie one after another in one array: one stretch for all of them).
    spans: list[list[Any]] = field(default_factory=list)

    def continues(self, event: BlockEvent) -> bool:
        """Whether ``event`` extends this run."""
        first = self.first
        if (event.kind is not first.kind or event.kind is EventKind.CLEARED
                or event.tier != first.tier or event.namespace != first.namespace
                or event.tenant != first.tenant):
            return False
        if event.kind is EventKind.REMOVED:
            return True
        return (event.parent == self.keys[-1] and event.block_tokens == first.block_tokens
                and (event.tokens is None) == (first.tokens is None))


def event_runs(events: Sequence[BlockEvent]) -> list[EventRun]:
    """``events`` grouped into runs, in order."""
    runs: list[EventRun] = []
    run: EventRun | None = None
    for event in events:
        if run is None or not run.continues(event):
            run = EventRun(event)
            runs.append(run)
        if event.meta is not None:
            run.keys.append(event.meta.key)
        tokens = event.tokens
        if tokens is None:
            continue
        start = event.token_start
        last = run.spans[-1] if run.spans else None
        if last is not None and last[0] is tokens and last[2] == start:
            last[2] = start + event.block_tokens
        else:
            run.spans.append([tokens, start, start + event.block_tokens])
    return runs


def hash_format(name: str) -> Callable[[bytes], int | bytes]:
    """A block key as a vLLM block hash: "int", its low 64 bits; "bytes", its 16 bytes."""
    if name == "bytes":
        return bytes
    return lambda key: int.from_bytes(key[8:], "big")


def run_tokens(run: EventRun) -> np.ndarray | None:
    """The token ids of a run's blocks in order (None when they are not known)."""
    if not run.spans:
        return None
    parts = [array[start:end] for array, start, end in run.spans]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
