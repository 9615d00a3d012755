"""Compressed layers on a tiny random GQA model (4 query heads, 2 KV heads, D = 16): kept rows
equal the full-precision rows, attention over them equals dense attention on the kept tokens —
per KV head in the engine's pool (GQA `mean`: the rows through the block tables, attention
through the paged kernel), per query head in a cache layer of its own (`repeat`) — codebook
reconstruction stays within θ with exact magnitudes and re-applies RoPE, and the bytes reported
are the bytes held."""
import dataclasses

import pytest
import torch

from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kvplan.plan import Codebook, CompressionPlan, Eviction, LayerPlan, full_plan

CONTEXT = list(range(1000, 1090))          # 90 context tokens
QUESTION = list(range(2000, 2006))


def _plan(m: int, **layer) -> CompressionPlan:
    return CompressionPlan("t", "test", tuple(LayerPlan(i, **layer) for i in range(m)))


def _prefill(lm, plan, context=CONTEXT):
    runner = Runner(lm, torch.float16)
    cache = runner.new_cache(plan)
    with torch.inference_mode():
        runner.prefill(Prompt(list(context), []), cache)
    return runner, cache


def _dense_kv(lm, context=CONTEXT):
    """Post-RoPE K and V of every layer from a full-KV run, fp16 storage: [H_kv, T, D] each."""
    _, cache = _prefill(lm, full_plan(lm.num_layers, "f"), context)
    return [tuple(x[0].float() for x in cache.dense(i)) for i in range(lm.num_layers)]


def _pooled_heads(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pooled layer's rows per KV head, through its block tables -> K, V [H_kv, n, D] fp32."""
    rows = [cache.tables.stream(layer, cache.slot, g) for g in range(cache.tables.H)]
    return torch.stack([k for k, _ in rows]), torch.stack([v for _, v in rows])


def _pooled_attend(cache, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """A decode query q [H, D] over a pooled layer's streams, by the paged kernel -> [H, D]."""
    from kernels.paged_decode import paged_decode
    st = cache.tables.decode_view([cache.slot], torch.device("cpu"))
    hk = cache.tables.H
    return paged_decode(q.view(hk, -1, q.shape[-1]), cache.tables.pool.arena, st.dtable[layer], st.dstart[layer],
                        st.dend[layer], st.qtable[layer], st.qn[layer], st.qbits[layer], cache.tables.layout,
                        scaling).view(q.shape)


@pytest.mark.parametrize("gqa", ["mean", "repeat"])
@pytest.mark.parametrize("scorer", ["snapkv", "h2o", "streaming_llm"])
def test_evicted_rows_are_the_full_rows_and_attention_matches_dense_on_them(tiny_model, gqa, scorer):
    ev = Eviction(keep_tokens=20, window=8, sink_tokens=2, scorer=scorer, gqa_mode=gqa, pool_kernel=3)
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev))
    dense = _dense_kv(tiny_model)
    hq, hk = tiny_model.num_query_heads, tiny_model.num_kv_heads
    for i, (k_full, v_full) in enumerate(dense):
        if gqa == "mean":                                                 # per KV head: in the pool
            assert cache.pooled[i]
            k_heads, v_heads = _pooled_heads(cache, i)                   # [H_kv, n, D]
        else:                                                             # per query head: its own layer
            layer = cache.layers[i]
            assert layer.compressed and layer.keys is None                # the dense copy is gone
            k_heads, v_heads = layer._heads(torch.float32)               # [H, n, D]
        heads = hq if gqa == "repeat" else hk
        want_n = 2 + (20 if scorer != "streaming_llm" else 0) + 8
        assert k_heads.shape == (heads, want_n, 16)
        # every stored row is the full-precision row of some kept token of its KV head
        for h in range(heads):
            g = h // (heads // hk)
            match = (k_heads[h][:, None, :] == k_full[g][None]).all(-1)   # [n, T]
            assert match.any(1).all()
            rows = match.float().argmax(1)
            assert torch.equal(v_heads[h], v_full[g][rows])
            assert set(range(82, 90)) <= set(rows.tolist()) and {0, 1} <= set(rows.tolist())
        # a decode query: attention equals dense attention over exactly the kept rows
        q = torch.randn(hq, 16)
        got = _pooled_attend(cache, i, q, 0.25) if gqa == "mean" else layer.attend(q[None, :, None], None, None, 0.25)[0, 0]
        for h in range(hq):
            e = h if heads == hq else h // (hq // hk)
            p = torch.softmax((q[h] @ k_heads[e].T) * 0.25, -1)
            torch.testing.assert_close(got[h], p @ v_heads[e], rtol=1e-5, atol=1e-5)
    cache.close()


