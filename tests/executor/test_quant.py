"""Quantized layers (KIVI) on a tiny random GQA model (4 query heads, 2 KV heads, D = 16), in
the engine's pool (one group a page at 2/4/8 bits, `kvcore.blocks.quant_shape`, and a dense tail)
and in cache layers of their own (`QuantGroup`: per-query-head eviction): the bytes reported are
the pages (or tensors) held and shrink by the expected factor, dequantized rows are within half
a quantization step of the full-precision rows, 8-bit attention is close to dense attention,
decode keeps the full-precision tail short and quantizes whole groups, and under eviction the
layer keeps exactly the rows an evicted layer keeps."""
import pytest
import torch

from executor.cache import UnsupportedPlan
from executor.layers.quant import QuantGroup, QuantLayer, value_group
from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kvplan.plan import Codebook, Eviction, LayerPlan, Quant
from kvcore.blocks import Layout
from tests.executor.test_layers import CONTEXT, QUESTION, _dense_kv, _plan, _pooled_attend, _pooled_heads, _prefill

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


def _pooled_bound(k_full: torch.Tensor, v_full: torch.Tensor, n: int, bits: int):
    """Per-element error bound of a pooled stream's first n·g rows quantized from k_full, v_full
    [U, D] (fp16 rows): half a step of each group's range (K per channel over g tokens, V per
    token over g_v channels; the pool's group at `bits`), plus the fp16 rounding of its min and scale."""
    g, gv = Layout(D).group_rows(bits), Layout(D).value_group(bits)
    k = k_full[:n * g].view(n, g, D)
    k_step = (k.amax(1) - k.amin(1)) / (2 ** bits - 1)                                            # [n, D]
    kb = (k_step / 2 + k.abs().amax(1) * 2 ** -10 + 1e-6)[:, None, :].expand(n, g, D).reshape(n * g, D)
    v = v_full[:n * g].view(n * g, D // gv, gv)
    v_step = (v.amax(2) - v.amin(2)) / (2 ** bits - 1)                                            # [n·g, D/g_v]
    vb = (v_step / 2 + v.abs().amax(2) * 2 ** -10 + 1e-6).repeat_interleave(gv, dim=1)
    return kb, vb


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bytes_held_are_the_blocks_and_shrink_by_the_expected_factor(tiny_model, bits):
    quant = Quant(bits=bits, group_size=32, residual=0)
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, quant=quant))
    hk, lay = tiny_model.num_kv_heads, Layout(D)
    g = lay.group_rows(bits)
    n = 90 // g
    for i, lb in enumerate(cache.layer_bytes()):
        assert lb.kind == "quant" and cache.pooled[i]
        assert cache.tables.qn[i, cache.slot].tolist() == [n] * hk
        assert (cache.tables.dend - cache.tables.dstart)[i, cache.slot].tolist() == [90 - n * g] * hk
        # n group pages, and the tail's rows in dense pages of 16 (the first maybe shared with the last group's rows)
        assert lb.kv_bytes == hk * (n + int(lay.dense_pages(n * g, 90))) * lay.page_bytes
        assert lb.full_kv_bytes == 2 * 90 * hk * D * 2 and lb.kept_tokens == 90
        # a group fills a page: its g rows cost a page, against g / 16 pages of fp16 rows
        assert lay.quant_bytes(bits) == lay.page_bytes
    cache.close()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantized_rows_are_within_half_a_step_of_the_full_rows(tiny_model, bits):
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, quant=Quant(bits=bits, group_size=32, residual=8)))
    for i, (k_full, v_full) in enumerate(_dense_kv(tiny_model)):
        ks, vs = _pooled_heads(cache, i)                                                  # [H_kv, 90, D]
        grp = Layout(D).group_rows(bits)
        n = (90 - 8) // grp
        for g in range(tiny_model.num_kv_heads):
            assert int(cache.tables.qn[i, cache.slot, g]) == n
            kb, vb = _pooled_bound(k_full[g], v_full[g], n, bits)
            q = n * grp
            assert ((ks[g, :q] - k_full[g, :q]).abs() <= kb).all() and ((vs[g, :q] - v_full[g, :q]).abs() <= vb).all()
            assert torch.equal(ks[g, q:], k_full[g][q:]) and torch.equal(vs[g, q:], v_full[g][q:])   # the tail is exact
            if bits == 2:
                assert (ks[g] - k_full[g]).abs().max() > 0                                 # really quantized
    cache.close()


def test_eight_bit_attention_is_close_to_dense_attention(tiny_model):
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, quant=Quant(bits=8, group_size=32, residual=0)))
    hq = tiny_model.num_query_heads
    q = torch.randn(1, hq, 1, D, generator=torch.Generator().manual_seed(1))
    for i, (k_full, v_full) in enumerate(_dense_kv(tiny_model)):
        got = _pooled_attend(cache, i, q[0, :, 0], 0.25)                                   # [H, D] decode query
        want = torch.nn.functional.scaled_dot_product_attention(q, k_full[None], v_full[None], scale=0.25,
                                                                enable_gqa=True)[0, :, 0]   # [H, D]
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    cache.close()


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
    tokens, lay = len(CONTEXT) + len(QUESTION) + 7, Layout(D)
    n = tokens // lay.group_rows(8)
    for lb in run.layers:
        assert lb.kind == "quant" and lb.kept_tokens == tokens
        # whole groups of 24 quantized, a page each; the tail's rows in dense pages
        pages = n + int(lay.dense_pages(n * lay.group_rows(8), tokens))
        assert lb.kv_bytes == tiny_model.num_kv_heads * pages * lay.page_bytes < lb.full_kv_bytes


