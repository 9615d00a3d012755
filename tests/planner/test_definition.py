"""Strategy definitions: JSON and YAML read the same, defaults fill in, the schema's errors name
the field, reserved and non-stacking parts are refused, and `to_json` reads back equal."""
import json

import pytest

from kvcore.plan import KVCrush, Quant
from planner.definition import CodebookPart, DefinitionError, EvictionPart, MergePart, loads
from planner.strategies import PRESETS

KINDS = ["compose", "auto"]
YAML = """
name: mine
description: my own
allocation: xkv
eviction: {scorer: snapkv, pool_kernel: 7, gqa_mode: repeat}
kvcrush: {anchor: mean}
codebook: {theta_k: 0.97, layers: [3, 0, 1]}
quant: {bits: 2}
"""


def test_yaml_and_json_read_the_same_with_defaults_filled_in():
    d = loads(YAML, KINDS)
    assert d == loads(json.dumps(loads(YAML, KINDS).to_dict()), KINDS)
    assert (d.name, d.version, d.kind, d.allocation) == ("mine", "", "compose", "xkv")
    assert d.eviction == EvictionPart(scorer="snapkv", window=32, sink_tokens=0, pool_kernel=7, span_tokens=0,
                                      gqa_mode="repeat")
    assert d.kvcrush == KVCrush(rep_fraction=0.25, anchor="mean", bucket_rule="uniform")
    assert d.codebook == CodebookPart(theta_k=0.97, theta_v=0.95, layers=(0, 1, 3))
    assert d.quant == Quant(bits=2, group_size=32, residual=32) and d.merge is None


def test_defaults_of_the_optional_parts():
    d = loads("{name: m, merge: {}, codebook: {}}", KINDS)
    assert d.merge == MergePart(start_layer=None, t=0.6, retention_k=0.05, retention_v=0.05)
    assert d.codebook.layers is None and d.codebook.on(29)
    assert d.eviction is None and d.quant is None


@pytest.mark.parametrize("d", PRESETS, ids=lambda d: d.name)
def test_presets_round_trip_through_json(d):
    back = loads(d.to_json(), KINDS)
    assert back == d and back.to_json() == d.to_json()


def test_a_null_window_survives_the_round_trip():
    d = loads("{name: s, eviction: {scorer: streaming_llm, window: null, sink_tokens: 4}}", KINDS)
    assert d.eviction.window is None and loads(d.to_json(), KINDS).eviction.window is None


@pytest.mark.parametrize("text, field, words", [
    ("{name: x, eviction: {scorer: foo}}", "definition.eviction.scorer",
     "'foo' is not one of ['snapkv', 'h2o', 'streaming_llm']"),
    ("{name: x, eviction: {scorer: h2o, gqa_mode: both}}", "definition.eviction.gqa_mode", "'both' is not one of"),
    ("{name: x, allocation: cubic, eviction: {scorer: h2o}}", "definition.allocation", "'cubic' is not one of"),
    ("{name: x, eviction: {scorer: h2o, pool_kernel: 0}}", "definition.eviction.pool_kernel", "less than the minimum"),
    ("{name: x, eviction: {scorer: h2o, windw: 8}}", "definition.eviction", "'windw' was unexpected"),
    ("{name: x, quant: {bits: 3}}", "definition.quant.bits", "3 is not one of [2, 4, 8]"),
    ("{name: x, quant: {group_size: 48}}", "definition.quant.group_size", "is not one of [32, 64]"),
    ("{name: x, kvcrush: {anchor: mean}}", "definition", "'eviction' is a dependency of 'kvcrush'"),
    ("{name: x, eviction: {scorer: h2o}, kvcrush: {rep_fraction: 1.5}}", "definition.kvcrush.rep_fraction",
     "greater than or equal to the maximum"),
    ("{name: x, codebook: {layers: some}}", "definition.codebook.layers", "is not valid under any"),
    ("{name: x, merge: {t: 2}}", "definition.merge.t", "greater than the maximum"),
    ("{name: x, kind: nope}", "definition.kind", "'nope' is not one of ['auto', 'compose']"),
    ("{name: 'bad name'}", "definition.name", "does not match"),
    ("{description: nameless}", "definition", "'name' is a required property"),
    ("{name: x, offload: {low_bits: 3}}", "definition.offload.low_bits", "3 is not one of [1, 2, 4]"),
    ("{name: x, codebook: {}, quant: {}}", "definition.quant", "does not stack with a codebook"),
    ("[1, 2]", "definition", "must be a mapping"),
    ("{name: x", "definition", "not valid JSON or YAML"),
])
def test_bad_definitions_name_the_field(text, field, words):
    with pytest.raises(DefinitionError) as e:
        loads(text, KINDS)
    assert e.value.field == field and str(e.value).startswith(field + ": ") and words in str(e.value)


def test_quant_beside_a_codebook_on_listed_layers_is_fine():
    d = loads("{name: x, codebook: {layers: [0, 1]}, quant: {bits: 4}}", KINDS)
    assert d.codebook.layers == (0, 1) and d.quant.bits == 4
