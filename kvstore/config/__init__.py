"""Configuration: one frozen dataclass per concern, composed into KVStoreConfig.

The TOML file, ``KVSTORE_*`` environment variables and ``kvstore serve`` flags all map onto these
fields one way: ``[dram] capacity_bytes`` == ``KVSTORE_DRAM__CAPACITY_BYTES`` ==
``--set dram.capacity_bytes=...``. Sizes accept suffixes (``4GiB``, ``512MB``).

The tier chain: ``[dram]`` then ``[ssd]`` (if enabled) then ``[remote]`` (if its ``url`` is set),
fastest first, unless the file lists ``[[tiers]]`` tables, each with a ``name``, a ``kind``
(``dram``, ``ssd``, ``remote``) and that kind's fields; then those, in order.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.config.server import (
    DEFAULT_TENANT_RATE_BURST,
    DEFAULT_TENANT_RATE_RPS,
    EventsConfig,
    QuotaConfig,
    ServerConfig,
    TracingConfig,
)
from kvstore.config.tiers import (
    HBM_CODECS,
    REMOTE_MODES,
    REMOTE_SCHEMES,
    TIER_KINDS,
    DramConfig,
    HbmConfig,
    RemoteConfig,
    SsdConfig,
    TierConfig,
    TierKind,
    TierSettings,
    redact_url,
)
from kvstore.config.units import EVICTION_ORDERS, FSYNC_POLICIES, parse_size
from kvstore.errors import ConfigError

__all__ = [
    "DEFAULT_TENANT_RATE_BURST", "DEFAULT_TENANT_RATE_RPS", "EVICTION_ORDERS", "FSYNC_POLICIES", "HBM_CODECS", "REMOTE_MODES", "REMOTE_SCHEMES",
    "TIER_KINDS", "DramConfig", "EventsConfig", "HbmConfig", "KVStoreConfig", "QuotaConfig",
    "RemoteConfig", "ServerConfig", "SsdConfig", "TierConfig", "TierKind", "TierSettings",
    "TracingConfig", "config_from_mapping", "env_overrides", "load_config", "parse_assignments",
    "parse_size", "redact_url",
]


@dataclass(frozen=True, slots=True)
class KVStoreConfig:
    """Everything kvstore reads from configuration."""

    dram: DramConfig = field(default_factory=DramConfig)
    ssd: SsdConfig = field(default_factory=SsdConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    quota: QuotaConfig = field(default_factory=QuotaConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    # The chain, fastest first; empty: [dram], then [ssd] if enabled, then [remote] if it has a url.
    tiers: tuple[TierConfig, ...] = ()

    def __post_init__(self) -> None:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tiers: names must be unique, got {names}")

    def tier_chain(self) -> tuple[TierConfig, ...]:
        """The tiers a store walks, fastest first."""
        if self.tiers:
            return self.tiers
        chain = [TierConfig("dram", "dram", self.dram)]
        if self.ssd.enabled:
            chain.append(TierConfig("ssd", "ssd", self.ssd))
        if self.remote.url:
            chain.append(TierConfig("remote", "remote", self.remote))
        return tuple(chain)


_SECTIONS = {"dram": DramConfig, "ssd": SsdConfig, "server": ServerConfig,
             "quota": QuotaConfig, "remote": RemoteConfig, "tracing": TracingConfig,
             "events": EventsConfig}


def _coerce(section: str, name: str, value: Any, current: Any) -> Any:
    qual = f"{section}.{name}"
    if name.endswith("_bytes"):
        return parse_size(value, qual)
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{qual}: expected a boolean, got {value!r}")
    if isinstance(current, int):
        try:
            return int(value, 0) if isinstance(value, str) else int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{qual}: expected an integer, got {value!r}") from None
    if isinstance(current, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{qual}: expected a number, got {value!r}") from None
    if isinstance(current, dict):
        if isinstance(value, str):  # "tenantA=tok1,tenantB=tok2"
            pairs = [p.split("=", 1) for p in value.split(",") if p]
            if any(len(p) != 2 for p in pairs):
                raise ConfigError(f"{qual}: expected name=value pairs, got {value!r}")
            return {k.strip(): v.strip() for k, v in pairs}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{qual}: expected a table, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    return str(value)


def _apply(section: str, current: Any, values: Mapping[str, Any]) -> Any:
    """``current`` (a config dataclass) with ``values`` coerced onto its fields."""
    known = {f.name for f in dataclasses.fields(current)}
    changes = {}
    for name, value in values.items():
        if name not in known:
            raise ConfigError(f"unknown config field {section}.{name}; known: {sorted(known)}")
        changes[name] = _coerce(section, name, value, getattr(current, name))
    return dataclasses.replace(current, **changes)


def _tier_chain(tables: Any) -> tuple[TierConfig, ...]:
    """``[[tiers]]`` tables: each a name, a kind and that kind's fields."""
    if not isinstance(tables, (list, tuple)) or not all(isinstance(t, Mapping) for t in tables):
        raise ConfigError("tiers must be a list of tables ([[tiers]] in TOML)")
    chain = []
    for i, table in enumerate(tables):
        fields = dict(table)
        name, kind = str(fields.pop("name", "")), str(fields.pop("kind", ""))
        registered = TIER_KINDS.get(kind)
        if registered is None:
            raise ConfigError(f"tiers[{i}].kind must be one of {sorted(TIER_KINDS)}, "
                              f"got {kind!r}")
        chain.append(TierConfig(name, kind,
                                _apply(f"tiers.{name or i}", registered.settings(), fields)))
    return tuple(chain)


def config_from_mapping(data: Mapping[str, Any], base: KVStoreConfig | None = None) -> KVStoreConfig:
    """Apply ``{"dram": {...}, "ssd": {...}, "server": {...}, "tiers": [...]}`` on ``base``."""
    base = base or KVStoreConfig()
    sections: dict[str, Any] = {}
    for section, values in data.items():
        if section == "tiers":
            sections["tiers"] = _tier_chain(values)
            continue
        if section not in _SECTIONS:
            raise ConfigError(f"unknown config section {section!r}; expected "
                              f"{sorted([*_SECTIONS, 'tiers'])}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"config section {section!r} must be a table")
        sections[section] = _apply(section, getattr(base, section), values)
    return dataclasses.replace(base, **sections)


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """``KVSTORE_<SECTION>__<FIELD>`` variables as a config mapping."""
    environ = os.environ if environ is None else environ
    out: dict[str, dict[str, str]] = {}
    for name, value in environ.items():
        if not name.startswith("KVSTORE_") or "__" not in name:
            continue
        section, _, field_name = name[len("KVSTORE_"):].partition("__")
        out.setdefault(section.lower(), {})[field_name.lower()] = value
    return out


def parse_assignments(items: list[str]) -> dict[str, dict[str, str]]:
    """``["dram.capacity_bytes=1GiB", ...]`` as a config mapping."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, field_name = key.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"expected section.field=value, got {item!r}")
        out.setdefault(section, {})[field_name] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> KVStoreConfig:
    """Embedded defaults, then the TOML file, then the environment, then explicit overrides."""
    import tomllib

    config = KVStoreConfig()
    if path is not None:
        try:
            with open(path, "rb") as f:
                config = config_from_mapping(tomllib.load(f), config)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    config = config_from_mapping(env_overrides(environ), config)
    if overrides:
        config = config_from_mapping(overrides, config)
    return config
