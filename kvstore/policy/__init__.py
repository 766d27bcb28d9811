"""Eviction orders and admission rules; ``build_order`` makes the order a tier's settings name."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore.errors import InvalidArgument
from kvstore.policy.arc import ArcOrder
from kvstore.policy.base import EvictionOrder
from kvstore.policy.history import UseHistory
from kvstore.policy.lru import LruOrder
from kvstore.policy.value import SavedSeconds, ValueOrder

ORDER_NAMES = ("lru", "arc", "value")


def build_order(name: str, saved_s: SavedSeconds | None = None,
                clock: Callable[[], float] = time.monotonic,
                history: UseHistory | None = None, rank: int | None = None) -> EvictionOrder:
    """The eviction order called ``name`` (one of ``ORDER_NAMES``).

    Args:
        name: "lru", "arc" or "value".
        saved_s: what a hit in the tier saves; the value order needs it.
        clock: seconds, monotonic, for the orders that weigh time.
        history: the access history the value orders of one chain share (one per chain, so a
            block keeps its history as it moves down); None: the order keeps its own.
        rank: the tier's position in the chain (0 = fastest), for the value order: a copy a
            faster tier also holds is a backup there.
    """
    if name == "lru":
        return LruOrder()
    if name == "arc":
        return ArcOrder(clock=clock)
    if name == "value":
        if saved_s is None:
            raise InvalidArgument("the value order needs saved_s: what a hit in the tier saves")
        return ValueOrder(saved_s, clock=clock, history=history, rank=rank)
    raise InvalidArgument(f"eviction order must be one of {ORDER_NAMES}, got {name!r}")


__all__ = ["ORDER_NAMES", "ArcOrder", "EvictionOrder", "LruOrder", "UseHistory", "ValueOrder", "build_order"]
