"""What a strategy plans from: the job's budget and the model's shape, validated, and for probing
strategies a lazy probe of the job's tokens (or its profile's learned budget shares)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvcore.request import InvalidRequest, adaptive_of, validate_budget
from protos import planner_pb2


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    num_query_heads: int
    head_dim: int
    fingerprint: str = ""


@dataclass(frozen=True)
class PlanInput:
    job_id: str
    strategy: str                  # resolved name, never empty
    prompt_tokens: int
    model: ModelShape
    reserve_ratio: float | None = None   # exactly one of reserve_ratio / kv_tokens is set
    kv_tokens: int | None = None
    profile: str = ""
    tenant: str = ""
    probe: Callable[..., "ProbeStats"] | None = None     # lazy: calling it probes the job's tokens (keywords go
                                                        # to Prober.probe: gqa_mode, losses); None: no tokens
    layer_shares: tuple[float, ...] | None = None       # the job's profile's per-layer budget shares [m]: plan
                                                        # from these instead of probing
    learn: Callable[[np.ndarray], None] | None = None   # told the shares [m] a probed allocation chose
    suffix_tokens: int = 0         # tokens prefilled after compression (a query_agnostic question)
    new_tokens: int = 0            # most tokens the job generates; the budget holds these rows too
                                   # (planner.budget)
    adaptive: tuple[float, float] | None = None   # an adaptive budget's (floor_ratio, min_retained; 0: unset)

    @property
    def target_ratio(self) -> float:
        """The budget as a share of the full cache (token budgets above the prompt cap at 1)."""
        if self.reserve_ratio is not None:
            return self.reserve_ratio
        return min(1.0, self.kv_tokens / max(1, self.prompt_tokens))


# The largest model a plan request may describe (SmolLM2-135M: 30 layers, 9/3 heads, head dim 64;
# the largest open models stay well inside): a plan and its budget arithmetic grow with these.
MODEL_LIMITS = {"num_layers": 512, "num_kv_heads": 256, "num_query_heads": 1024, "head_dim": 1024}
MAX_TOKENS = 131072        # prompt + suffix + new tokens, the default of KVPLAN_PLANNER_MAX_TOKENS


def parse(req: planner_pb2.PlanRequest, strategy: str, max_tokens: int = MAX_TOKENS) -> PlanInput:
    """Every field checked and bounded before any planning: the model's shape (MODEL_LIMITS) and
    the tokens the job holds (at most `max_tokens` together) bound the work a plan costs."""
    for name in ("job_id", "strategy", "profile", "tenant"):       # logged and used in keys: no control characters
        value = getattr(req, name)
        if len(value) > 128 or not value.isprintable():
            raise InvalidRequest(name, "must be at most 128 printable characters")
    m = req.model
    for name, limit in MODEL_LIMITS.items():
        if not 1 <= getattr(m, name) <= limit:
            raise InvalidRequest(f"model.{name}", f"must be in [1, {limit}], got {getattr(m, name)}")
    if m.num_query_heads % m.num_kv_heads:
        raise InvalidRequest("model.num_query_heads", "must be a multiple of model.num_kv_heads")
    total = 0
    for name in ("prompt_tokens", "suffix_tokens", "new_tokens"):
        n = getattr(req, name)
        if n < 0:
            raise InvalidRequest(name, f"must be >= 0, got {n}")
        total += n
        if total > max_tokens:
            raise InvalidRequest(name, f"prompt_tokens + suffix_tokens + new_tokens must be <= {max_tokens}, "
                                       f"got {total}{'' if name == 'prompt_tokens' else ' or more'}")
    if req.token_ids and len(req.token_ids) != req.prompt_tokens and not (req.precheck and
                                                                        len(req.token_ids) < req.prompt_tokens):
        raise InvalidRequest("token_ids", f"has {len(req.token_ids)} ids, prompt_tokens says {req.prompt_tokens}"
                                          + (" (a precheck: at most that many, its prefix)" if req.precheck else ""))
    if req.token_ids and min(req.token_ids) < 0:
        raise InvalidRequest("token_ids", f"must be >= 0, got {min(req.token_ids)}")
    ratio, tokens = validate_budget(req.budget)
    adaptive = adaptive_of(req.budget)
    if req.HasField("load"):
        for name in ("budget_bytes", "free_bytes", "jobs", "itemsize", "chunk"):
            if getattr(req.load, name) < 0:
                raise InvalidRequest(f"load.{name}", f"must be >= 0, got {getattr(req.load, name)}")
        if req.load.itemsize > 8:
            raise InvalidRequest("load.itemsize", f"must be at most 8 bytes, got {req.load.itemsize}")
    return PlanInput(
        job_id=req.job_id, strategy=strategy, prompt_tokens=int(req.prompt_tokens),
        model=ModelShape(m.num_layers, m.num_kv_heads, m.num_query_heads, m.head_dim, m.fingerprint),
        reserve_ratio=ratio, kv_tokens=tokens, profile=req.profile, tenant=req.tenant,
        suffix_tokens=int(req.suffix_tokens), new_tokens=int(req.new_tokens), adaptive=adaptive,
    )
