"""SpindleKV's press on worked examples and the tiny model: coded keys come back turned by RoPE at
their positions within θ of the full rows with their exact magnitudes; θ≈1 gives the full model's
keys back; the layer codes where codes lose less than eviction and keeps exact rows where they
would lose more; it decodes and reports the pages it holds."""
import types

import torch

from executor.engine.block_tables import BlockTables
from executor.engine.kv_pool import KVPool
from executor.presses import codebook
from executor.presses.context import PressContext
from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kernels import apply_rope
from kernels.paged_decode import coded_fields
from kvcore.blocks import Layout
from kvcore.plan import Codebook, Eviction, LayerPlan
from tests.executor.presses.helpers import CONTEXT, QUESTION, dense_kv, plan_of, prefill, streams


def test_codebook_reconstruction_is_within_theta_with_exact_magnitudes(tiny_model):
    runner, cache = prefill(tiny_model, plan_of(tiny_model.num_layers, codebook=Codebook(theta_k=0.6, theta_v=0.5)))
    coded_any = False
    for i, (k_full, v_full) in enumerate(dense_kv(tiny_model)):
        for g, (k, v, _) in enumerate(streams(runner, cache, i)):                 # [90, D] post-RoPE
            cos_k = torch.nn.functional.cosine_similarity(k, k_full[g], dim=-1)
            cos_v = torch.nn.functional.cosine_similarity(v, v_full[g], dim=-1)
            assert (cos_k > 0.6 - 2e-3).all() and (cos_v > 0.5 - 2e-3).all()     # RoPE is a rotation
            torch.testing.assert_close(k.norm(dim=-1), k_full[g].norm(dim=-1), rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(v.norm(dim=-1), v_full[g].norm(dim=-1), rtol=2e-3, atol=2e-3)
            coded_any |= int(cache.tables.ekn[i, cache.slot, g]) < 90 or int(cache.tables.evn[i, cache.slot, g]) < 90
    assert coded_any, "loose θ: some part coded"
    cache.close()


def test_codebook_with_theta_one_reapplies_rope_to_the_full_models_keys(tiny_model):
    runner, cache = prefill(tiny_model, plan_of(tiny_model.num_layers, codebook=Codebook(0.99999, 0.99999)))
    for i, (k_full, v_full) in enumerate(dense_kv(tiny_model)):
        for g, (k, v, _) in enumerate(streams(runner, cache, i)):
            torch.testing.assert_close(k, k_full[g], rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(v, v_full[g], rtol=2e-2, atol=2e-2)
    cache.close()


def _synthetic(theta: float, directions: int = 4, t: int = 96, keep: int = 16):
    """The press on a context (4 query heads, 2 KV heads, D = 16) whose pre-RoPE keys and values
    each point in one of `directions` directions with random norms: exactly codable at any θ < 1.
    -> (coded fields per head, K entries, V entries, the tables, the slot)."""
    gen = torch.Generator().manual_seed(0)
    d, hk, hq = 16, 2, 4
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    lay = Layout(d)
    tables = BlockTables(KVPool(lay, 4 << 20), 1, hk, 2, 512)
    freqs = torch.arange(512)[:, None].float() * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    ctx = PressContext(tables, hq, d ** -0.5, (inv_freq, 1.0), (emb.cos(), emb.sin()))
    ev = Eviction(keep_tokens=keep, window=8, sink_tokens=2, scorer="snapkv", gqa_mode="repeat")
    lp = LayerPlan(0, eviction=ev, codebook=Codebook(theta, theta))

    def rows():                                                     # [H_kv, T, D]
        dirs = torch.nn.functional.normalize(torch.randn(hk, directions, d, generator=gen), dim=-1)
        pick = torch.randint(directions, (hk, t), generator=gen)
        norm = 1.0 + 3.0 * torch.rand(hk, t, 1, generator=gen)
        return torch.gather(dirs, 1, pick[..., None].expand(-1, -1, d)) * norm

    k = apply_rope(rows(), torch.arange(t), inv_freq)              # post-RoPE, as attention hands them over
    v = rows()
    q = torch.randn(hq, 8, d, generator=gen)                        # the last chunk = the observation window
    slot = tables.open()
    seq = types.SimpleNamespace(cache=types.SimpleNamespace(slot=slot), acc={})
    codebook.press(ctx, seq, 0, lp, q, k, v)
    fields = [coded_fields(tables.pool.arena, tables.ctable[0, slot, h], int(tables.cn[0, slot, h]), lay)
              for h in range(hk)]
    return fields, tables, slot


def test_codebook_press_codes_where_codes_lose_less_than_eviction():
    """Every key and value is one of 4 directions, so codes are exact: in the dense budget of
    2 + 8 + 16 tokens the coded form holds every candidate (2 + 8 + 2·16 per query head)."""
    fields, tables, slot = _synthetic(0.98)
    for h, f in enumerate(fields):
        live = f["ref_k"] >= 0
        assert bool((f["pos"][live] >= 0).all())                                  # keys coded (turned by position)
        assert int(tables.ekn[0, slot, h]) <= 4 and int(tables.evn[0, slot, h]) <= 4   # one entry a direction
        for j in range(2):
            assert int(((f["heads"][live].long() >> j) & 1).sum()) == 2 + 8 + codebook.CANDIDATES * 16


def test_codebook_press_keeps_exact_values_where_codes_would_lose_more():
    """θ = -1 merges every vector into one entry: all values would point one way, worse than
    evicting, so the press keeps exact value rows (an entry each)."""
    fields, tables, slot = _synthetic(-1.0)
    for h, f in enumerate(fields):
        live = int((f["ref_k"] >= 0).sum())
        assert int(tables.evn[0, slot, h]) >= live                                # every value its own entry


def test_codebook_layers_decode_and_report_the_pages_they_hold(tiny_model):
    ev = Eviction(keep_tokens=30, window=8, scorer="snapkv", gqa_mode="repeat")
    plan = plan_of(tiny_model.num_layers, eviction=ev, codebook=Codebook(0.5, 0.5))   # loose θ: codes for sure
    run = Runner(tiny_model, torch.float16).run(Prompt(CONTEXT, QUESTION), plan, Sampling(10))
    assert len(run.token_ids) == 10
    page = Layout(tiny_model.head_dim).page_bytes
    for lb in run.layers:
        assert lb.kind == "codebook" and 0 < lb.kv_bytes < lb.full_kv_bytes and lb.kv_bytes % page == 0
