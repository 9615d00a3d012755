from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    QUEUED: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    DONE: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
QUEUED: JobState
RUNNING: JobState
DONE: JobState
FAILED: JobState
CANCELLED: JobState

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "question", "max_new_tokens", "temperature", "top_p", "seed", "strategy", "budget", "tenant", "profile", "ignore_eos", "raw_prompt", "stop", "top_logprobs", "min_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    question: str
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    strategy: str
    budget: _common_pb2.Budget
    tenant: str
    profile: str
    ignore_eos: bool
    raw_prompt: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    top_logprobs: int
    min_tokens: int
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., question: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., strategy: _Optional[str] = ..., budget: _Optional[_Union[_common_pb2.Budget, _Mapping]] = ..., tenant: _Optional[str] = ..., profile: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., raw_prompt: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., top_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class LayerStats(_message.Message):
    __slots__ = ("layer", "kept_tokens", "kv_bytes", "full_kv_bytes", "kind")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    FULL_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kept_tokens: int
    kv_bytes: int
    full_kv_bytes: int
    kind: str
    def __init__(self, layer: _Optional[int] = ..., kept_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., full_kv_bytes: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("text", "strategy", "plan_id", "prompt_tokens", "generated_tokens", "kv_bytes", "full_kv_bytes", "reserve_ratio", "prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s", "degraded", "per_layer", "finish_reason", "executor_id", "storage_dtype", "offload", "budget_met", "budget_floor_tokens", "queue_s", "ttft_s", "kv_reserved_bytes", "predicted_kv_bytes", "budget_ratio", "budget_reason", "shrinks", "logprobs", "kv_risk", "kv_at_risk")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    FULL_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_RATIO_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    STORAGE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MET_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FLOOR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_RATIO_FIELD_NUMBER: _ClassVar[int]
    BUDGET_REASON_FIELD_NUMBER: _ClassVar[int]
    SHRINKS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_RISK_FIELD_NUMBER: _ClassVar[int]
    KV_AT_RISK_FIELD_NUMBER: _ClassVar[int]
    text: str
    strategy: str
    plan_id: str
    prompt_tokens: int
    generated_tokens: int
    kv_bytes: int
    full_kv_bytes: int
    reserve_ratio: float
    prefill_s: float
    decode_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    degraded: bool
    per_layer: _containers.RepeatedCompositeFieldContainer[LayerStats]
    finish_reason: str
    executor_id: str
    storage_dtype: str
    offload: OffloadStats
    budget_met: bool
    budget_floor_tokens: int
    queue_s: float
    ttft_s: float
    kv_reserved_bytes: int
    predicted_kv_bytes: int
    budget_ratio: float
    budget_reason: str
    shrinks: _containers.RepeatedCompositeFieldContainer[Shrink]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    kv_risk: float
    kv_at_risk: bool
    def __init__(self, text: _Optional[str] = ..., strategy: _Optional[str] = ..., plan_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., full_kv_bytes: _Optional[int] = ..., reserve_ratio: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., degraded: _Optional[bool] = ..., per_layer: _Optional[_Iterable[_Union[LayerStats, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., executor_id: _Optional[str] = ..., storage_dtype: _Optional[str] = ..., offload: _Optional[_Union[OffloadStats, _Mapping]] = ..., budget_met: _Optional[bool] = ..., budget_floor_tokens: _Optional[int] = ..., queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., kv_reserved_bytes: _Optional[int] = ..., predicted_kv_bytes: _Optional[int] = ..., budget_ratio: _Optional[float] = ..., budget_reason: _Optional[str] = ..., shrinks: _Optional[_Iterable[_Union[Shrink, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., kv_risk: _Optional[float] = ..., kv_at_risk: _Optional[bool] = ...) -> None: ...

class Shrink(_message.Message):
    __slots__ = ("ratio", "generated_tokens", "kv_bytes_before", "kv_bytes_after", "reserved_before", "reserved_after")
    RATIO_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_AFTER_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_AFTER_FIELD_NUMBER: _ClassVar[int]
    ratio: float
    generated_tokens: int
    kv_bytes_before: int
    kv_bytes_after: int
    reserved_before: int
    reserved_after: int
    def __init__(self, ratio: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., kv_bytes_before: _Optional[int] = ..., kv_bytes_after: _Optional[int] = ..., reserved_before: _Optional[int] = ..., reserved_after: _Optional[int] = ...) -> None: ...

class OffloadStats(_message.Message):
    __slots__ = ("transport", "low_bits", "group_size", "top_k", "recent_window", "host_kv_bytes", "prefetches", "in_time", "late", "bytes_fetched", "stall_s", "error", "rerank")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LOW_BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    RECENT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    IN_TIME_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RERANK_FIELD_NUMBER: _ClassVar[int]
    transport: str
    low_bits: int
    group_size: int
    top_k: int
    recent_window: int
    host_kv_bytes: int
    prefetches: int
    in_time: int
    late: int
    bytes_fetched: int
    stall_s: float
    error: str
    rerank: int
    def __init__(self, transport: _Optional[str] = ..., low_bits: _Optional[int] = ..., group_size: _Optional[int] = ..., top_k: _Optional[int] = ..., recent_window: _Optional[int] = ..., host_kv_bytes: _Optional[int] = ..., prefetches: _Optional[int] = ..., in_time: _Optional[int] = ..., late: _Optional[int] = ..., bytes_fetched: _Optional[int] = ..., stall_s: _Optional[float] = ..., error: _Optional[str] = ..., rerank: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state", "executor_id", "attempts", "generated_tokens", "error", "result", "submitted_at", "error_field")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    executor_id: str
    attempts: int
    generated_tokens: int
    error: str
    result: JobResult
    submitted_at: float
    error_field: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., executor_id: _Optional[str] = ..., attempts: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., error: _Optional[str] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ..., submitted_at: _Optional[float] = ..., error_field: _Optional[str] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("phase", "done", "total")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    phase: str
    done: int
    total: int
    def __init__(self, phase: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job_id", "attempt", "status", "progress", "delta", "result")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    status: JobStatus
    progress: Progress
    delta: TokenDelta
    result: JobResult
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., status: _Optional[_Union[JobStatus, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ...) -> None: ...
