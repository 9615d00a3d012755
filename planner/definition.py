"""A strategy as data: a named, versioned definition (JSON or YAML) composed from parts and
validated against `strategy.schema.json`. Every field but `name` is optional:

    name: spindlekv
    version: "2"                 # "" (omitted): the registry numbers it
    description: ...
    kind: compose                # a key of planner.strategies.PLANNERS
    allocation: pyramid          # uniform | pyramid | xkv: how the context budget splits over layers
    eviction: {scorer: snapkv, window: 32, sink_tokens: 0, pool_kernel: 7, span_tokens: 16, gqa_mode: repeat}
    kvcrush: {rep_fraction: 0.25, anchor: random, bucket_rule: uniform}     # on evicted layers
    codebook: {theta_k: 0.98, theta_v: 0.95, layers: all}                   # SpindleKV; or [0, 1, ...]
    merge: {start_layer: 15, t: 0.6, retention_k: 0.05, retention_v: 0.05,  # MiniCache; default m // 2
            min_cos: 0.5}                                   # probe gate per pair; null: merge them all
    quant: {bits: 4, group_size: 32, residual: 32}                          # KIVI
    offload: {low_bits: 2, group_size: 32, top_k: 64, recent_window: 64, sink_tokens: 0,    # SpeCache:
              value_group_size: 64}
                                 # layers without another part keep a low-bit copy, the cachestore the rest

The defaults are the dataclass defaults below (the schema states types and ranges only). Errors
are `DefinitionError`s naming the field: `definition.eviction.scorer: 'foo' is not one of [...]`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import jsonschema
import yaml

from kvcore.plan import KVCrush, Quant
from kvcore.request import InvalidRequest

SCHEMA: dict[str, Any] = json.loads(Path(__file__).with_name("strategy.schema.json").read_text())
MAX_DEFINITION_BYTES = 64 << 10    # a definition's text; the schema bounds every number in it
MAX_NODES = 4096                   # values in a parsed definition (YAML aliases can share, not multiply)
MAX_DEPTH = 32                     # bracket nesting
RESERVED: dict[str, str] = {}      # part names kept for later issues, refused with the reason


class DefinitionError(InvalidRequest):
    """A definition the schema (or a rule across parts) rejects; `field` is its path."""


@dataclass(frozen=True)
class EvictionPart:
    scorer: str                   # snapkv | h2o | streaming_llm
    window: int | None = 32       # last prompt tokens, always kept; None: whatever the budget leaves after the sinks
    sink_tokens: int = 0          # leading prompt tokens always kept
    pool_kernel: int = 1          # 1-D avg-pool over scores (1 = none)
    span_tokens: int = 0          # copy span after pooling (kvcore.scoring.spread); 0 = off
    gqa_mode: str = "mean"        # repeat (per query head) | mean (per KV head)


@dataclass(frozen=True)
class CodebookPart:
    theta_k: float = 0.98
    theta_v: float = 0.95
    layers: tuple[int, ...] | None = None     # None: every layer; indices past the model's layers are ignored

    def on(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


@dataclass(frozen=True)
class MergePart:
    start_layer: int | None = None            # None: the middle layer, m // 2
    t: float = 0.6
    retention_k: float = 0.05
    retention_v: float = 0.05
    # a pair merges only where the probe's mean cosine of both its K and its V rows is at least
    # this (None: every pair from start_layer, as published). MiniCache's premise is that deep
    # adjacent layers agree (paper Fig. 1a: ≈0.8–0.9 deep, ≈0.2–0.3 shallow; Fig. 2b: most
    # tokens ≈0.6 in the pairs it merges); 0.5 lies between what it merges and what it leaves.
    min_cos: float | None = 0.5


@dataclass(frozen=True)
class OffloadPart:
    """SpeCache (kvcore.plan.OffloadPlan): the executor fits group_size, recent_window and top_k
    (these are the largest it may use) to the job's reserve ratio; low_bits stays."""
    low_bits: int = 2
    group_size: int = 64
    top_k: int = 64
    recent_window: int = 64
    sink_tokens: int = 0
    value_group_size: int = 64
    rerank: int = 4


