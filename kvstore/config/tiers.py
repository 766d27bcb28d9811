"""The tiers' settings, one frozen dataclass per kind, and the one registry of tier kinds
(``TIER_KINDS``); a chain link (``TierConfig``) names a tier, its kind and its settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from kvstore.config.units import (
    EVICTION_ORDERS,
    FSYNC_POLICIES,
    cache_dir,
    check_fraction,
    total_ram_bytes,
)
from kvstore.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TierSettings:
    """What the store reads of every tier's settings, whatever its kind."""

    capacity_bytes: int = 0
    codec: str = "raw"  # codec chain for pages in this tier
    high_watermark: float = 1.0  # fraction of capacity above which blocks move down the chain
    low_watermark: float = 1.0  # ... until usage is below this fraction
    admit_after_accesses: int = 0  # a demoted block enters after this many sightings (0: any)
    admit_expected_keys: int = 1 << 16  # distinct keys the admission sketch is sized for
    persist_on_close: bool = False  # on shutdown, blocks held only in memory are written here
    # Prior of the cost model's read path out of this tier, refined online from real reads.
    read_bytes_per_s: float = 10e9
    read_fixed_s: float = 5e-6  # per read: submit, map, verify set-up
    eviction: str = "lru"  # which blocks go first: "lru", "arc" or "value" (cost model)
    write_through: bool = False  # new blocks are also copied here, in the background
    # The write-through backlog (kvstore.store.write_through): blocks waiting to be copied here,
    # bounded in bytes and in blocks; a new block that does not fit is dropped and counted
    # (it can still arrive by demotion), so a slow or dead tier never holds a put back. 256 MiB
    # is a quarter second of a 1 GB/s link to a shared store, which is also what draining it
    # at shutdown costs.
    write_through_queue_bytes: int = 256 << 20
    write_through_queue_blocks: int = 4096

    def _check_common(self, section: str) -> None:
        if self.capacity_bytes < 0:
            raise ConfigError(f"{section}.capacity_bytes must be >= 0, got {self.capacity_bytes}")
        check_fraction(section, "high_watermark", self.high_watermark)
        check_fraction(section, "low_watermark", self.low_watermark)
        if self.low_watermark > self.high_watermark:
            raise ConfigError(f"{section}.low_watermark must not exceed {section}.high_watermark")
        if self.admit_after_accesses < 0:
            raise ConfigError(f"{section}.admit_after_accesses must be >= 0")
        if self.admit_expected_keys < 1:
            raise ConfigError(
                f"{section}.admit_expected_keys must be >= 1, got {self.admit_expected_keys}")
        if self.read_bytes_per_s <= 0 or self.read_fixed_s < 0:
            raise ConfigError(f"{section}.read_bytes_per_s must be > 0 and "
                              f"{section}.read_fixed_s >= 0")
        if self.eviction not in EVICTION_ORDERS:
            raise ConfigError(f"{section}.eviction must be one of {EVICTION_ORDERS}, "
                              f"got {self.eviction!r}")
        if self.write_through_queue_bytes < 1 or self.write_through_queue_blocks < 1:
            raise ConfigError(f"{section}.write_through_queue_bytes and "
                              f"{section}.write_through_queue_blocks must be >= 1, got "
                              f"{self.write_through_queue_bytes} and "
                              f"{self.write_through_queue_blocks}")


# Codecs of device pools: those the engine kernels encode and decode
# (kvstore.codecs.device.ENCODABLE, kept equal by a test).
HBM_CODECS = ("raw", "fp8_e4m3", "nvfp4", "mxfp4")


@dataclass(frozen=True, slots=True)
class HbmConfig(TierSettings):
    """The GPU tier: one device pool per tenant, exported over CUDA IPC (``[[tiers]]`` only)."""

    capacity_bytes: int = 8 << 30  # device memory all pools on one GPU together may take
    # The GPUs of the tier, comma-separated ("cuda:0,cuda:1": a pool per tenant on each, each
    # GPU up to capacity_bytes); "cpu" (or "cpu:0,cpu:1", as if two devices) runs the tier on
    # host memory, for tests of the store's logic.
    device: str = "cuda:0"
    pool_bytes: int = 0  # each tenant's pool; 0: the whole capacity (one tenant per GPU)
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    # An H200 reads a device page into the engine's layout at about 3.9 TB/s (2026-12-01).
    read_bytes_per_s: float = 3.5e12
    read_fixed_s: float = 2e-5  # one kernel launch

    def __post_init__(self) -> None:
        self._check_common("hbm")
        if self.pool_bytes < 0 or self.pool_bytes > self.capacity_bytes:
            raise ConfigError(f"hbm.pool_bytes must be in [0, capacity_bytes], got "
                              f"{self.pool_bytes}")
        devices = self.device_list()
        if not devices or not all(_is_device(d) for d in devices):
            raise ConfigError(f"hbm.device must be 'cuda', 'cuda:N', a comma-separated list of "
                              f"those, or 'cpu', got {self.device!r}")
        if len(set(devices)) != len(devices) or len({d[:3] for d in devices}) > 1:
            raise ConfigError(f"hbm.device lists a device twice, or host and GPU devices "
                              f"together: {self.device!r}")
        if self.codec not in HBM_CODECS:
            raise ConfigError(f"hbm.codec must be one of {', '.join(HBM_CODECS)} (the codecs the "
                              f"engine kernels encode and decode), got {self.codec!r}")

    def device_list(self) -> list[str]:
        """The tier's devices, in order ("cuda" is "cuda:0")."""
        names = [d.strip() for d in self.device.split(",") if d.strip()]
        return ["cuda:0" if d == "cuda" else d for d in names]