def test_decode_rows_join_a_pooled_layers_kept_rows_in_whole_blocks(tiny_model):
    """40 decode rows after eviction (GQA mean, in the pool), written as the engine writes them:
    the stream holds the kept rows then the new ones, attention equals dense attention over them,
    and the blocks it holds (its bytes) are the rows rounded up to whole blocks."""
    from kvcore.blocks import BLOCK_ROWS
    ev = Eviction(keep_tokens=20, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="mean", pool_kernel=3)
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev))
    hq, hk, d = tiny_model.num_query_heads, tiny_model.num_kv_heads, 16
    tables, gen = cache.tables, torch.Generator().manual_seed(0)
    kept_k, _ = _pooled_heads(cache, 0)                                   # [H_kv, 30, D]
    new_k = []
    for step in range(40):
        k, v = torch.randn(1, hk, d, generator=gen), torch.randn(1, hk, d, generator=gen)
        w = tables.extend([cache.slot], [1])
        for layer in range(tiny_model.num_layers):
            tables.write(w, layer, k, v)
        new_k.append(k[0])
        if step % 13 == 12 or step == 39:
            k_heads, v_heads = _pooled_heads(cache, 0)                    # [H_kv, 30 + t, D]
            assert k_heads.shape[1] == 30 + step + 1
            q = torch.randn(hq, d, generator=gen)
            got = _pooled_attend(cache, 0, q, 0.25)
            for h in range(hq):
                e = h // (hq // hk)
                p = torch.softmax((q[h] @ k_heads[e].T) * 0.25, -1)
                torch.testing.assert_close(got[h], p @ v_heads[e], rtol=1e-5, atol=1e-5)
    k_heads, _ = _pooled_heads(cache, 0)
    assert torch.equal(k_heads[:, :30], kept_k)
    assert torch.equal(k_heads[:, 30:], torch.stack(new_k, 1).half().float())
    lb = cache.layer_bytes()[0]
    assert lb.kind == "evicted" and lb.kept_tokens == 70
    assert lb.kv_bytes == hk * -(-70 // BLOCK_ROWS) * BLOCK_ROWS * 2 * d * 2
    cache.close()


def test_decode_appends_in_place_and_attention_still_matches_dense_per_query_head(tiny_model):
    """40 decode steps in a GQA `repeat` layer (a cache layer of its own) — past the stores' and
    masks' growth chunks — each appended in place: the rows are the appended ones, attention
    equals dense attention over each head's kept + new rows, and the spare capacity (counted in
    the bytes) stays under one chunk per group."""
    from executor.layers.groups import ROW_CHUNK
    ev = Eviction(keep_tokens=20, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="repeat", pool_kernel=3)
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev))
    hq, hk, d = tiny_model.num_query_heads, tiny_model.num_kv_heads, 16
    layer, gen = cache.layers[0], torch.Generator().manual_seed(0)
    base = [g.num_tokens for g in layer.groups]
    new_k, new_v = [], []
    for step in range(40):
        k, v = torch.randn(1, hk, 1, d, generator=gen), torch.randn(1, hk, 1, d, generator=gen)
        layer.update(k, v)
        new_k.append(k), new_v.append(v)
        if step % 13 == 12 or step == 39:
            k_heads, v_heads = layer._heads(torch.float32)                # [H_e, n + t, D]
            assert k_heads.shape[1] == 30 + step + 1
            q = torch.randn(1, hq, 1, d, generator=gen)
            got = layer.attend(q, None, None, 0.25)[0, 0]
            for h in range(hq):
                e = h if k_heads.shape[0] == hq else h // (hq // hk)
                p = torch.softmax((q[0, h, 0] @ k_heads[e].T) * 0.25, -1)
                torch.testing.assert_close(got[h], p @ v_heads[e], rtol=1e-5, atol=1e-5)
    for g, group in enumerate(layer.groups):
        want = torch.cat([x[0, g] for x in new_k]).half()                  # [40, D]
        assert torch.equal(group.k[base[g]:], want) and group.num_tokens == base[g] + 40
        assert group._k.shape[0] - group.num_tokens < ROW_CHUNK
    assert all(m.shape[1] - g.num_tokens < ROW_CHUNK and m[:, base[i]:g.num_tokens].all()
               and m.shape[1] == g._k.shape[0]                          # the mask grows with the rows
               for i, (m, g) in enumerate(zip(layer.masks, layer.groups)))
    lb = cache.layer_bytes()[0]
    assert lb.kv_bytes == sum(t.nbytes for t in layer.tensors())


