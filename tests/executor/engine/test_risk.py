"""`executor.engine.risk`: the share of an answer not copied from its prompt, on a worked example."""
import pytest

from executor.engine import risk
from kvcore.plan import CompressionPlan, Eviction, LayerPlan, full_plan

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]          # "... the number is 7 8 9 10 ..."


def test_a_copied_answer_is_grounded_and_a_made_up_tail_is_not():
    assert risk.grounded(PROMPT, [7, 8, 9, 10, 11]) == 1.0             # every token in a copied 4-gram
    # 6 7 8 9 copied (4 tokens), then 40 41 made up: 4 of 6 covered
    assert risk.grounded(PROMPT, [6, 7, 8, 9, 40, 41]) == 4 / 6
    assert risk.grounded(PROMPT, [7, 9]) == 0.0 and risk.grounded(PROMPT, [8, 9]) == 1.0   # shorter than 4: whole
    assert risk.grounded(PROMPT, []) == 1.0


def test_kv_risk_is_the_share_not_copied():
    assert risk.kv_risk(PROMPT, [7, 8, 9, 10]) == 0.0
    assert risk.kv_risk(PROMPT, [6, 7, 8, 9, 40, 41]) == pytest.approx(2 / 6)


def test_only_a_compressed_answer_is_at_risk():
    full = full_plan(2, "p")
    evicted = CompressionPlan("p", "snapkv", (LayerPlan(0, Eviction(keep_tokens=4)), LayerPlan(1)))
    assert not risk.at_risk(0.5, full)                                  # nothing dropped: not compression's doing
    assert risk.at_risk(0.5, evicted) and not risk.at_risk(0.0, evicted)
