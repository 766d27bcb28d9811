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
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

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


def _runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.access(base, os.W_OK):
        return Path(base) / "kvstore"
    return Path(tempfile.gettempdir()) / f"kvstore-{os.getuid()}"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstore"


def _total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def _check_fraction(owner: str, name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{owner}.{name} must be in (0, 1], got {value!r}")


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
        _check_fraction(section, "high_watermark", self.high_watermark)
        _check_fraction(section, "low_watermark", self.low_watermark)
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
    capacity_bytes: int = field(default_factory=lambda: min(_total_ram_bytes() // 8, 16 << 30))
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
    path: str = field(default_factory=lambda: str(_cache_dir() / "ssd"))
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
        _check_fraction("ssd", "compact_dead_fraction", self.compact_dead_fraction)


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
class QuotaConfig:
    """What one tenant may hold, so no tenant can flush or pin another's blocks.

    Quotas apply when ``server.tenant_tokens`` names two or more tenants (or ``tier_share`` is
    set): each tenant may fill ``tier_share`` of every tier (default: an equal share), and making
    room for a tenant's page evicts only that tenant's blocks, or blocks of tenants above their
    share.
    """

    tier_share: float = 0.0  # fraction of each tier per tenant; 0 = 1 / number of tenants
    max_open_leases: int = 1024  # leases one tenant may hold at once
    max_open_reservations: int = 256  # reservations one tenant may hold at once
    # Bytes of TTL-pinned blocks one tenant may hold (their pages in every tier holding them);
    # 0: a quarter of the tenant's share of the fastest tier, so pins leave three quarters of
    # it to the blocks that earn their place.
    pin_bytes: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.tier_share <= 1.0:
            raise ConfigError(f"quota.tier_share must be in [0, 1], got {self.tier_share!r}")
        if self.pin_bytes < 0:
            raise ConfigError(f"quota.pin_bytes must be >= 0, got {self.pin_bytes!r}")
        if self.max_open_leases < 1 or self.max_open_reservations < 1:
            raise ConfigError("quota.max_open_leases and quota.max_open_reservations must be >= 1")

    def pin_budget_bytes(self, num_tenants: int, fastest_tier_bytes: int) -> int:
        """Bytes of pinned blocks one tenant may hold (``pin_bytes`` or its default)."""
        if self.pin_bytes:
            return self.pin_bytes
        return int(fastest_tier_bytes * (self.share(num_tenants) or 1.0) / 4)

    def share(self, num_tenants: int) -> float | None:
        """The fraction of a tier each tenant may fill, or None when quotas are off."""
        if self.tier_share:
            return self.tier_share
        return 1.0 / num_tenants if num_tenants >= 2 else None


# The per-tenant call rate when several tenants share a daemon and the operator set none. An
# engine's scheduler makes 3-5 small calls per request (Lookup, Acquire and Release, or Reserve
# and Commit), so a tenant running a few busy engines (hundreds of requests/s each) stays under
# this; a tenant far above it is flooding, not serving. The burst (two seconds' worth) absorbs a
# scheduler step that admits a whole batch at once. It bounds calls, not what each costs.
DEFAULT_TENANT_RATE_RPS = 4000.0
DEFAULT_TENANT_RATE_BURST = 8000


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The sidecar daemon: sockets, auth, limits."""

    socket_path: str = field(default_factory=lambda: str(_runtime_dir() / "kvstore.sock"))
    socket_mode: int = 0o600
    tcp_address: str = ""  # "host:port" to also listen on TCP; "" for Unix socket only
    metrics_port: int = 0  # Prometheus HTTP port; 0 disables
    metrics_host: str = "127.0.0.1"
    # Distinct tenants (and models) a request metric keeps its own label for; later ones are
    # counted as "other", so clients naming new models cannot grow the registry without bound;
    # 0: no tenant or model labels (the metrics then name no tenant or model); -1: 32 when
    # tenant_tokens names at most one tenant, 0 when it names several (the endpoint has no
    # token: any process that reaches it would read the tenants' and models' names).
    metrics_max_label_values: int = -1
    tenant_tokens: dict[str, str] = field(default_factory=dict)  # tenant -> bearer token
    admin_token: str = ""  # sees and manages every tenant
    require_auth_on_unix: bool = False  # also demand tokens on the Unix socket
    max_message_bytes: int = 256 << 20
    lease_timeout_s: float = 30.0  # an Acquire lease expires after this
    shutdown_grace_s: float = 10.0
    log_level: str = "INFO"
    log_json: bool = True
    # Limits on what one caller can make the daemon hold (see DESIGN.md, "Security model").
    stream_idle_timeout_s: float = 10.0  # a request stream without progress this long ends
    max_request_tokens: int = 1 << 20  # tokens in one request (1 Mi: a 4 MiB tokens field)
    max_connections: int = 1024  # open connections per listening socket (Unix, TCP)
    # A connection that has not authenticated by then is closed: on TCP gRPC, no call with a
    # valid token yet; on the data and descriptor sockets, no hello or request.
    unauthenticated_timeout_s: float = 5.0
    max_streams_per_connection: int = 256  # concurrent calls on one connection; more queue
    max_concurrent_rpcs: int = 4096  # calls in progress at once; more get RESOURCE_EXHAUSTED
    # Calls per second per caller (tenant, else peer host); 0 = off; -1: off with at most one
    # tenant, DEFAULT_TENANT_RATE_RPS when tenant_tokens names several (one tenant's flood of
    # calls must not take the loop from the others unless the operator says so).
    rate_limit_rps: float = -1.0
    # Calls a caller may make at once; 0 = one second's worth (DEFAULT_TENANT_RATE_BURST when
    # the rate is the several-tenant default).
    rate_limit_burst: int = 0
    # The socket data path (rpc/framing.py): Put/Get tensor bytes over a plain socket beside
    # gRPC, under one-time tickets. Unix: <socket_path>.data; TCP (with tcp_address): data_port
    # on the same host, which must be exactly as private as the gRPC port.
    data_socket: bool = True
    data_port: int = 0  # TCP data port when tcp_address is set; 0 picks a free one
    max_data_transfers: int = 256  # tickets outstanding (and data connections) at once
    # Call channels (rpc/framing.py, server/channel.py): data connections that stay open and
    # carry Lookup, Acquire/Release and Reserve/Commit/Abort in frames outside gRPC, with the
    # same checks. Needs data_socket; clients fall back to gRPC where it is off.
    call_channel: bool = True
    # What readers that stop reading and writers that declare much may make the daemon hold
    # (server/slow_readers.py, server/put_bodies.py).
    max_channel_reply_bytes: int = 64 << 20  # unsent replies one call channel may queue
    max_tenant_reply_bytes: int = 256 << 20  # unsent replies of one tenant's channels together
    max_tenant_put_bytes: int = 512 << 20  # Put bodies one tenant may have in flight at once
    # True lets processes of the daemon's uid read and write its memory and descriptors
    # (/proc/<pid>/{fd,mem,maps}, ptrace: gdb, py-spy) and the kernel write core dumps: every
    # tenant's pages with them. For debugging only; see kvstore/dumpable.py.
    dumpable: bool = False

    @property
    def metric_label_values(self) -> int:
        """``metrics_max_label_values`` resolved: -1 is 32 with at most one tenant, else 0."""
        if self.metrics_max_label_values >= 0:
            return self.metrics_max_label_values
        return 32 if len(self.tenant_tokens) <= 1 else 0

    @property
    def rate_limit(self) -> tuple[float, int]:
        """``(calls/s, burst)`` per caller, ``rate_limit_rps``/``_burst`` resolved; (0, 0): off."""
        rate_per_s, burst = self.rate_limit_rps, self.rate_limit_burst
        if rate_per_s < 0:
            if len(self.tenant_tokens) <= 1:
                return 0.0, 0
            rate_per_s, burst = DEFAULT_TENANT_RATE_RPS, burst or DEFAULT_TENANT_RATE_BURST
        return rate_per_s, burst

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"server.metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.max_message_bytes < 1 << 20:
            raise ConfigError("server.max_message_bytes must be >= 1 MiB")
        if not -1 <= self.metrics_max_label_values <= 10_000:
            raise ConfigError(f"server.metrics_max_label_values must be in [-1, 10000] (0 = no "
                              f"tenant or model labels, -1 = by the number of tenants), "
                              f"got {self.metrics_max_label_values!r}")
        if not 0 < self.stream_idle_timeout_s <= 3600:
            raise ConfigError(f"server.stream_idle_timeout_s must be in (0, 3600] seconds, "
                              f"got {self.stream_idle_timeout_s!r}")
        for name in ("max_request_tokens", "max_connections", "max_streams_per_connection",
                     "max_concurrent_rpcs"):
            value = getattr(self, name)
            if not 1 <= value < 1 << 31:  # gRPC takes these as C ints
                raise ConfigError(f"server.{name} must be in [1, 2**31), got {value!r}")
        if not 0 < self.unauthenticated_timeout_s <= 3600:
            raise ConfigError(f"server.unauthenticated_timeout_s must be in (0, 3600] seconds, "
                              f"got {self.unauthenticated_timeout_s!r}")
        if not (0 <= self.rate_limit_rps <= 1e9 or self.rate_limit_rps == -1):
            raise ConfigError(f"server.rate_limit_rps must be in [0, 1e9] (0 = off) or -1 (the "
                              f"default with several tenants), got {self.rate_limit_rps!r}")
        if not 0 <= self.rate_limit_burst < 1 << 31:
            raise ConfigError(f"server.rate_limit_burst must be in [0, 2**31) (0 = one second "
                              f"of rate_limit_rps), got {self.rate_limit_burst!r}")
        if not 0 <= self.data_port <= 65535:
            raise ConfigError(f"server.data_port must be in [0, 65535] (0 = a free port), "
                              f"got {self.data_port!r}")
        if not 1 <= self.max_data_transfers <= 1 << 20:
            raise ConfigError(f"server.max_data_transfers must be in [1, 2**20], "
                              f"got {self.max_data_transfers!r}")
        for name in ("max_channel_reply_bytes", "max_tenant_reply_bytes",
                     "max_tenant_put_bytes"):
            value = getattr(self, name)
            if not 1 << 20 <= value <= 1 << 40:
                raise ConfigError(f"server.{name} must be in [1 MiB, 1 TiB] bytes, got {value!r}")
        if self.lease_timeout_s <= 0:
            raise ConfigError("server.lease_timeout_s must be > 0")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"server.log_level must be DEBUG/INFO/WARNING/ERROR, "
                              f"got {self.log_level!r}")


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
class TracingConfig:
    """OpenTelemetry spans of requests, exported over OTLP/gRPC (needs the ``tracing`` extra).

    Empty fields defer to OpenTelemetry's own variables, read as its SDK reads them:
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default
    ``http://localhost:4317``), ``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_HEADERS``.
    """

    enabled: bool = False
    otlp_endpoint: str = ""  # "http://host:4317" (plaintext) or "https://..."; "": OTEL_* env
    service_name: str = ""  # "": OTEL_SERVICE_NAME, else "kvstore"
    sample_ratio: float = 1.0  # of traces the daemon starts; a client's sampled parent wins

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"tracing.sample_ratio must be in [0, 1], got {self.sample_ratio!r}")


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV events (``kvstore.server.kv_events``): every block a tier stores or drops, published
    in vLLM's KV-event format on a ZMQ PUB socket for KV-aware routers, and as the
    tenant-filtered ``SubscribeEvents`` gRPC stream. Off by default.

    The ZMQ sockets have no authentication: they show every tenant's block hashes to whoever
    connects, so bind them to localhost or an ``ipc://`` path, or use them with one tenant.
    """

    enabled: bool = False  # collect events; serve SubscribeEvents; publish on zmq_endpoint
    # PUB endpoint ("" = gRPC stream only). zmq_mode "bind" binds it; "connect" connects to a
    # subscriber that binds (llm-d's indexer does); "auto" follows vLLM: bind when the
    # endpoint has a wildcard ("*", "::") or is ipc:// or inproc://, else connect.
    zmq_endpoint: str = "tcp://127.0.0.1:5557"
    zmq_mode: str = "bind"
    replay_endpoint: str = ""  # ROUTER socket answering replay requests ("" = none); binds
    topic: str = ""  # the first frame of every message; "{host}" is replaced by host
    host: str = ""  # this daemon's name in events; "" = the machine's host name
    block_hash: str = "int"  # "int": a key's low 64 bits (vLLM's int hashes); "bytes": all 16
    data_parallel_rank: int = 0  # sent in every batch, as vLLM's publishers do
    # Bounds, so a slow or dead subscriber never holds the daemon up (drops are counted):
    queue_events: int = 65536  # events collected and not yet published
    max_batch_events: int = 1024  # events in one published batch
    send_queue_batches: int = 10_000  # batches waiting for the ZMQ thread
    replay_batches: int = 10_000  # past batches a replay can return (vLLM's buffer_steps)
    zmq_hwm: int = 100_000  # messages ZMQ queues per subscriber (vLLM's default)
    subscriber_queue_batches: int = 1024  # batches a gRPC subscriber may fall behind by
    max_subscribers: int = 64  # SubscribeEvents streams open at once
    max_subscribers_per_tenant: int = 8  # of those, one tenant's (the admin counts as one)
    media: dict[str, str] = field(default_factory=dict)  # tier name -> medium, overriding
    # the kind's: hbm "GPU", dram "CPU", ssd "STORAGE" (vLLM's names), remote "REMOTE"

    def __post_init__(self) -> None:
        if self.zmq_mode not in ("bind", "connect", "auto"):
            raise ConfigError(f"events.zmq_mode must be bind, connect or auto, "
                              f"got {self.zmq_mode!r}")
        if self.block_hash not in ("int", "bytes"):
            raise ConfigError(f"events.block_hash must be int or bytes, got {self.block_hash!r}")
        for name in ("zmq_endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value and "://" not in value:
                raise ConfigError(f"events.{name} must be a ZMQ endpoint such as "
                                  f"tcp://127.0.0.1:5557 or ipc:///path, got {value!r}")
        if self.data_parallel_rank < 0:
            raise ConfigError(f"events.data_parallel_rank must be >= 0, "
                              f"got {self.data_parallel_rank!r}")
        for name in ("queue_events", "max_batch_events", "send_queue_batches", "replay_batches",
                     "zmq_hwm", "subscriber_queue_batches", "max_subscribers",
                     "max_subscribers_per_tenant"):
            if not 1 <= getattr(self, name) <= 1 << 24:
                raise ConfigError(f"events.{name} must be in [1, {1 << 24}], "
                                  f"got {getattr(self, name)!r}")



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
