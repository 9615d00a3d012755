from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVCrush(_message.Message):
    __slots__ = ("rep_fraction", "anchor", "bucket_rule")
    REP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    BUCKET_RULE_FIELD_NUMBER: _ClassVar[int]
    rep_fraction: float
    anchor: str
    bucket_rule: str
    def __init__(self, rep_fraction: _Optional[float] = ..., anchor: _Optional[str] = ..., bucket_rule: _Optional[str] = ...) -> None: ...

class Eviction(_message.Message):
    __slots__ = ("keep_tokens", "keep_ratio", "window", "pool_kernel", "scorer", "gqa_mode", "sink_tokens", "kvcrush", "span_tokens")
    KEEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    POOL_KERNEL_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    GQA_MODE_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KVCRUSH_FIELD_NUMBER: _ClassVar[int]
    SPAN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    keep_tokens: int
    keep_ratio: float
    window: int
    pool_kernel: int
    scorer: str
    gqa_mode: str
    sink_tokens: int
    kvcrush: KVCrush
    span_tokens: int
    def __init__(self, keep_tokens: _Optional[int] = ..., keep_ratio: _Optional[float] = ..., window: _Optional[int] = ..., pool_kernel: _Optional[int] = ..., scorer: _Optional[str] = ..., gqa_mode: _Optional[str] = ..., sink_tokens: _Optional[int] = ..., kvcrush: _Optional[_Union[KVCrush, _Mapping]] = ..., span_tokens: _Optional[int] = ...) -> None: ...

class Codebook(_message.Message):
    __slots__ = ("theta_k", "theta_v")
    THETA_K_FIELD_NUMBER: _ClassVar[int]
    THETA_V_FIELD_NUMBER: _ClassVar[int]
    theta_k: float
    theta_v: float
    def __init__(self, theta_k: _Optional[float] = ..., theta_v: _Optional[float] = ...) -> None: ...

class Merge(_message.Message):
    __slots__ = ("with_layer", "t", "retention_k", "retention_v")
    WITH_LAYER_FIELD_NUMBER: _ClassVar[int]
    T_FIELD_NUMBER: _ClassVar[int]
    RETENTION_K_FIELD_NUMBER: _ClassVar[int]
    RETENTION_V_FIELD_NUMBER: _ClassVar[int]
    with_layer: int
    t: float
    retention_k: float
    retention_v: float
    def __init__(self, with_layer: _Optional[int] = ..., t: _Optional[float] = ..., retention_k: _Optional[float] = ..., retention_v: _Optional[float] = ...) -> None: ...

class Quant(_message.Message):
    __slots__ = ("bits", "group_size", "residual")
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    bits: int
    group_size: int
    residual: int
    def __init__(self, bits: _Optional[int] = ..., group_size: _Optional[int] = ..., residual: _Optional[int] = ...) -> None: ...

class LayerPlan(_message.Message):
    __slots__ = ("layer", "eviction", "codebook", "merge", "quant")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    CODEBOOK_FIELD_NUMBER: _ClassVar[int]
    MERGE_FIELD_NUMBER: _ClassVar[int]
    QUANT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    eviction: Eviction
    codebook: Codebook
    merge: Merge
    quant: Quant
    def __init__(self, layer: _Optional[int] = ..., eviction: _Optional[_Union[Eviction, _Mapping]] = ..., codebook: _Optional[_Union[Codebook, _Mapping]] = ..., merge: _Optional[_Union[Merge, _Mapping]] = ..., quant: _Optional[_Union[Quant, _Mapping]] = ...) -> None: ...

class OffloadPlan(_message.Message):
    __slots__ = ("enabled", "low_bits", "group_size", "top_k", "recent_window", "sink_tokens", "value_group_size", "rerank")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    LOW_BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    RECENT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VALUE_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RERANK_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    low_bits: int
    group_size: int
    top_k: int
    recent_window: int
    sink_tokens: int
    value_group_size: int
    rerank: int
    def __init__(self, enabled: _Optional[bool] = ..., low_bits: _Optional[int] = ..., group_size: _Optional[int] = ..., top_k: _Optional[int] = ..., recent_window: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., value_group_size: _Optional[int] = ..., rerank: _Optional[int] = ...) -> None: ...

class CompressionPlan(_message.Message):
    __slots__ = ("plan_id", "strategy", "strategy_version", "model_fingerprint", "layers", "offload", "predicted_reserve_ratio", "predicted_retained_attention", "predicted_copy_retained_attention", "budget_met", "budget_floor_tokens", "predicted_kv_bytes", "budget_ratio", "budget_reason")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_RESERVE_RATIO_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_RETAINED_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_COPY_RETAINED_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MET_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FLOOR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_RATIO_FIELD_NUMBER: _ClassVar[int]
    BUDGET_REASON_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    strategy: str
    strategy_version: str
    model_fingerprint: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerPlan]
    offload: OffloadPlan
    predicted_reserve_ratio: float
    predicted_retained_attention: float
    predicted_copy_retained_attention: float
    budget_met: bool
    budget_floor_tokens: int
    predicted_kv_bytes: int
    budget_ratio: float
    budget_reason: str
    def __init__(self, plan_id: _Optional[str] = ..., strategy: _Optional[str] = ..., strategy_version: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerPlan, _Mapping]]] = ..., offload: _Optional[_Union[OffloadPlan, _Mapping]] = ..., predicted_reserve_ratio: _Optional[float] = ..., predicted_retained_attention: _Optional[float] = ..., predicted_copy_retained_attention: _Optional[float] = ..., budget_met: _Optional[bool] = ..., budget_floor_tokens: _Optional[int] = ..., predicted_kv_bytes: _Optional[int] = ..., budget_ratio: _Optional[float] = ..., budget_reason: _Optional[str] = ...) -> None: ...

class Budget(_message.Message):
    __slots__ = ("reserve_ratio", "kv_tokens", "adaptive")
    RESERVE_RATIO_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    reserve_ratio: float
    kv_tokens: int
    adaptive: Adaptive
    def __init__(self, reserve_ratio: _Optional[float] = ..., kv_tokens: _Optional[int] = ..., adaptive: _Optional[_Union[Adaptive, _Mapping]] = ...) -> None: ...

class Adaptive(_message.Message):
    __slots__ = ("floor_ratio", "min_retained")
    FLOOR_RATIO_FIELD_NUMBER: _ClassVar[int]
    MIN_RETAINED_FIELD_NUMBER: _ClassVar[int]
    floor_ratio: float
    min_retained: float
    def __init__(self, floor_ratio: _Optional[float] = ..., min_retained: _Optional[float] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...
