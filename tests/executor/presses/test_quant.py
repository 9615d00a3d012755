"""KIVI in the pool on the tiny model (4 query heads, 2 KV heads, D = 16): one group a page at the
plan's width (`kvcore.blocks.quant_shape`) and a dense tail; the bytes reported are the pages held;
dequantized rows are within half a quantization step of the full-precision rows; 8-bit attention
is close to dense attention; decode keeps the full-precision tail short and quantizes whole pages;
under eviction the layer keeps exactly the rows an evicted layer keeps; plans the pool cannot hold
are refused before any work."""
import dataclasses
import pytest
import torch

from executor.presses.context import UnsupportedPlan
from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from executor.engine.sequence import Phase
from kvcore.plan import Codebook, Eviction, LayerPlan, Quant
from kvcore.blocks import Layout
from tests.executor.presses.helpers import CONTEXT, QUESTION, decode_attend, dense_kv, plan_of, prefill, streams

D = 16


def _pooled_heads(runner, cache, layer: int):
    rows = streams(runner, cache, layer)
    return torch.stack([k for k, _, _ in rows]), torch.stack([v for _, v, _ in rows])


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
    runner, cache = prefill(tiny_model, plan_of(tiny_model.num_layers, quant=quant))
    hk, lay = tiny_model.num_kv_heads, Layout(D)
    g = lay.group_rows(bits)
    n = 90 // g
    for i, lb in enumerate(cache.layer_bytes()):
        assert lb.kind == "quant"
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
    runner, cache = prefill(tiny_model, plan_of(tiny_model.num_layers, quant=Quant(bits=bits, group_size=32, residual=8)))
    for i, (k_full, v_full) in enumerate(dense_kv(tiny_model)):
        ks, vs = _pooled_heads(runner, cache, i)                                                  # [H_kv, 90, D]
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
    runner, cache = prefill(tiny_model, plan_of(tiny_model.num_layers, quant=Quant(bits=8, group_size=32, residual=0)))
    hq = tiny_model.num_query_heads
    q = torch.randn(1, hq, 1, D, generator=torch.Generator().manual_seed(1))
    for i, (k_full, v_full) in enumerate(dense_kv(tiny_model)):
        got = decode_attend(runner, cache, i, q[0, :, 0])                                   # [H, D] decode query
        want = torch.nn.functional.scaled_dot_product_attention(q, k_full[None], v_full[None], scale=0.25,
                                                                enable_gqa=True)[0, :, 0]   # [H, D]
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    cache.close()


def test_eight_bit_quant_decodes_like_the_full_cache(tiny_model):
    from kvcore.plan import full_plan
    prompt = Prompt(CONTEXT, QUESTION)
    full = Runner(tiny_model, torch.float16).run(prompt, full_plan(tiny_model.num_layers, "f"), Sampling(8))
    plan = plan_of(tiny_model.num_layers, quant=Quant(bits=8, group_size=32, residual=0))
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
    plan = plan_of(tiny_model.num_layers, quant=Quant(bits=4, group_size=g, residual=residual))
    loop = dataclasses.replace(tiny_model, decode_layers=False)     # the Python loop: its writes are recorded
    runner, cache = prefill(loop, plan)
    full = dense_kv(tiny_model)
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
            runner.forward([tok], pos, cache, Phase.AFTER)
            pos += 1
            n = tables.qn[:, cache.slot]                            # [L, H_kv] groups
            tail = (tables.dend - tables.dstart)[:, cache.slot]
            assert ((min(residual, pos) <= tail) & (tail < residual + g)).all() and (n * g + tail == pos).all()
            for i, lb in enumerate(cache.layer_bytes()):
                held = (int(n[i].sum()) + int(sum(-(-int(e) // 16) - int(b) // 16 for b, e in
                        zip(tables.dstart[i, cache.slot], tables.dend[i, cache.slot])))) * lay.page_bytes
                assert lb.kv_bytes == held
    for i in range(tiny_model.num_layers):
        ks, vs = _pooled_heads(runner, cache, i)                            # [H_kv, 160, D]
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


def test_quant_under_eviction_keeps_the_evicted_layers_rows_in_the_pool(tiny_model):
    ev = Eviction(keep_tokens=40, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="mean", pool_kernel=3)
    r_e, evicted = prefill(tiny_model, plan_of(tiny_model.num_layers, eviction=ev))
    r_q, quant = prefill(tiny_model, plan_of(tiny_model.num_layers, eviction=ev, quant=Quant(bits=4, group_size=32,
                                                                                          residual=0)))
    lay = Layout(D)
    g = lay.group_rows(4)                                                                 # 48: 50 = 48 + 2
    for i, (lb_e, lb_q) in enumerate(zip(evicted.layer_bytes(), quant.layer_bytes())):
        assert lb_q.kind == "quant" and lb_q.kept_tokens == lb_e.kept_tokens == 50
        ke, ve = _pooled_heads(r_e, evicted, i)                                                # [H_kv, 50, D]
        kq, vq = _pooled_heads(r_q, quant, i)
        for h in range(tiny_model.num_kv_heads):
            kb, vb = _pooled_bound(ke[h], ve[h], 1, 4)
            assert ((kq[h, :g] - ke[h, :g]).abs() <= kb).all() and ((vq[h, :g] - ve[h, :g]).abs() <= vb).all()
            assert torch.equal(kq[h, g:], ke[h, g:])
        # each KV head: one group page, its 2 tail rows (48, 49) in one dense page
        assert lb_q.kv_bytes == tiny_model.num_kv_heads * 2 * lay.page_bytes
    evicted.close()
    quant.close()


def test_plans_the_quant_layer_cannot_run_are_refused(tiny_model):
    m = tiny_model.num_layers
    repeat = Eviction(keep_tokens=20, gqa_mode="repeat")
    for layer, message in ((dict(codebook=Codebook(), quant=Quant()), "codebook \\+ quant"),
                           (dict(quant=Quant(bits=3)), "bits 3"),
                           (dict(quant=Quant(residual=-1)), "residual -1"),
                           (dict(eviction=repeat, quant=Quant()), "GQA repeat")):
        assert LayerPlan(0, **layer).kind == "quant"
        with pytest.raises(UnsupportedPlan, match=message):
            Runner(tiny_model, torch.float16).new_cache(plan_of(m, **layer))
