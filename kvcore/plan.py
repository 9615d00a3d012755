"""The plan contract as frozen dataclasses, mirroring `kvplan.v1.CompressionPlan` field by field.

The planner builds these, the executor obeys them; `to_proto`/`from_proto` cross the wire.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from protos import common_pb2


@dataclass(frozen=True)
class KVCrush:
    rep_fraction: float = 0.25
    anchor: str = "random"
    bucket_rule: str = "uniform"


@dataclass(frozen=True)
class Eviction:
    keep_tokens: int | None = None
    keep_ratio: float | None = None
    window: int = 32
    pool_kernel: int = 7
    scorer: str = "snapkv"
    gqa_mode: str = "mean"
    sink_tokens: int = 0
    kvcrush: KVCrush | None = None
    span_tokens: int = 0      # copy span (kvcore/scoring.py `spread`); 0 = off, as in the papers


@dataclass(frozen=True)
class Codebook:
    theta_k: float = 0.98
    theta_v: float = 0.95


@dataclass(frozen=True)
class Merge:
    with_layer: int = 0
    t: float = 0.6
    retention_k: float = 0.05
    retention_v: float = 0.05


@dataclass(frozen=True)
class Quant:
    bits: int = 4
    group_size: int = 32
    residual: int = 32


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    eviction: Eviction | None = None
    codebook: Codebook | None = None
    merge: Merge | None = None
    quant: Quant | None = None

    @property
    def kind(self) -> str:
        """The cache-layer kind the executor builds for this layer (a registry key). Parts that
        stack (merge, quant) name their own kinds, so an executor without them refuses the plan
        instead of ignoring a part."""
        if self.merge:
            return "merge"
        if self.quant:
            return "quant"
        if self.codebook:
            return "codebook"
        if self.eviction:
            return "evicted"
        return "full"


@dataclass(frozen=True)
class OffloadPlan:
    enabled: bool = False
    low_bits: int = 2
    group_size: int = 32
    top_k: int = 64
    recent_window: int = 32
    sink_tokens: int = 4
    value_group_size: int = 64     # channels sharing a value scale (keys: group_size tokens per channel)
    rerank: int = 4                # prefetch: rerank x top_k low-bit candidates, re-ranked by exact keys (1: SpeCache's own)

    @property
    def candidates(self) -> int:
        """Rows per KV head a prefetch gathers: top_k, times `rerank` when it re-ranks (> 1)."""
        return self.top_k * max(self.rerank, 1)


@dataclass(frozen=True)
class CompressionPlan:
    plan_id: str
    strategy: str
    layers: tuple[LayerPlan, ...]
    strategy_version: str = "1"
    model_fingerprint: str = ""
    offload: OffloadPlan = field(default_factory=OffloadPlan)
    predicted_reserve_ratio: float = 1.0
    predicted_retained_attention: float = 1.0         # planner/predict.py; 1.0: not predicted
    predicted_copy_retained_attention: float = 1.0    # its copy-aware form; 1.0: not predicted
    budget_met: bool | None = None    # holds the job's budget at every step; None: not judged (planner/budget.py)
    budget_floor_tokens: int = 0      # fewest prompt tokens per KV head the plan keeps in a layer
    predicted_kv_bytes: int = 0       # the most its cache holds at any step of the job (kvcore.plan_cost); 0: not stated
    budget_ratio: float = 0.0         # adaptive budget: the reserve ratio chosen for the load (planner.adaptive)
    budget_reason: str = ""           # adaptive budget: "fits" | "pressure" | "floor"; "": not adaptive

    def to_proto(self) -> common_pb2.CompressionPlan:
        return json_format.ParseDict(_drop_none(dataclasses.asdict(self)), common_pb2.CompressionPlan())

    @classmethod
    def from_proto(cls, msg: common_pb2.CompressionPlan) -> "CompressionPlan":
        d = json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        layers = tuple(_layer(x) for x in d.pop("layers", []))
        offload = OffloadPlan(**d.pop("offload", {}))
        d["predicted_reserve_ratio"] = float(d.get("predicted_reserve_ratio", 0.0))
        for k in ("predicted_retained_attention", "predicted_copy_retained_attention", "budget_ratio"):
            d[k] = float(d.get(k, 0.0))
        for k in ("budget_floor_tokens", "predicted_kv_bytes"):             # int64: a string in JSON
            d[k] = int(d.get(k, 0))
        return cls(layers=layers, offload=offload, **d)


def _layer(d: dict[str, Any]) -> LayerPlan:
    ev = d.get("eviction")
    if ev is not None:
        ev = dict(ev)
        if "keep_tokens" in ev:
            ev["keep_tokens"] = int(ev["keep_tokens"])
        if ev.get("kvcrush") is not None:
            ev["kvcrush"] = KVCrush(**ev["kvcrush"])
        ev = Eviction(**ev)
    return LayerPlan(
        layer=int(d.get("layer", 0)), eviction=ev,
        codebook=Codebook(**d["codebook"]) if "codebook" in d else None,
        merge=Merge(**d["merge"]) if "merge" in d else None,
        quant=Quant(**d["quant"]) if "quant" in d else None,
    )


def _drop_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, (list, tuple)):
        return [_drop_none(v) for v in x]
    return x


def full_plan(num_layers: int, plan_id: str, strategy: str = "full", fingerprint: str = "",
              budget_met: bool | None = None, prompt_tokens: int = 0) -> CompressionPlan:
    """The uncompressed plan: every layer keeps full KV (its floor: the whole prompt)."""
    return CompressionPlan(plan_id=plan_id, strategy=strategy, model_fingerprint=fingerprint,
                           layers=tuple(LayerPlan(layer=i) for i in range(num_layers)),
                           budget_met=budget_met, budget_floor_tokens=prompt_tokens)
