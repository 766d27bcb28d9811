"""The DRAM tier: ``tier`` (the Tier API), ``staging``, ``growth``, ``lingering``, ``slabs``."""
