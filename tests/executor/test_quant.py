"""Quantized cache layers (KIVI) on a tiny random GQA model (4 query heads, 2 KV heads, D = 16):
the bytes reported are the bytes held and shrink by the expected factor, dequantized rows are
within half a quantization step of the full-precision rows, 8-bit attention is close to dense
attention, decode keeps the full-precision tail short and quantizes whole groups, and under
eviction the layer keeps exactly the rows an evicted layer keeps."""
import pytest
import torch

from executor.cache import UnsupportedPlan
from executor.layers.quant import QuantGroup, QuantLayer, value_group
from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kvplan.plan import Codebook, Eviction, LayerPlan, Quant
from tests.executor.test_layers import CONTEXT, QUESTION, _dense_kv, _plan, _prefill

D = 16


def _bound(group: QuantGroup) -> torch.Tensor:
    """Per-element error bound of a group's materialized rows [U, D]: half a step of its group
    (plus the fp16 rounding of the group's min), 0 for the full-precision tail."""
    def half_step(scale, zero):
        return scale.float() / 2 + zero.float().abs() * 2 ** -11 + 1e-6
    n, g = group.k_scale.shape[0], group.group
    k = half_step(group.k_scale, group.k_zero)[:, None, :].expand(n, g, D).reshape(n * g, D)         # [Q, D]
    v = half_step(group.v_scale, group.v_zero).repeat_interleave(group.v_group, dim=1)              # [Q, D]
    tail = torch.zeros(group.k_tail.shape[0], D)
    return torch.cat([k, tail]), torch.cat([v, tail])


def _quant_bytes(q_tokens: int, tail: int, bits: int, g: int) -> int:
    """Bytes of one group: Q quantized tokens (K codes + per-channel scale/zero per g tokens, V
    codes + per-token scale/zero per g_v channels), the fp16 tail rows."""
    gv = value_group(g, D)
    k = q_tokens * D * bits // 8 + (q_tokens // g) * D * 2 * 2
    v = q_tokens * D * bits // 8 + q_tokens * (D // gv) * 2 * 2
    return k + v + tail * 2 * D * 2


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bytes_held_are_the_tensors_and_shrink_by_the_expected_factor(tiny_model, bits):
    quant = Quant(bits=bits, group_size=32, residual=0)
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, quant=quant))
    hk = tiny_model.num_kv_heads
    for lb, layer in zip(cache.layer_bytes(), cache.layers):
        assert lb.kind == "quant" and layer.compressed and layer.keys is None        # dense copy gone
        assert lb.kv_bytes == sum(t.nbytes for t in layer.tensors())
        assert all(g.quantized_tokens == 64 and g.k_tail.shape[0] == 26 for g in layer.groups)   # 90 = 2·32 + 26
        # the tail's storage: its 26 rows rounded up to a chunk of 8, at most residual + g - 1 = 31 rows
        assert lb.kv_bytes == hk * _quant_bytes(64, 31, bits, 32)
        assert lb.full_kv_bytes == 2 * 90 * hk * D * 2 and lb.kept_tokens == 90
        # the quantized part against fp16: bits/16 + one K scale/zero pair per 32 tokens + one V pair per 16 channels
        quantized = lb.kv_bytes - hk * 31 * 2 * D * 2
        assert quantized / (hk * 64 * 2 * D * 2) == pytest.approx(bits / 16 + 1 / 32 + 1 / 16)
        assert lb.kv_bytes < lb.full_kv_bytes * (bits / 16 + 1 / 32 + 1 / 16 + 31 / 90)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_materialized_rows_are_within_half_a_step_of_the_full_rows(tiny_model, bits):
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, quant=Quant(bits=bits, group_size=32, residual=16)))
    for layer, (k_full, v_full) in zip(cache.layers, _dense_kv(tiny_model)):
        for g, group in enumerate(layer.groups):
            assert group.quantized_tokens == 64 and group.k_tail.shape[0] == 26            # (90 - 16) // 32 groups
            k, v = group.materialize(torch.float32)                                      # [90, D]
            kb, vb = _bound(group)
            assert ((k - k_full[g]).abs() <= kb).all() and ((v - v_full[g]).abs() <= vb).all()
            assert torch.equal(k[64:], k_full[g][64:]) and torch.equal(v[64:], v_full[g][64:])   # the tail is exact
            if bits == 2:
                assert (k - k_full[g]).abs().max() > 0                                   # really quantized


