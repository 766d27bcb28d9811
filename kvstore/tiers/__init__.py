"""Tiers: where encoded pages live. ``base`` holds the contract and the capabilities; each tier
kind is one module (``dram``, ``ssd``, ``remote``); ``build_tier`` makes the tier a chain link names."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.config import TierConfig
    from kvstore.tiers.base import Tier


def build_tier(link: TierConfig) -> Tier:
    """The tier of ``link.kind`` with ``link.settings``, named ``link.name``."""
    if link.kind == "hbm":
        from kvstore.tiers.hbm import HbmTier

        return HbmTier(link.settings, name=link.name)
    if link.kind == "dram":
        from kvstore.tiers.dram import DramTier

        return DramTier(link.settings, name=link.name)
    if link.kind == "ssd":
        from kvstore.tiers.ssd import SsdTier

        return SsdTier(link.settings, name=link.name)
    if link.kind == "remote":
        from kvstore.tiers.remote import RemoteTier

        return RemoteTier(link.settings, name=link.name)
    raise ValueError(f"no tier implementation of kind {link.kind!r}")
