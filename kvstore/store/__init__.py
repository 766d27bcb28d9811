"""The tier manager (asyncio): a thin facade (``facade.Store``, the public verbs) over composed
parts: writes (``writes``), reads and advice (``reads``), the shared tier (``shared``),
placement on an ordered chain of tiers (``placement``), background demotion (``demotion``),
leases (``leases``) and reservations (``reservations``, pages checked by ``written``) over one
record of who holds what (``held``), prefetch hints (``hints``), counters, stats and eviction
(``inventory``), the block directory (``directory``) and get-side decoding (``decode``).

The store never names a tier: the chain comes from config, fastest first, and the store asks
each tier for its capabilities (``kvstore.tiers.base``). It knows nothing of the server.
"""

from kvstore.store.facade import Store

__all__ = ["Store"]
