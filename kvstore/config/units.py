"""Units and places the configuration is written in: sizes with suffixes, fractions, the
runtime and cache directories, this host's memory."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from kvstore.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20, "mi": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "gi": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40, "ti": 1 << 40,
}
FSYNC_POLICIES = ("always", "batch", "never")
EVICTION_ORDERS = ("lru", "arc", "value")  # kvstore.policy.build_order's names


def parse_size(value: int | str, field_name: str = "size") -> int:
    """Bytes from an int or a string such as ``"4GiB"``; ConfigError names ``field_name``."""
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(str(value))
    if not match or (match.group(2) or "").lower() not in _SIZE_UNITS:
        raise ConfigError(f"{field_name}: cannot parse size {value!r} (try 512MiB, 4GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.access(base, os.W_OK):
        return Path(base) / "kvstore"
    return Path(tempfile.gettempdir()) / f"kvstore-{os.getuid()}"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstore"


def total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def check_fraction(owner: str, name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{owner}.{name} must be in (0, 1], got {value!r}")
