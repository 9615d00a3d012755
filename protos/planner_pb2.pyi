from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelShape(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "num_query_heads", "head_dim", "fingerprint")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERY_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    num_query_heads: int
    head_dim: int
    fingerprint: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., num_query_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("job_id", "tenant", "strategy", "budget", "prompt_tokens", "model", "profile", "token_ids", "predict", "suffix_tokens", "new_tokens", "stats", "load", "precheck")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREDICT_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PRECHECK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tenant: str
    strategy: str
    budget: _common_pb2.Budget
    prompt_tokens: int
    model: ModelShape
    profile: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    predict: bool
    suffix_tokens: int
    new_tokens: int
    stats: ProbeStatistics
    load: KVLoad
    precheck: bool
    def __init__(self, job_id: _Optional[str] = ..., tenant: _Optional[str] = ..., strategy: _Optional[str] = ..., budget: _Optional[_Union[_common_pb2.Budget, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., model: _Optional[_Union[ModelShape, _Mapping]] = ..., profile: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., predict: _Optional[bool] = ..., suffix_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., stats: _Optional[_Union[ProbeStatistics, _Mapping]] = ..., load: _Optional[_Union[KVLoad, _Mapping]] = ..., precheck: _Optional[bool] = ...) -> None: ...

class KVLoad(_message.Message):
    __slots__ = ("budget_bytes", "free_bytes", "jobs", "itemsize", "chunk")
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    ITEMSIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    free_bytes: int
    jobs: int
    itemsize: int
    chunk: int
    def __init__(self, budget_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., jobs: _Optional[int] = ..., itemsize: _Optional[int] = ..., chunk: _Optional[int] = ...) -> None: ...

class ProbeStatistics(_message.Message):
    __slots__ = ("tokens", "window", "heads", "window_scores", "k_similar", "v_similar", "k_angle", "v_angle", "losses")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SCORES_FIELD_NUMBER: _ClassVar[int]
    K_SIMILAR_FIELD_NUMBER: _ClassVar[int]
    V_SIMILAR_FIELD_NUMBER: _ClassVar[int]
    K_ANGLE_FIELD_NUMBER: _ClassVar[int]
    V_ANGLE_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    window: int
    heads: int
    window_scores: bytes
    k_similar: _containers.RepeatedScalarFieldContainer[float]
    v_similar: _containers.RepeatedScalarFieldContainer[float]
    k_angle: _containers.RepeatedScalarFieldContainer[float]
    v_angle: _containers.RepeatedScalarFieldContainer[float]
    losses: StorageLosses
    def __init__(self, tokens: _Optional[int] = ..., window: _Optional[int] = ..., heads: _Optional[int] = ..., window_scores: _Optional[bytes] = ..., k_similar: _Optional[_Iterable[float]] = ..., v_similar: _Optional[_Iterable[float]] = ..., k_angle: _Optional[_Iterable[float]] = ..., v_angle: _Optional[_Iterable[float]] = ..., losses: _Optional[_Union[StorageLosses, _Mapping]] = ...) -> None: ...

class StorageLosses(_message.Message):
    __slots__ = ("fractions", "evict", "retained", "bits", "quant")
    FRACTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    QUANT_FIELD_NUMBER: _ClassVar[int]
    fractions: _containers.RepeatedScalarFieldContainer[float]
    evict: _containers.RepeatedScalarFieldContainer[float]
    retained: _containers.RepeatedScalarFieldContainer[float]
    bits: _containers.RepeatedScalarFieldContainer[int]
    quant: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, fractions: _Optional[_Iterable[float]] = ..., evict: _Optional[_Iterable[float]] = ..., retained: _Optional[_Iterable[float]] = ..., bits: _Optional[_Iterable[int]] = ..., quant: _Optional[_Iterable[float]] = ...) -> None: ...

class ListStrategiesRequest(_message.Message):
    __slots__ = ("check_model",)
    CHECK_MODEL_FIELD_NUMBER: _ClassVar[int]
    check_model: bool
    def __init__(self, check_model: _Optional[bool] = ...) -> None: ...

class StrategyInfo(_message.Message):
    __slots__ = ("name", "version", "description", "active", "probe_mode", "probe_losses", "cannot_compress")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PROBE_MODE_FIELD_NUMBER: _ClassVar[int]
    PROBE_LOSSES_FIELD_NUMBER: _ClassVar[int]
    CANNOT_COMPRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    description: str
    active: bool
    probe_mode: str
    probe_losses: bool
    cannot_compress: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., description: _Optional[str] = ..., active: _Optional[bool] = ..., probe_mode: _Optional[str] = ..., probe_losses: _Optional[bool] = ..., cannot_compress: _Optional[str] = ...) -> None: ...

class StrategyList(_message.Message):
    __slots__ = ("strategies", "active")
    STRATEGIES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    strategies: _containers.RepeatedCompositeFieldContainer[StrategyInfo]
    active: str
    def __init__(self, strategies: _Optional[_Iterable[_Union[StrategyInfo, _Mapping]]] = ..., active: _Optional[str] = ...) -> None: ...

class SetStrategyRequest(_message.Message):
    __slots__ = ("name", "definition", "activate")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEFINITION_FIELD_NUMBER: _ClassVar[int]
    ACTIVATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    definition: str
    activate: bool
    def __init__(self, name: _Optional[str] = ..., definition: _Optional[str] = ..., activate: _Optional[bool] = ...) -> None: ...

class DeleteStrategyRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...