def test_eight_bit_attention_is_close_to_dense_attention(tiny_model):
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, quant=Quant(bits=8, group_size=32, residual=0)))
    hq = tiny_model.num_query_heads
    q = torch.randn(1, hq, 3, D, generator=torch.Generator().manual_seed(1))
    for layer, (k_full, v_full) in zip(cache.layers, _dense_kv(tiny_model)):
        got = layer.attend(q[:, :, -1:], None, None, 0.25)[0, 0]                          # [H, D] decode query
        want = torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], k_full[None], v_full[None], scale=0.25,
                                                                enable_gqa=True)[0, :, 0]   # [H, D]
        assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("tq", [1, 3])
def test_attention_from_the_codes_equals_attention_over_the_dequantized_rows(bits, tq):
    """attend scores keys straight from their codes and weights dequantized values; the same as
    SDPA over `materialize()`'s rows, with a per-head mask and with none, tail included."""
    gen = torch.Generator().manual_seed(bits)
    k, v = torch.randn(83, D, generator=gen), torch.randn(83, D, generator=gen)
    group = QuantGroup(k, v, Quant(bits=bits, group_size=32, residual=8), torch.float16)
    assert group.quantized_tokens == 64 and group.k_tail.shape[0] == 19
    q = torch.randn(3, tq, D, generator=gen)
    kd, vd = group.materialize(torch.float32)
    mask = torch.rand(3, tq, 83, generator=gen) > 0.4
    mask[..., -1] = True
    for m in (None, mask):
        want = torch.nn.functional.scaled_dot_product_attention(q, kd[None].expand(3, -1, -1), vd[None].expand(3, -1, -1),
                                                                attn_mask=m, scale=0.25)
        got = group.attend(q, m, 0.25)
        assert got.shape == (3, tq, D) and got.dtype == q.dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_eight_bit_quant_decodes_like_the_full_cache(tiny_model):
    from kvplan.plan import full_plan
    prompt = Prompt(CONTEXT, QUESTION)
    full = Runner(tiny_model, torch.float16).run(prompt, full_plan(tiny_model.num_layers, "f"), Sampling(8))
    plan = _plan(tiny_model.num_layers, quant=Quant(bits=8, group_size=32, residual=0))
    run = Runner(tiny_model, torch.float16).run(prompt, plan, Sampling(8))
    assert run.token_ids == full.token_ids
    tokens = len(CONTEXT) + len(QUESTION) + 7
    for lb in run.layers:
        assert lb.kind == "quant" and lb.kept_tokens == tokens
        # whole groups of 32 quantized; the tail's rows rounded up to a chunk of 8 (at most 31) in storage
        held = min(-(-(tokens % 32) // 8) * 8, 31)
        assert lb.kv_bytes == tiny_model.num_kv_heads * _quant_bytes(tokens // 32 * 32, held, 8, 32) < lb.full_kv_bytes


@pytest.mark.parametrize("residual", [0, 16])
def test_decode_keeps_the_tail_short_and_quantizes_whole_groups(tiny_model, residual, monkeypatch):
    """Tokens added after compression go to the fp16 tail; whenever it reaches residual + g the
    oldest g are quantized, and they stay within half a step of the rows the model handed over."""
    g = 32
    plan = _plan(tiny_model.num_layers, quant=Quant(bits=4, group_size=g, residual=residual))
    runner, cache = _prefill(tiny_model, plan)
    handed: dict[int, list[torch.Tensor]] = {}                      # id(group) -> [(k, v) [T_new, D]]
    update = QuantLayer.update

    def recording(self, key_states, value_states, *args, **kwargs):
        for g, group in enumerate(self.groups):                     # what each group is handed (in place or not)
            handed.setdefault(id(group), []).append((key_states[0, g].clone(), value_states[0, g].clone()))
        return update(self, key_states, value_states, *args, **kwargs)
    monkeypatch.setattr(QuantLayer, "update", recording)
    pos = len(CONTEXT)
    with torch.inference_mode():
        for tok in range(7, 77):                                    # 70 decode steps
            runner.forward([tok], pos, cache, "after")
            pos += 1
            for layer, lb in zip(cache.layers, cache.layer_bytes()):
                assert lb.kv_bytes == sum(t.nbytes for t in layer.tensors())
                for group in layer.groups:
                    tail = group.k_tail.shape[0]
                    assert min(residual, pos) <= tail < residual + g and group.v_tail.shape[0] == tail
                    assert group.quantized_tokens % g == 0 and group.num_tokens == pos
    for layer in cache.layers:
        for group in layer.groups:
            assert group.quantized_tokens == (pos - residual) // g * g
            k_new = torch.cat([k for k, _ in handed[id(group)]]).half().float()          # [70, D] as stored
            v_new = torch.cat([v for _, v in handed[id(group)]]).half().float()
            k, v = group.materialize(torch.float32)
            kb, vb = _bound(group)
            assert ((k[90:] - k_new).abs() <= kb[90:]).all() and ((v[90:] - v_new).abs() <= vb[90:]).all()
            assert (kb[90:group.quantized_tokens] > 0).all()                            # decode rows were quantized


def test_decode_appends_are_quantized_within_half_a_step(tiny_model):
    """Direct appends to one group: the rows handed over come back within half a step."""
    g, gen = 32, torch.Generator().manual_seed(3)
    k0, v0 = torch.randn(40, D, generator=gen), torch.randn(40, D, generator=gen)
    group = QuantGroup(k0, v0, Quant(bits=2, group_size=g, residual=8), torch.float16)
    assert group.quantized_tokens == 32 and group.k_tail.shape[0] == 8
    ks, vs = [k0], [v0]
    for t in range(40, 140, 5):
        k, v = torch.randn(5, D, generator=gen), torch.randn(5, D, generator=gen)
        group.append(k, v, torch.arange(t, t + 5))
        ks.append(k), vs.append(v)
        assert 8 <= group.k_tail.shape[0] < 8 + g and group.quantized_tokens % g == 0
    k_all, v_all = torch.cat(ks).half().float(), torch.cat(vs).half().float()
    k, v = group.materialize(torch.float32)
    kb, vb = _bound(group)
    assert group.num_tokens == 140 and group.quantized_tokens == 128 and k.shape == (140, D)
    assert ((k - k_all).abs() <= kb).all() and ((v - v_all).abs() <= vb).all()
    assert sum(t.nbytes for t in group.tensors()) == _quant_bytes(128, 16, 2, g)    # 12 tail rows in storage of 16


@pytest.mark.parametrize("gqa", ["mean", "repeat"])
def test_quant_under_eviction_keeps_the_evicted_layers_rows(tiny_model, gqa):
    ev = Eviction(keep_tokens=40, window=8, sink_tokens=2, scorer="snapkv", gqa_mode=gqa, pool_kernel=3)
    _, evicted = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev))
    _, quant = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev, quant=Quant(bits=4, group_size=32,
                                                                                          residual=0)))
    for e, q, lb_e, lb_q in zip(evicted.layers, quant.layers, evicted.layer_bytes(), quant.layer_bytes()):
        assert lb_q.kind == "quant" and lb_q.kept_tokens == lb_e.kept_tokens == 50
        assert q.prompt_counts == e.prompt_counts and q.prompt_rows == e.prompt_rows
        assert (q.head_rows is None) == (e.head_rows is None) == (gqa == "mean")
        if q.head_rows is not None:
            assert torch.equal(q.head_rows, e.head_rows)
        for ge, gq in zip(e.groups, q.groups):
            assert gq.num_tokens == ge.num_tokens and gq.quantized_tokens == ge.num_tokens // 32 * 32
            ke, ve = ge.materialize(torch.float32)
            kq, vq = gq.materialize(torch.float32)
            kb, vb = _bound(gq)
            assert ((kq - ke).abs() <= kb).all() and ((vq - ve).abs() <= vb).all()
        assert lb_q.kv_bytes == sum(t.nbytes for t in q.tensors())
        # each group: its quantized rows at 4 bits (+ scales), its tail rounded up to 8 rows of storage
        assert lb_q.kv_bytes == sum(_quant_bytes(g.quantized_tokens, min(-(-g.r // 8) * 8, 31), 4, 32)
                                    for g in q.groups) + \
            sum(m.nbytes for m in q.masks or [])


def test_plans_the_quant_layer_cannot_run_are_refused(tiny_model):
    m = tiny_model.num_layers
    for layer, message in ((dict(codebook=Codebook(), quant=Quant()), "codebook \\+ quant"),
                           (dict(quant=Quant(bits=3)), "bits 3"),
                           (dict(quant=Quant(group_size=12)), "group_size"),
                           (dict(quant=Quant(residual=-1)), "residual")):
        assert LayerPlan(0, **layer).kind == "quant"
        with pytest.raises(UnsupportedPlan, match=message):
            Runner(tiny_model, torch.float16).new_cache(_plan(m, **layer))
