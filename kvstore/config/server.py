"""The daemon's own settings: its sockets and limits, per-tenant quotas, request traces and KV
events."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.config.units import runtime_dir
from kvstore.errors import ConfigError


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

    socket_path: str = field(default_factory=lambda: str(runtime_dir() / "kvstore.sock"))
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
