"""Tiers: where encoded pages live. ``base`` holds the contract and the capabilities; each kind
is a module (``hbm``) or a package (``dram``, ``ssd``, ``remote``) whose ``tier`` module holds
it; ``kvstore.config.TIER_KINDS`` is the one registry that names the kinds, their settings and
their implementations, and ``build_tier`` makes the tier a chain link names."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvstore.config import TIER_KINDS

if TYPE_CHECKING:
    from kvstore.config import TierConfig
    from kvstore.tiers.base import Tier


def kinds() -> list[str]:
    """The tier kinds this build implements."""
    return list(TIER_KINDS)


def build_tier(link: TierConfig) -> Tier:
    """The tier of ``link.kind`` with ``link.settings``, named ``link.name``."""
    kind = TIER_KINDS.get(link.kind)
    if kind is None:
        raise ValueError(f"no tier implementation of kind {link.kind!r}")
    module, _, cls = kind.implementation.partition(":")
    return getattr(importlib.import_module(module), cls)(link.settings, name=link.name)