def _is_device(name: str) -> bool:
    kind, colon, index = name.partition(":")
    if kind == "cpu" and not colon:
        return True
    return kind in ("cpu", "cuda") and colon == ":" and index.isdigit()


@dataclass(frozen=True, slots=True)
class DramConfig(TierSettings):
    """The shared-memory DRAM tier."""

    # Arena size; default 1/8 of physical RAM, at most 16 GiB, so a laptop stays usable.
    capacity_bytes: int = field(default_factory=lambda: min(total_ram_bytes() // 8, 16 << 30))
    high_watermark: float = 0.95  # fraction of capacity that starts demotion
    low_watermark: float = 0.85  # demotion stops below this fraction
    # Unused since arenas became memfds (one per tenant, no path); kept so configs still load.
    shm_dir: str = "/dev/shm"
    chunk_bytes: int = 64 << 20  # the arena grows (and pre-faults) this much at a time

    def __post_init__(self) -> None:
        self._check_common("dram")
        if self.chunk_bytes < 1 << 20:
            raise ConfigError(f"dram.chunk_bytes must be >= 1 MiB, got {self.chunk_bytes}")


@dataclass(frozen=True, slots=True)
class SsdConfig(TierSettings):
    """The SSD tier: append-only segment files plus an LMDB index."""

    enabled: bool = True
    path: str = field(default_factory=lambda: str(cache_dir() / "ssd"))
    capacity_bytes: int = 16 << 30  # bytes of live + dead segment data on disk
    # O_DIRECT reads of 2 MiB pages on the 2-core box: ~0.9 GB/s, ~0.1 ms each (2026-11-29).
    read_bytes_per_s: float = 0.9e9
    read_fixed_s: float = 1e-4
    segment_bytes: int = 256 << 20  # a segment file is sealed at this size
    # Segment file descriptors kept open (least recently used closed, reopened on demand):
    # 600 GB of 256 MiB segments is ~2300 files, past a 1024 soft limit.
    max_open_segments: int = 256
    fsync: str = "batch"  # "always": fsync before the index commit; "batch"; "never"
    fsync_interval_s: float = 0.05  # how often "batch" flushes
    o_direct: bool = True  # use O_DIRECT when the file system allows it
    admit_after_accesses: int = 2  # frequency filter: accesses a block needs to reach SSD
    compact_dead_fraction: float = 0.5  # a sealed segment this dead is rewritten
    index_map_bytes: int = 1 << 30  # LMDB map size (virtual; grows nothing on disk)
    persist_on_close: bool = True  # on shutdown, write DRAM-only blocks to SSD (bypasses the filter)

    def __post_init__(self) -> None:
        self._check_common("ssd")
        if self.segment_bytes < 64 << 10:
            raise ConfigError(f"ssd.segment_bytes must be >= 64 KiB, got {self.segment_bytes}")
        if self.max_open_segments < 1:
            raise ConfigError(f"ssd.max_open_segments must be >= 1, got {self.max_open_segments}")
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError(f"ssd.fsync must be one of {FSYNC_POLICIES}, got {self.fsync!r}")
        if self.fsync_interval_s <= 0:
            raise ConfigError("ssd.fsync_interval_s must be > 0")
        check_fraction("ssd", "compact_dead_fraction", self.compact_dead_fraction)


REMOTE_SCHEMES = ("redis", "rediss")
REMOTE_MODES = ("auto", "standalone", "cluster")


def redact_url(url: str) -> str:
    """``url`` with its password (or lone username-as-password) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None and not parts.username:
        return url
    user = parts.username or ""
    hidden = f"{user}:***" if parts.password is not None else "***"
    host = parts.hostname or ""
    netloc = f"{hidden}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True, slots=True)
class RemoteConfig(TierSettings):
    """The shared tier on a Redis or Valkey server or cluster that several hosts see.

    Time bounds: one attempt of an operation waits at most ``timeout_s``; a failed attempt is
    retried ``retries`` times with exponential backoff, so a call gives up (a miss, a refused
    write) within about ``(retries + 1) * timeout_s``. After ``breaker_failures`` calls in a row
    fail, the breaker opens and calls answer at once for ``breaker_reset_s``; then one trial
    call decides whether it closes again.
    """

    url: str = ""  # redis://[user:password@]host:port[/db]; rediss:// for TLS; "": no remote tier
    mode: str = "auto"  # "standalone", "cluster", or "auto" (asks the server at open)
    capacity_bytes: int = 1 << 30  # byte budget of pages this host keeps in the shared store
    ttl_s: float = 3600.0  # pages expire this long after they were written
    # Share by default: every new block is copied here in the background, so other hosts find
    # it at once. This costs the shared store's bandwidth and memory (every block this host
    # writes, within capacity_bytes and ttl_s); False: blocks arrive only when they are demoted
    # off the bottom of the local tiers, and other hosts rarely see them.
    write_through: bool = True
    key_prefix: str = "kvstore"  # every key starts with it (then the tenant's fingerprint)
    timeout_s: float = 0.25  # one attempt of one round trip, connect included
    retries: int = 1  # further attempts after a failed one
    backoff_base_s: float = 0.005  # first retry waits about this long, doubling after
    backoff_cap_s: float = 0.05  # ... but never longer than this
    breaker_failures: int = 5  # failed calls in a row that open the breaker
    breaker_reset_s: float = 2.0  # how long an open breaker answers at once
    max_connections: int = 32  # connection pool size (per node for a cluster)
    pipeline_bytes: int = 16 << 20  # a batch is sent in pipelines of about this many bytes
    max_probe_keys: int = 4096  # keys one prefix probe asks about (256k tokens of 64)
    directory: bool = True  # publish which blocks this host holds locally (kvstore ls --cluster)
    host_id: str = ""  # this host in the directory; "": hostname and process id
    host_ttl_s: float = 15.0  # a host's directory entries vanish this long after it stops
    directory_flush_s: float = 0.2  # directory changes are written in batches this often

    def __post_init__(self) -> None:
        self._check_common("remote")
        if self.url:
            scheme = urlsplit(self.url).scheme
            if scheme not in REMOTE_SCHEMES or not urlsplit(self.url).hostname:
                raise ConfigError(f"remote.url must be redis://host:port or rediss://host:port, "
                                  f"got {redact_url(self.url)!r}")
        if self.mode not in REMOTE_MODES:
            raise ConfigError(f"remote.mode must be one of {REMOTE_MODES}, got {self.mode!r}")
        for name in ("ttl_s", "timeout_s", "breaker_reset_s", "host_ttl_s", "directory_flush_s"):
            if not 0 < getattr(self, name) <= 30 * 86400:
                raise ConfigError(f"remote.{name} must be in (0, 2592000] seconds, "
                                  f"got {getattr(self, name)!r}")
        if not 0 <= self.retries <= 10:
            raise ConfigError(f"remote.retries must be in [0, 10], got {self.retries}")
        if not 0 <= self.backoff_base_s <= self.backoff_cap_s <= 10:
            raise ConfigError("remote.backoff_base_s must be in [0, remote.backoff_cap_s] and "
                              "remote.backoff_cap_s at most 10 seconds")
        if self.breaker_failures < 1 or self.max_connections < 1 or self.max_probe_keys < 1:
            raise ConfigError("remote.breaker_failures, remote.max_connections and "
                              "remote.max_probe_keys must be >= 1")
        if self.pipeline_bytes < 1 << 20:
            raise ConfigError(f"remote.pipeline_bytes must be >= 1 MiB, got {self.pipeline_bytes}")
        if not self.key_prefix or any(c in self.key_prefix for c in ":{} "):
            raise ConfigError(f"remote.key_prefix must be non-empty without ':', braces or "
                              f"spaces, got {self.key_prefix!r}")

    @property
    def safe_url(self) -> str:
        """The URL as logs and stats may show it (no password)."""
        return redact_url(self.url)



@dataclass(frozen=True, slots=True)
class TierKind:
    """A kind of tier: the settings its ``[[tiers]]`` table takes, and where its implementation
    lives (``"module:Class"``, imported by ``kvstore.tiers.build_tier`` only when a chain names
    the kind, so an optional dependency (CUDA, lmdb, redis) costs only the kinds that need it)."""

    settings: type[TierSettings]
    implementation: str


# The one registry of tier kinds. Adding a kind: its settings class above, its module under
# kvstore/tiers/, and one line here.
TIER_KINDS: dict[str, TierKind] = {
    "hbm": TierKind(HbmConfig, "kvstore.tiers.hbm:HbmTier"),
    "dram": TierKind(DramConfig, "kvstore.tiers.dram.tier:DramTier"),
    "ssd": TierKind(SsdConfig, "kvstore.tiers.ssd.tier:SsdTier"),
    "remote": TierKind(RemoteConfig, "kvstore.tiers.remote.tier:RemoteTier"),
}



@dataclass(frozen=True, slots=True)
class TierConfig:
    """One link of the tier chain: its name (in stats, listings, ``tokens_per_tier``), its kind
    (which tier implementation; a key of ``TIER_KINDS``) and that kind's settings."""

    name: str
    kind: str
    settings: TierSettings

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"tiers: name {self.name!r} must be letters, digits, - or _")
        kind = TIER_KINDS.get(self.kind)
        if kind is None:
            raise ConfigError(f"tiers.{self.name}.kind must be one of {sorted(TIER_KINDS)}, "
                              f"got {self.kind!r}")
        cls = kind.settings
        if not isinstance(self.settings, cls):
            raise ConfigError(f"tiers.{self.name}: a {self.kind} tier takes {cls.__name__}")