@pytest.mark.parametrize("residual", [0, 16])
def test_decode_keeps_the_tail_short_and_quantizes_whole_groups(tiny_model, residual, monkeypatch):
    """Tokens added after compression go to the fp16 tail; whenever a step takes it to residual + g
    the oldest g are quantized, and they stay within half a step of the rows the model handed over."""
    lay = Layout(D)
    g = lay.group_rows(4)
    plan = _plan(tiny_model.num_layers, quant=Quant(bits=4, group_size=g, residual=residual))
    runner, cache = _prefill(tiny_model, plan)
    full = _dense_kv(tiny_model)
    tables = cache.tables
    handed: dict[int, list[torch.Tensor]] = {}                      # layer -> [(k, v) [1, H_kv, D]]
    write = type(tables).write

    def recording(self, w, layer, k, v):
        handed.setdefault(layer, []).append((k.clone(), v.clone()))
        return write(self, w, layer, k, v)
    monkeypatch.setattr(type(tables), "write", recording)
    pos = len(CONTEXT)
    with torch.inference_mode():
        for tok in range(7, 77):                                    # 70 decode steps
            runner.forward([tok], pos, cache, "after")
            pos += 1
            n = tables.qn[:, cache.slot]                            # [L, H_kv] groups
            tail = (tables.dend - tables.dstart)[:, cache.slot]
            assert ((min(residual, pos) <= tail) & (tail < residual + g)).all() and (n * g + tail == pos).all()
            for i, lb in enumerate(cache.layer_bytes()):
                held = (int(n[i].sum()) + int(sum(-(-int(e) // 16) - int(b) // 16 for b, e in
                        zip(tables.dstart[i, cache.slot], tables.dend[i, cache.slot])))) * lay.page_bytes
                assert lb.kv_bytes == held
    for i in range(tiny_model.num_layers):
        ks, vs = _pooled_heads(cache, i)                            # [H_kv, 160, D]
        k_new = torch.cat([k for k, _ in handed[i]]).transpose(0, 1).half().float()     # [H_kv, 70, D] as stored
        v_new = torch.cat([v for _, v in handed[i]]).transpose(0, 1).half().float()
        for h in range(tiny_model.num_kv_heads):
            n = int(tables.qn[i, cache.slot, h])
            assert n == (pos - residual) // g
            k_all, v_all = torch.cat([full[i][0][h], k_new[h]]), torch.cat([full[i][1][h], v_new[h]])
            kb, vb = _pooled_bound(k_all, v_all, n, 4)
            assert ((ks[h, :n * g] - k_all[:n * g]).abs() <= kb).all() and ((vs[h, :n * g] - v_all[:n * g]).abs() <= vb).all()
            assert torch.equal(ks[h, n * g:], k_all[n * g:])       # the tail exact
            assert n * g > 90                                       # decode rows were quantized
    cache.close()


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


def test_quant_under_eviction_keeps_the_evicted_layers_rows_in_the_pool(tiny_model):
    ev = Eviction(keep_tokens=40, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="mean", pool_kernel=3)
    _, evicted = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev))
    _, quant = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev, quant=Quant(bits=4, group_size=32,
                                                                                          residual=0)))
    lay = Layout(D)
    g = lay.group_rows(4)                                                                 # 48: 50 = 48 + 2
    for i, (lb_e, lb_q) in enumerate(zip(evicted.layer_bytes(), quant.layer_bytes())):
        assert lb_q.kind == "quant" and lb_q.kept_tokens == lb_e.kept_tokens == 50
        ke, ve = _pooled_heads(evicted, i)                                                # [H_kv, 50, D]
        kq, vq = _pooled_heads(quant, i)
        for h in range(tiny_model.num_kv_heads):
            kb, vb = _pooled_bound(ke[h], ve[h], 1, 4)
            assert ((kq[h, :g] - ke[h, :g]).abs() <= kb).all() and ((vq[h, :g] - ve[h, :g]).abs() <= vb).all()
            assert torch.equal(kq[h, g:], ke[h, g:])
        # each KV head: one group page, its 2 tail rows (48, 49) in one dense page
        assert lb_q.kv_bytes == tiny_model.num_kv_heads * 2 * lay.page_bytes
    evicted.close()
    quant.close()


def test_quant_under_per_query_head_eviction_keeps_the_evicted_layers_rows(tiny_model):
    """GQA `repeat`: a cache layer of its own (`QuantGroup` under `EvictedLayer`'s masks)."""
    ev = Eviction(keep_tokens=40, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="repeat", pool_kernel=3)
    _, evicted = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev))
    _, quant = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev, quant=Quant(bits=4, group_size=32,
                                                                                          residual=0)))
    for e, q, lb_e, lb_q in zip(evicted.layers, quant.layers, evicted.layer_bytes(), quant.layer_bytes()):
        assert lb_q.kind == "quant" and lb_q.kept_tokens == lb_e.kept_tokens == 50
        assert q.prompt_counts == e.prompt_counts and q.prompt_rows == e.prompt_rows
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
                                    for g in q.groups) + sum(m.nbytes for m in q.masks)


def test_plans_the_quant_layer_cannot_run_are_refused(tiny_model):
    m = tiny_model.num_layers
    for layer, message in ((dict(codebook=Codebook(), quant=Quant()), "codebook \\+ quant"),
                           (dict(quant=Quant(bits=3)), "bits 3"),
                           (dict(quant=Quant(group_size=12)), "group_size"),
                           (dict(quant=Quant(residual=-1)), "residual")):
        assert LayerPlan(0, **layer).kind == "quant"
        with pytest.raises(UnsupportedPlan, match=message):
            Runner(tiny_model, torch.float16).new_cache(_plan(m, **layer))