def test_keeping_everything_reproduces_the_full_cache_run(tiny_model):
    """A compressed layer that keeps every token must decode exactly like the full cache: checks
    the after-compression attention path, its masks and the question prefill over it."""
    ev = Eviction(keep_tokens=10**6, window=8, scorer="snapkv", gqa_mode="repeat")
    prompt = Prompt(CONTEXT, QUESTION)
    full = Runner(tiny_model, torch.float16).run(prompt, full_plan(tiny_model.num_layers, "f"), Sampling(12))
    kept = Runner(tiny_model, torch.float16).run(prompt, _plan(tiny_model.num_layers, eviction=ev), Sampling(12))
    assert kept.token_ids == full.token_ids
    assert [x.kept_tokens for x in kept.layers] == [x.kept_tokens for x in full.layers]


def test_repeat_mode_stores_each_groups_union_once_plus_a_per_head_mask(tiny_model):
    ev = Eviction(keep_tokens=20, window=8, scorer="snapkv", gqa_mode="repeat")
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev))
    for lb, layer in zip(cache.layer_bytes(), cache.layers):
        assert lb.kv_bytes == sum(t.nbytes for t in layer.tensors())
        union = sum(g.num_tokens for g in layer.groups)
        assert union <= tiny_model.num_kv_heads * 2 * 28                  # at most h_n distinct sets
        assert layer.head_rows.dtype == torch.uint8 and layer.head_rows.shape == (4, 28)
        assert all(m.dtype == torch.bool and int(m.sum()) == 2 * 28 for m in layer.masks)   # 28 per head
        assert lb.kv_bytes == union * 2 * 16 * 2 + 2 * union               # K+V fp16 rows + a byte per head and row
        assert lb.full_kv_bytes == 2 * 90 * 2 * 16 * 2


def test_codebook_reconstruction_is_within_theta_with_exact_magnitudes(tiny_model):
    cb = Codebook(theta_k=0.9, theta_v=0.8)
    _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, codebook=cb))
    dense = _dense_kv(tiny_model)
    for layer, (k_full, v_full) in zip(cache.layers, dense):
        for g, group in enumerate(layer.groups):
            k, v = group.materialize(torch.float32)                           # [T, D] post-RoPE
            if group.coded:
                # RoPE is a rotation: the re-rotated key is as close to the original as pre-RoPE
                cos_k = torch.nn.functional.cosine_similarity(k, k_full[g], dim=-1)
                cos_v = torch.nn.functional.cosine_similarity(v, v_full[g], dim=-1)
                assert (cos_k > 0.9 - 2e-3).all() and (cos_v > 0.8 - 2e-3).all()
                torch.testing.assert_close(k.norm(dim=-1), k_full[g].norm(dim=-1), rtol=2e-3, atol=2e-3)
                torch.testing.assert_close(v.norm(dim=-1), v_full[g].norm(dim=-1), rtol=2e-3, atol=2e-3)
            else:
                assert torch.equal(k, k_full[g]) and torch.equal(v, v_full[g])


