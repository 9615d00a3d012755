from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("tenant", "job_id", "layers", "kv_heads", "head_dim", "dtype", "max_tokens", "top_k", "shared_memory", "attempt")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    job_id: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    max_tokens: int
    top_k: int
    shared_memory: bool
    attempt: int
    def __init__(self, tenant: _Optional[str] = ..., job_id: _Optional[str] = ..., layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., max_tokens: _Optional[int] = ..., top_k: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., attempt: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("transport", "segment", "segment_bytes")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    transport: str
    segment: str
    segment_bytes: int
    def __init__(self, transport: _Optional[str] = ..., segment: _Optional[str] = ..., segment_bytes: _Optional[int] = ...) -> None: ...

class PrefetchLayerRequest(_message.Message):
    __slots__ = ("tenant", "job_id", "layer", "step", "top_k", "token_indices", "rows")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INDICES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    job_id: str
    layer: int
    step: int
    top_k: int
    token_indices: _containers.RepeatedScalarFieldContainer[int]
    rows: int
    def __init__(self, tenant: _Optional[str] = ..., job_id: _Optional[str] = ..., layer: _Optional[int] = ..., step: _Optional[int] = ..., top_k: _Optional[int] = ..., token_indices: _Optional[_Iterable[int]] = ..., rows: _Optional[int] = ...) -> None: ...

class PrefetchLayerReply(_message.Message):
    __slots__ = ("slot", "k", "v")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    slot: int
    k: Tensor
    v: Tensor
    def __init__(self, slot: _Optional[int] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("k", "v", "shape", "dtype")
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    k: bytes
    v: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class BlockKey(_message.Message):
    __slots__ = ("tenant", "job_id", "layer", "kv_head")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    job_id: str
    layer: int
    kv_head: int
    def __init__(self, tenant: _Optional[str] = ..., job_id: _Optional[str] = ..., layer: _Optional[int] = ..., kv_head: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("key", "positions", "k", "v", "pin")
    KEY_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    key: BlockKey
    positions: _containers.RepeatedScalarFieldContainer[int]
    k: Tensor
    v: Tensor
    pin: bool
    def __init__(self, key: _Optional[_Union[BlockKey, _Mapping]] = ..., positions: _Optional[_Iterable[int]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., pin: _Optional[bool] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("rows", "bytes")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    bytes: int
    def __init__(self, rows: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "token_indices", "step")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INDICES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    key: BlockKey
    token_indices: _containers.RepeatedScalarFieldContainer[int]
    step: int
    def __init__(self, key: _Optional[_Union[BlockKey, _Mapping]] = ..., token_indices: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ...) -> None: ...

class GetReply(_message.Message):
    __slots__ = ("positions", "k", "v", "staged")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    k: Tensor
    v: Tensor
    staged: bool
    def __init__(self, positions: _Optional[_Iterable[int]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., staged: _Optional[bool] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("key", "step", "token_indices")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INDICES_FIELD_NUMBER: _ClassVar[int]
    key: BlockKey
    step: int
    token_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[_Union[BlockKey, _Mapping]] = ..., step: _Optional[int] = ..., token_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("tenant", "job_id", "keep")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    job_id: str
    keep: bool
    def __init__(self, tenant: _Optional[str] = ..., job_id: _Optional[str] = ..., keep: _Optional[bool] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("tenant", "job_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    job_id: str
    def __init__(self, tenant: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "blocks", "jobs", "pinned_jobs", "evictions", "hits", "misses", "prefetches", "prefetch_hits", "transport", "spilled", "reloaded")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    PINNED_JOBS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_HITS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    RELOADED_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    blocks: int
    jobs: int
    pinned_jobs: int
    evictions: int
    hits: int
    misses: int
    prefetches: int
    prefetch_hits: int
    transport: str
    spilled: int
    reloaded: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., jobs: _Optional[int] = ..., pinned_jobs: _Optional[int] = ..., evictions: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., prefetches: _Optional[int] = ..., prefetch_hits: _Optional[int] = ..., transport: _Optional[str] = ..., spilled: _Optional[int] = ..., reloaded: _Optional[int] = ...) -> None: ...
