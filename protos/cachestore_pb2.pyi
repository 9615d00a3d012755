from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
    __slots__ = ("capacity_bytes", "used_bytes", "blocks", "jobs", "pinned_jobs", "evictions", "hits", "misses", "prefetches", "prefetch_hits", "transport")
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
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., jobs: _Optional[int] = ..., pinned_jobs: _Optional[int] = ..., evictions: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., prefetches: _Optional[int] = ..., prefetch_hits: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...
