"""The tier manager (asyncio): a thin facade (``facade.Store``) over placement on an ordered
chain of tiers (``placement``), leases and reservations over any tier that lends slots
(``leases``), the block directory (``directory``) and get-side decoding (``decode``).

The store never names a tier: the chain comes from config, fastest first, and the store asks
each tier for its capabilities (``kvstore.tiers.base``). It knows nothing of the server.
"""

from kvstore.store.facade import Store

__all__ = ["Store"]