@dataclass(frozen=True)
class Definition:
    name: str
    version: str = ""                         # "": not given (the registry numbers it; presets say "1")
    description: str = ""
    kind: str = "compose"
    allocation: str = "uniform"
    eviction: EvictionPart | None = None
    kvcrush: KVCrush | None = None
    codebook: CodebookPart | None = None
    merge: MergePart | None = None
    quant: Quant | None = None
    offload: OffloadPart | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)   # settings of other kinds

    def to_dict(self) -> dict[str, Any]:
        """The definition as plain data (what `from_dict` reads back), defaults filled in."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "", {})}
        if self.codebook:
            d["codebook"]["layers"] = "all" if self.codebook.layers is None else list(self.codebook.layers)
        if self.merge and self.merge.start_layer is None:
            del d["merge"]["start_layer"]
        if not self.eviction:                         # an allocation splits eviction budgets only
            del d["allocation"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


PARTS = {"eviction": EvictionPart, "kvcrush": KVCrush, "codebook": CodebookPart, "merge": MergePart, "quant": Quant,
         "offload": OffloadPart}


def loads(text: str, kinds: Iterable[str], field: str = "definition") -> Definition:
    """A definition from JSON or YAML text (YAML reads both), at most MAX_DEFINITION_BYTES."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_DEFINITION_BYTES:
        raise DefinitionError(field, f"{size} bytes; a definition is at most {MAX_DEFINITION_BYTES}")
    if _bracket_depth(text) > MAX_DEPTH:
        raise DefinitionError(field, f"nested more than {MAX_DEPTH} brackets deep")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DefinitionError(field, f"not valid JSON or YAML: {_one_line(e)}") from None
    except RecursionError:
        raise DefinitionError(field, "nested too deeply") from None
    return from_dict(data, kinds, field)


def _bracket_depth(text: str) -> int:
    """The deepest `[`/`{` nesting of the text (quotes not parsed: an over-estimate), so a
    deeply nested document is refused before the YAML parser recurses into it."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


def _check_values(data: Any, field: str) -> None:
    """Every number finite (JSON Schema's bounds let NaN through: it compares false), and the
    whole at most MAX_NODES values (YAML aliases would make a walk of shared parts explode)."""
    stack, seen = [(data, field)], 0
    while stack:
        value, path = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise DefinitionError(field, f"more than {MAX_NODES} values (or aliases sharing them)")
        if isinstance(value, float) and not math.isfinite(value):
            raise DefinitionError(path, f"must be a finite number, got {value}")
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))


def from_dict(data: Any, kinds: Iterable[str], field: str = "definition") -> Definition:
    if not isinstance(data, dict):
        raise DefinitionError(field, f"must be a mapping of fields, got {type(data).__name__}")
    _check_values(data, field)
    for name, why in RESERVED.items():
        if name in data:
            raise DefinitionError(f"{field}.{name}", why)
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "kind": {"enum": sorted(kinds)}}}
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(data))
    if error is not None:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise DefinitionError(field + path, error.message)
    parts = {k: PARTS[k](**data[k]) for k in PARTS if k in data}
    if "codebook" in parts:                        # "all" | [indices]
        layers = data["codebook"].get("layers", "all")
        parts["codebook"] = dataclasses.replace(parts["codebook"], layers=None if layers == "all" else tuple(sorted(layers)))
    d = Definition(name=data["name"], version=str(data.get("version", "")), description=data.get("description", ""),
                   kind=data.get("kind", "compose"), allocation=data.get("allocation", "uniform"),
                   options=dict(data.get("options", {})), **parts)
    if d.quant and d.codebook and d.codebook.layers is None:
        raise DefinitionError(f"{field}.quant", "does not stack with a codebook on the same layer (the executor "
                                                "refuses it): give codebook.layers to leave the other layers to quant")
    return d


def load_all(path: Path, kinds: Iterable[str]) -> tuple[Definition, ...]:
    """A YAML file holding a list of definitions (the shipped presets)."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, list):
        raise DefinitionError(path.name, "must be a list of definitions")
    kinds = list(kinds)
    return tuple(from_dict(d, kinds, f"{path.name}[{i}]") for i, d in enumerate(data))


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
