"""A decode step's layers in one C++ call (`kernels/cpu_decode_step.cpp`, `decode_layers` of the CPU
extension) against its torch reference (`kernels.decode_layers.decode_layers_reference`: the same
launchers one by one in Python), on the engine's own decode steps of a tiny random model whose
sequences hold every storage form: the same residual rows and the same K/V bytes written into the
pool, bit for bit; and the weights it takes only from a model packed for it."""
from __future__ import annotations

import random

import pytest
import torch

from executor.engine import KVBudget, LLMEngine, Sampling, model_runner
from executor.prompt import Prompt
from kernels import cpu_extension
from kernels import decode_layers as dl
from kvcore.plan import CompressionPlan, Eviction, LayerPlan, Quant, full_plan

ext = cpu_extension.module()
pytestmark = pytest.mark.skipif(ext is None or not hasattr(ext, "decode_layers"), reason="no C++ compiler here")


def test_kernel_matches_reference_on_the_engines_decode_steps(tiny_model, monkeypatch):
    m = tiny_model.num_layers
    ev = Eviction(keep_tokens=30, window=8, scorer="snapkv", gqa_mode="mean")
    plans = [full_plan(m, "f"), CompressionPlan("p", "t", tuple(LayerPlan(i, eviction=ev) for i in range(m))),
             CompressionPlan("p", "t", tuple(LayerPlan(i, quant=Quant(bits=4, group_size=32, residual=8))
                                             for i in range(m)))]
    checked = []
    real = dl.decode_layers

    def both(x, y, cos, sin, w, eps, heads, kv_heads, rows, write_at, arena, tables, layout, scaling, rope):
        x_ref, arena_ref = x.clone(), arena.clone()
        rows_ref = arena_ref.view(rows.dtype).view(-1, rows.shape[1])
        ref = dl.decode_layers_reference(x_ref, y.clone(), cos, sin, w, eps, heads, kv_heads, rows_ref, write_at,
                                         arena_ref, tables, layout, scaling, rope)
        out = real(x, y, cos, sin, w, eps, heads, kv_heads, rows, write_at, arena, tables, layout, scaling, rope)
        assert out.data_ptr() == x.data_ptr()                     # the residual, updated in place
        assert torch.equal(out, ref)
        assert torch.equal(arena, arena_ref)                      # the same K/V rows written
        checked.append(x.shape[0])
        return out
    monkeypatch.setattr(model_runner.fused_layers, "decode_layers", both)
    engine = LLMEngine(tiny_model, torch.float16, KVBudget(1 << 40), max_batched_tokens=1024, prefill_chunk=32)
    rng = random.Random(7)
    for plan in plans:
        engine.add(engine.sequence(Prompt([rng.randint(100, 40000) for _ in range(rng.randint(50, 90))], []), plan,
                                   Sampling(12, ignore_eos=True)))
    engine.run_all()
    assert checked and max(checked) == len(plans)                # steps of all three sequences went through it


def test_weights_come_only_from_a_model_packed_for_them(tiny_model):
    w = dl.Weights.of(tiny_model.model)
    assert w is not None and len(w.qkv) == tiny_model.num_layers
    layer = tiny_model.model.model.layers[0]
    saved = layer.mlp.down_proj
    try:
        layer.mlp.down_proj = torch.nn.Linear(saved.in_features, saved.out_features, bias=False)   # not packed
        assert dl.Weights.of(tiny_model.model) is None
    finally:
        layer.mlp.down_proj = saved
