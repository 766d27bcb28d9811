"""What a block occupies in a tier and what a tier needs freed to take a page."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.keys import BlockKey


@dataclass(frozen=True, slots=True)
class Footprint:
    """The space one stored block takes in its tier."""

    size_class: int  # blocks of one class free room for each other, one for one
    nbytes: int  # bytes charged against the tier's capacity


@dataclass(frozen=True, slots=True)
class RoomNeed:
    """What a tier must give up before a page fits: ``nbytes`` of charged space, taken only
    from blocks of ``size_class`` (None: any block's space helps) and, with ``tenant``, only
    from that tenant's blocks. ``keys``, when given, names exactly the blocks to give up (all
    of them, or none: a tier that frees memory only by whole pieces, such as an arena's chunk
    another tenant needs, says which blocks fill the piece)."""

    nbytes: int
    size_class: int | None = None
    tenant: str | None = None
    keys: frozenset[BlockKey] | None = None