def test_codebook_with_theta_one_reapplies_rope_to_the_full_models_keys(tiny_model):
    """θ just below 1 makes every token its own entry: reconstruction must give back the full
    model's post-RoPE keys (up to fp16 storage), so RoPE is re-applied at the right positions."""
    from executor.layers.groups import CodebookGroup
    dense = _dense_kv(tiny_model)
    rotary = tiny_model.model.model.rotary_emb
    rope = (rotary.inv_freq.float(), float(rotary.attention_scaling))
    for g in range(tiny_model.num_kv_heads):
        coded = CodebookGroup.build(dense[0][0][g], dense[0][1][g], torch.arange(90), torch.float16, rope,
                                    0.99999, 0.99999)
        k, v = coded.materialize(torch.float32)
        torch.testing.assert_close(k, dense[0][0][g], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(v, dense[0][1][g], rtol=2e-2, atol=2e-2)


def test_codebook_layer_holds_its_byte_budget(tiny_model):
    """The eviction budget of a codebook layer is a byte budget: what the layer holds after
    compression never exceeds the dense bytes of that many tokens, whatever form it picks."""
    ev = Eviction(keep_tokens=20, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="repeat")
    budget = 30 * tiny_model.num_kv_heads * 2 * 16 * 2
    for theta in (0.6, 0.99999):
        _, cache = _prefill(tiny_model, _plan(tiny_model.num_layers, eviction=ev, codebook=Codebook(theta, theta)))
        for layer in cache.layers:
            assert sum(t.nbytes for t in layer.tensors()) <= budget
            assert layer.predicted_error >= 0.0
            if theta > 0.9:      # nothing merges at θ≈1: dense groups, the heads' union costs tokens
                assert not any(g.coded for g in layer.groups) and layer.prompt_rows <= 30


def _synthetic_layer(theta: float, directions: int = 4, t: int = 96, keep: int = 16):
    """A codebook layer (4 query heads, 2 KV heads, D = 16) compressing a context whose pre-RoPE
    keys and values each point in one of `directions` directions with random norms — exactly
    codable at any θ < 1. Returns the layer after compression and its byte budget."""
    from executor.layers.codebook import CodebookLayer
    from executor.layers.base import LayerContext
    from kernels import apply_rope
    gen = torch.Generator().manual_seed(0)
    d, hk, hq = 16, 2, 4
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ctx = LayerContext(torch.float16, hk, hq, d, (inv_freq, 1.0))
    ev = Eviction(keep_tokens=keep, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="repeat")
    layer = CodebookLayer(LayerPlan(0, eviction=ev, codebook=Codebook(theta, theta)), ctx)

    def rows():                                                     # [H_kv, T, D]
        dirs = torch.nn.functional.normalize(torch.randn(hk, directions, d, generator=gen), dim=-1)
        pick = torch.randint(directions, (hk, t), generator=gen)
        norm = 1.0 + 3.0 * torch.rand(hk, t, 1, generator=gen)
        return torch.gather(dirs, 1, pick[..., None].expand(-1, -1, d)) * norm

    k = apply_rope(rows(), torch.arange(t), inv_freq)              # post-RoPE, as attention hands them over
    v = rows()
    q = torch.randn(hq, 8, d, generator=gen)                        # the last chunk = the observation window
    layer.compress_context(q, k, v, d ** -0.5)
    return layer, hk * (2 + 8 + keep) * 2 * d * 2


def test_codebook_layer_codes_where_codes_lose_less_than_eviction():
    """Worked example: every key and value is one of 4 directions, so codes are exact; in the
    dense budget of 2 + 8 + 16 tokens the coded form holds every candidate (2 + 8 + 2·16)."""
    from executor.layers.codebook import CANDIDATES
    layer, budget = _synthetic_layer(0.98)
    assert sum(t.nbytes for t in layer.tensors()) <= budget
    assert all(g.coded and g.k_coded and g.v_coded for g in layer.groups)
    assert layer.prompt_rows == 2 + 8 + CANDIDATES * 16


def test_codebook_layer_keeps_dense_rows_where_codes_would_lose_more():
    """θ = -1 merges every vector into one entry per group: all values then point one way, so
    the window's attention output collapses onto one direction — far worse than evicting — and
    the layer keeps exact value rows (one key direction only rescales the logits by the key
    norms, which on this data loses less than eviction, so keys may still be coded)."""
    coded, _ = _synthetic_layer(0.98)
    layer, budget = _synthetic_layer(-1.0)
    assert sum(t.nbytes for t in layer.tensors()) <= budget
    assert not any(getattr(g, "v_coded", False) for g in layer.groups)
    assert layer.predicted_error > coded.predicted_error


def test_codebook_layers_decode_and_report_real_bytes(tiny_model):
    ev = Eviction(keep_tokens=30, window=8, scorer="snapkv", gqa_mode="repeat")
    plan = _plan(tiny_model.num_layers, eviction=ev, codebook=Codebook(0.5, 0.5))   # loose θ: codes for sure
    run = Runner(tiny_model, torch.float16).run(Prompt(CONTEXT, QUESTION), plan, Sampling(10))
    assert len(run.token_ids) == 10
    for lb in run.layers:
        assert lb.kind == "codebook" and 0 < lb.kv_bytes < lb.full_kv_bytes
        assert lb.kept_tokens >= 38 + len(QUESTION) + 9        # the codebook can afford more than 38


@pytest.mark.parametrize("k_coded, v_coded", [(True, True), (False, True), (True, False)])
def test_codebook_group_attention_equals_dense_attention_on_its_rows(tiny_model, k_coded, v_coded):
    """Values are never rebuilt at attention (weights summed per entry): the output must equal
    plain attention over the group's materialized rows, for either part coded or dense; a dense
    key part keeps no positions."""
    from executor.layers.groups import CodebookGroup, CodedRows
    from kernels import unrotate_rope
    k_full, v_full = _dense_kv(tiny_model)[1]
    rotary = tiny_model.model.model.rotary_emb
    rope = (rotary.inv_freq.float(), float(rotary.attention_scaling))
    pos = torch.arange(90)
    k_part = CodedRows.build(unrotate_rope(k_full[0], pos, *rope), 0.8, None, torch.float16) if k_coded else k_full[0]
    v_part = CodedRows.build(v_full[0], 0.7, None, torch.float16) if v_coded else v_full[0]
    group = CodebookGroup(k_part, v_part, pos, torch.float16, rope)
    group.append(k_full[1, :3], v_full[1, :3], torch.arange(90, 93))
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(5))       # [h_n, Tq, D]
    mask = torch.rand(2, 4, 93, generator=torch.Generator().manual_seed(6)) > 0.3
    mask[..., -1] = True
    k, v = group.materialize(torch.float32)
    want = torch.nn.functional.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, scale=0.25)
    torch.testing.assert_close(group.attend(q, mask, 0.25), want, rtol=1e-4, atol=1e-5)
    assert group.num_tokens == 93 and (group.pos is not None) == k_coded
    dense_rows = [t for t in group.tensors() if t.shape == (93, 16)]
    assert len(dense_rows) == (not k_coded) + (not v_coded) and all(t.dtype == torch.float16 for t in dense_rows)
