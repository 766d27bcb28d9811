from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_STORED: _ClassVar[KVEventKind]
    KV_EVENT_REMOVED: _ClassVar[KVEventKind]
    KV_EVENT_ALL_CLEARED: _ClassVar[KVEventKind]
KV_EVENT_STORED: KVEventKind
KV_EVENT_REMOVED: KVEventKind
KV_EVENT_ALL_CLEARED: KVEventKind

class KVSpec(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "dtype", "position_scheme")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    POSITION_SCHEME_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str
    position_scheme: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., position_scheme: _Optional[str] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("model_id", "revision", "adapter_id", "tenant", "spec", "tp_rank", "tp_size", "extra_salt", "cache_spec")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SALT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SPEC_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    revision: str
    adapter_id: str
    tenant: str
    spec: KVSpec
    tp_rank: int
    tp_size: int
    extra_salt: str
    cache_spec: bytes
    def __init__(self, model_id: _Optional[str] = ..., revision: _Optional[str] = ..., adapter_id: _Optional[str] = ..., tenant: _Optional[str] = ..., spec: _Optional[_Union[KVSpec, _Mapping]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., extra_salt: _Optional[str] = ..., cache_spec: _Optional[bytes] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("dtype", "shape", "total_bytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "packed")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    tokens: bytes
    packed: bool
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[bytes] = ..., packed: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_tokens", "matched_tokens", "tokens_per_tier", "keys", "advised_tokens", "cluster_tokens", "packed_keys")
    class TokensPerTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ClusterTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_TIER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ADVISED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    matched_tokens: int
    tokens_per_tier: _containers.ScalarMap[str, int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    advised_tokens: int
    cluster_tokens: _containers.ScalarMap[str, int]
    packed_keys: bytes
    def __init__(self, num_tokens: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., tokens_per_tier: _Optional[_Mapping[str, int]] = ..., keys: _Optional[_Iterable[bytes]] = ..., advised_tokens: _Optional[int] = ..., cluster_tokens: _Optional[_Mapping[str, int]] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace", "tokens", "tensor", "ticket")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    tokens: bytes
    tensor: TensorHeader
    ticket: bytes
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[bytes] = ..., tensor: _Optional[_Union[TensorHeader, _Mapping]] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class DataTicket(_message.Message):
    __slots__ = ("ticket", "unix_path", "tcp_port", "deadline", "total_bytes")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    UNIX_PATH_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    unix_path: str
    tcp_port: int
    deadline: float
    total_bytes: int
    def __init__(self, ticket: _Optional[bytes] = ..., unix_path: _Optional[str] = ..., tcp_port: _Optional[int] = ..., deadline: _Optional[float] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("tokens_written",)
    TOKENS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    tokens_written: int
    def __init__(self, tokens_written: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "chunk_bytes", "data_socket")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    tokens: bytes
    chunk_bytes: int
    data_socket: bool
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[bytes] = ..., chunk_bytes: _Optional[int] = ..., data_socket: _Optional[bool] = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("found", "matched_tokens", "tensor", "data")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    found: bool
    matched_tokens: int
    tensor: TensorHeader
    data: DataTicket
    def __init__(self, found: _Optional[bool] = ..., matched_tokens: _Optional[int] = ..., tensor: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[_Union[DataTicket, _Mapping]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[GetHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("tenant", "model_id", "keys", "everything", "revision", "adapter_id", "namespace")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EVERYTHING_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    everything: bool
    revision: str
    adapter_id: str
    namespace: bytes
    def __init__(self, tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., everything: _Optional[bool] = ..., revision: _Optional[str] = ..., adapter_id: _Optional[str] = ..., namespace: _Optional[bytes] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "num_blocks", "hits", "misses", "evictions", "corrupt", "rejected", "bytes_read", "bytes_written", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    evictions: int
    corrupt: int
    rejected: int
    bytes_read: int
    bytes_written: int
    extra: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt: _Optional[int] = ..., rejected: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "counters", "active_leases", "active_reservations", "num_blocks")
    class TiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TierStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TierStats, _Mapping]] = ...) -> None: ...
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.MessageMap[str, TierStats]
    counters: _containers.ScalarMap[str, int]
    active_leases: int
    active_reservations: int
    num_blocks: int
    def __init__(self, tiers: _Optional[_Mapping[str, TierStats]] = ..., counters: _Optional[_Mapping[str, int]] = ..., active_leases: _Optional[int] = ..., active_reservations: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "version", "uptime_s", "pid", "tenant", "is_admin", "arena_path", "call_channel")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    IS_ADMIN_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    CALL_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    status: str
    version: str
    uptime_s: float
    pid: int
    tenant: str
    is_admin: bool
    arena_path: str
    call_channel: bool
    def __init__(self, status: _Optional[str] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., pid: _Optional[int] = ..., tenant: _Optional[str] = ..., is_admin: _Optional[bool] = ..., arena_path: _Optional[str] = ..., call_channel: _Optional[bool] = ...) -> None: ...

class OpenChannelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CallError(_message.Message):
    __slots__ = ("details", "error", "retry_after_s")
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    details: str
    error: str
    retry_after_s: float
    def __init__(self, details: _Optional[str] = ..., error: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class ListBlocksRequest(_message.Message):
    __slots__ = ("tenant", "model_id", "tier", "limit")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model_id: str
    tier: str
    limit: int
    def __init__(self, tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., tier: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("key", "tenant", "model_id", "tiers", "size_bytes", "age_s", "hits", "block_index", "parent")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    tenant: str
    model_id: str
    tiers: _containers.RepeatedScalarFieldContainer[str]
    size_bytes: int
    age_s: float
    hits: int
    block_index: int
    parent: bytes
    def __init__(self, key: _Optional[bytes] = ..., tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., tiers: _Optional[_Iterable[str]] = ..., size_bytes: _Optional[int] = ..., age_s: _Optional[float] = ..., hits: _Optional[int] = ..., block_index: _Optional[int] = ..., parent: _Optional[bytes] = ...) -> None: ...

class ListBlocksResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "lease_s", "medium", "packed", "device", "release")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    tokens: bytes
    lease_s: float
    medium: str
    packed: bool
    device: str
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[bytes] = ..., lease_s: _Optional[float] = ..., medium: _Optional[str] = ..., packed: _Optional[bool] = ..., device: _Optional[str] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("medium", "regions", "keys", "region_index", "offsets", "lengths", "block_index", "parents")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REGION_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    medium: str
    regions: _containers.RepeatedScalarFieldContainer[str]
    keys: bytes
    region_index: bytes
    offsets: bytes
    lengths: bytes
    block_index: bytes
    parents: bytes
    def __init__(self, medium: _Optional[str] = ..., regions: _Optional[_Iterable[str]] = ..., keys: _Optional[bytes] = ..., region_index: _Optional[bytes] = ..., offsets: _Optional[bytes] = ..., lengths: _Optional[bytes] = ..., block_index: _Optional[bytes] = ..., parents: _Optional[bytes] = ...) -> None: ...

class SlotGrant(_message.Message):
    __slots__ = ("key", "block_index", "parent", "region", "offset", "capacity_bytes", "medium")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    block_index: int
    parent: bytes
    region: str
    offset: int
    capacity_bytes: int
    medium: str
    def __init__(self, key: _Optional[bytes] = ..., block_index: _Optional[int] = ..., parent: _Optional[bytes] = ..., region: _Optional[str] = ..., offset: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "deadline", "codec", "blocks", "table", "released", "sealed")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    deadline: float
    codec: str
    blocks: _containers.RepeatedCompositeFieldContainer[SlotGrant]
    table: BlockTable
    released: int
    sealed: bool
    def __init__(self, reservation_id: _Optional[str] = ..., deadline: _Optional[float] = ..., codec: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[SlotGrant, _Mapping]]] = ..., table: _Optional[_Union[BlockTable, _Mapping]] = ..., released: _Optional[int] = ..., sealed: _Optional[bool] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "ready_event")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    ready_event: bytes
    def __init__(self, reservation_id: _Optional[str] = ..., ready_event: _Optional[bytes] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("tokens_published",)
    TOKENS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    tokens_published: int
    def __init__(self, tokens_published: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    def __init__(self, reservation_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "lease_s", "medium", "packed", "first_block", "device", "release")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    tokens: bytes
    lease_s: float
    medium: str
    packed: bool
    first_block: int
    device: str
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[bytes] = ..., lease_s: _Optional[float] = ..., medium: _Optional[str] = ..., packed: _Optional[bool] = ..., first_block: _Optional[int] = ..., device: _Optional[str] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("key", "region", "offset", "length", "medium")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    region: str
    offset: int
    length: int
    medium: str
    def __init__(self, key: _Optional[bytes] = ..., region: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "deadline", "matched_tokens", "blocks", "codec", "table", "tier", "released")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    deadline: float
    matched_tokens: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    codec: str
    table: BlockTable
    tier: str
    released: int
    def __init__(self, lease_id: _Optional[str] = ..., deadline: _Optional[float] = ..., matched_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., codec: _Optional[str] = ..., table: _Optional[_Union[BlockTable, _Mapping]] = ..., tier: _Optional[str] = ..., released: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HintRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "deadline_s", "policy")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    tokens: bytes
    deadline_s: float
    policy: str
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[bytes] = ..., deadline_s: _Optional[float] = ..., policy: _Optional[str] = ...) -> None: ...

class HintResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class CancelHintRequest(_message.Message):
    __slots__ = ("namespace", "tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    tokens: bytes
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[bytes] = ...) -> None: ...

class CancelHintResponse(_message.Message):
    __slots__ = ("num_hints",)
    NUM_HINTS_FIELD_NUMBER: _ClassVar[int]
    num_hints: int
    def __init__(self, num_hints: _Optional[int] = ...) -> None: ...

class ModelProfile(_message.Message):
    __slots__ = ("num_params", "num_layers", "hidden_size", "flops_per_s")
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FLOPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    num_params: float
    num_layers: int
    hidden_size: int
    flops_per_s: float
    def __init__(self, num_params: _Optional[float] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., flops_per_s: _Optional[float] = ...) -> None: ...

class ReportPrefillRequest(_message.Message):
    __slots__ = ("namespace", "new_tokens", "cached_tokens", "seconds", "profile")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    new_tokens: int
    cached_tokens: int
    seconds: float
    profile: ModelProfile
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., new_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., profile: _Optional[_Union[ModelProfile, _Mapping]] = ...) -> None: ...

class ReportPrefillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class HoldEvent(_message.Message):
    __slots__ = ("server_time", "regions_retired")
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    REGIONS_RETIRED_FIELD_NUMBER: _ClassVar[int]
    server_time: float
    regions_retired: bool
    def __init__(self, server_time: _Optional[float] = ..., regions_retired: _Optional[bool] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    tokens: bytes
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[bytes] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinInfo(_message.Message):
    __slots__ = ("tenant", "model_id", "key", "num_blocks", "size_bytes", "expires_in_s")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model_id: str
    key: bytes
    num_blocks: int
    size_bytes: int
    expires_in_s: float
    def __init__(self, tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., key: _Optional[bytes] = ..., num_blocks: _Optional[int] = ..., size_bytes: _Optional[int] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("namespace", "tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    tokens: bytes
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[bytes] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("num_pins",)
    NUM_PINS_FIELD_NUMBER: _ClassVar[int]
    num_pins: int
    def __init__(self, num_pins: _Optional[int] = ...) -> None: ...

class ListPinsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ListPinsResponse(_message.Message):
    __slots__ = ("pins",)
    PINS_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[PinInfo]
    def __init__(self, pins: _Optional[_Iterable[_Union[PinInfo, _Mapping]]] = ...) -> None: ...

class SubscribeEventsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "keys", "parent", "tokens", "block_tokens", "first_block_index", "tier", "medium", "tenant", "model_id", "namespace")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    kind: KVEventKind
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    tokens: bytes
    block_tokens: int
    first_block_index: int
    tier: str
    medium: str
    tenant: str
    model_id: str
    namespace: bytes
    def __init__(self, kind: _Optional[_Union[KVEventKind, str]] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., block_tokens: _Optional[int] = ..., first_block_index: _Optional[int] = ..., tier: _Optional[str] = ..., medium: _Optional[str] = ..., tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., namespace: _Optional[bytes] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("ts", "seq", "events", "num_dropped", "host")
    TS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ts: float
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    num_dropped: int
    host: str
    def __init__(self, ts: _Optional[float] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., num_dropped: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...
