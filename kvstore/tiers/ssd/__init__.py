"""The SSD tier: ``tier`` (Tier API, recovery, reads), ``writer``, ``segments``, ``index``."""
