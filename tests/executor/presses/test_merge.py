"""MiniCache's press on the tiny model and worked examples: which rows a share retains under each
rule; a pair's layers restore their merged rows as direction times their own magnitude and their
retained rows exactly; t = 0 / 1 gives that layer back; retaining everything decodes like the full
cache; the lower layer reads its partner's directions and holds no pages of them; plans the pool
cannot hold are refused before any work."""
import math

import pytest
import torch

from executor.presses import merge
from executor.presses.context import UnsupportedPlan
from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kernels import slerp_merge
from kvcore.plan import CompressionPlan, Eviction, LayerPlan, Merge, full_plan
from tests.executor.presses.helpers import CONTEXT, QUESTION, dense_kv, prefill, streams


def _pair(m: int, t: float = 0.6, share: float = 0.2) -> CompressionPlan:
    layers = [LayerPlan(i) for i in range(m)]
    layers[1] = LayerPlan(1, merge=Merge(0, t, share, share))
    return CompressionPlan("t", "minicache", tuple(layers))


def test_retention_worked_example():
    d = torch.tensor([0.10, 0.50, 0.30, 0.90, 0.20])
    assert merge.retained(d, 0.4).tolist() == [1, 3]                     # the two largest distances
    assert merge.retained(d, 0.4, "similar").tolist() == [0, 4]          # the two smallest
    assert merge.retained(d, 0.0).tolist() == [] and merge.retained(d, 1.0).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="retention rule"):
        merge.retained(d, 0.4, "median")


def test_merged_rows_restore_with_their_own_magnitudes_and_retained_rows_exactly(tiny_model):
    runner, cache = prefill(tiny_model, _pair(tiny_model.num_layers))
    (k0, v0), (k1, v1) = dense_kv(tiny_model)[:2]
    hk, d = tiny_model.num_kv_heads, tiny_model.head_dim
    rows = lambda x: x.transpose(0, 1).reshape(x.shape[1], -1).half()          # noqa: E731  [N, H_kv·D]
    keep = torch.zeros(90, dtype=torch.bool)
    want = {}
    for name, lo, hi in (("k", k0, k1), ("v", v0, v1)):
        e, m0, m1, omega = slerp_merge(rows(lo), rows(hi), 0.6, torch.float16)
        keep[merge.retained(omega / math.pi, 0.2)] = True
        want[name] = [(e.float() * m.float()[:, None]).view(90, hk, d).transpose(0, 1) for m in (m0, m1)]
    n_kept = int(keep.sum())
    assert n_kept >= math.ceil(0.2 * 90)
    for layer, full in ((0, (k0, v0)), (1, (k1, v1))):
        for g, (k, v, _) in enumerate(streams(runner, cache, layer)):
            merged = 90 - n_kept
            assert k.shape[0] == 90                                          # merged rows, then the retained exact
            torch.testing.assert_close(k[:merged], want["k"][layer][g][~keep], rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(v[:merged], want["v"][layer][g][~keep], rtol=2e-3, atol=2e-3)
            assert torch.equal(k[merged:], full[0][g][keep]) and torch.equal(v[merged:], full[1][g][keep])
    pages = cache.tables.layer_pages(cache.slot)
    assert pages[0] < pages[1]                                               # the directions are the upper's pages
    assert not bool(cache.tables.eown[0, cache.slot])
    cache.close()


@pytest.mark.parametrize("t, which", [(0.0, 0), (1.0, 1)])
def test_slerp_end_point_restores_that_layer_up_to_fp16(tiny_model, t, which):
    runner, cache = prefill(tiny_model, _pair(tiny_model.num_layers, t=t, share=0.0))
    k_full = dense_kv(tiny_model)[which][0]
    for g, (k, _, _) in enumerate(streams(runner, cache, which)):
        torch.testing.assert_close(k, k_full[g], rtol=1e-2, atol=1e-2)
    cache.close()


def test_retaining_every_context_token_decodes_like_the_full_cache(tiny_model):
    runner = Runner(tiny_model, torch.float16)
    prompt = Prompt(CONTEXT, QUESTION)
    full = runner.run(prompt, full_plan(tiny_model.num_layers, "f"), Sampling(8))
    kept = runner.run(prompt, _pair(tiny_model.num_layers, share=1.0), Sampling(8))
    assert kept.token_ids == full.token_ids
    assert [lb.kind for lb in kept.layers[:2]] == ["merge", "merge"]


@pytest.mark.parametrize("layers, message", [
    ({1: LayerPlan(1, merge=Merge(1))}, "earlier layer"),
    ({1: LayerPlan(1, merge=Merge(0), eviction=Eviction())}, "cannot stack"),
    ({0: LayerPlan(0, eviction=Eviction()), 1: LayerPlan(1, merge=Merge(0))}, "must carry no part"),
])
def test_unsupported_merge_plans_are_refused(tiny_model, layers, message):
    plan = [LayerPlan(i) for i in range(tiny_model.num_layers)]
    for i, lp in layers.items():
        plan[i] = lp
    with pytest.raises(UnsupportedPlan, match=message):
        Runner(tiny_model, torch.float16).new_cache(CompressionPlan("t", "x", tuple(plan)))
