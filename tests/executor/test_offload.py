"""The `offload` layer (SpeCache): the low-bit copy, speculative decoding over it with prefetched
exact rows, byte accounting, and a store lost mid-job (degraded, not failed)."""
import dataclasses

import pytest
import torch

import kernels
from cachestore.handle import LocalHandle, StoreUnavailable, Unavailable
from executor.layers.lowbit import LowBitKV
from executor.prompt import Prompt
from executor.runner import Runner, Sampling
from kvcore import offload_budget
from kvcore.cost import lowbit_bytes
from kvplan.plan import OffloadPlan, full_plan

PROMPT = Prompt(list(range(100, 171)), [])          # 71 tokens


def offload_plan(m: int, **part) -> "CompressionPlan":
    off = OffloadPlan(enabled=True, **{"low_bits": 2, "group_size": 32, "top_k": 64, "recent_window": 0,
                                       "sink_tokens": 0, **part})
    return dataclasses.replace(full_plan(m, "t"), strategy="specache", offload=off)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_lowbit_copy_keeps_every_row_within_its_quantization_error(bits):
    g = torch.Generator().manual_seed(bits)
    k, v = torch.randn(2, 45, 16, generator=g), torch.randn(2, 45, 16, generator=g)     # [H, T, D]
    low = LowBitKV(k[:, :37], v[:, :37], bits, 8, residual=4)
    assert (low.v_codes.shape[1], low.k_rows) == (33, 0)      # values leave the window at once, keys wait
    low.seal()                                   # 33 keys quantized: the last key group padded (1 of 8)
    assert (low.quantized, low.tail) == (33, 4) and low.pads == [(4, 1)]
    low.append(k[:, 37:39], v[:, 37:39])         # values slide (35 low-bit), keys wait for a whole group
    assert (low.k_rows, low.v_codes.shape[1], low.tail) == (33, 35, 6)
    low.append(k[:, 39:], v[:, 39:])             # key tail 12 = residual + g: the oldest 8 are quantized
    assert (low.quantized, low.tail) == (41, 4)
    kq, vq = low.rows(torch.float32)
    assert kq.shape == vq.shape == (2, 45, 16)
    assert torch.equal(kq[:, 41:], k[:, 41:].half().float()) and torch.equal(vq[:, 41:], v[:, 41:].half().float())
    # per key group and channel: no more squared error than the plain quantizer's (min/max, the
    # midpoint levels at 1 bit) — the refits only move each group's scale and zero — and every
    # element within its group's range
    levels = 2 ** bits - 1
    for a, b in ((0, 8), (8, 16), (16, 24), (24, 32), (32, 33), (33, 41)):    # the key groups: row 32 sealed alone
        rows = k[:, a:b].half().float()                                      # [H, b-a, D] as stored
        span = rows.amax(1, keepdim=True) - rows.amin(1, keepdim=True)      # [H, 1, D]
        assert ((kq[:, a:b] - rows).abs() <= span + 1e-2).all()
        sse = ((kq[:, a:b] - rows) ** 2).sum(1)                              # [H, D]
        ref = ((_plain(rows, bits) - rows) ** 2).sum(1)
        assert (sse <= ref * 1.01 + 1e-4).all()
    assert (vq[:, :41] - v[:, :41]).abs().max() <= (v[:, :41].amax() - v[:, :41].amin()) / (levels if bits > 1 else 2)


def _plain(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """rows [H, n, D] of one key group -> their plain per-channel quantization (no refits), the
    group padded to 8 rows with its last row as `LowBitKV` pads it."""
    h, n, d = rows.shape
    padded = torch.cat([rows, rows[:, -1:].expand(h, 8 - n, d)], dim=1)           # [H, 8, D]
    per_channel = padded.transpose(1, 2).reshape(h * d, 8)                       # [H·D, 8]
    back = kernels.unpack_dequantize(*kernels.quantize_pack(per_channel, bits, 8, midpoint=bits == 1), bits, 8)
    return back.view(h, d, 8).transpose(1, 2)[:, :n]


def test_lowbit_bytes_bound_what_the_copy_holds():
    low = LowBitKV(torch.randn(3, 100, 64), torch.randn(3, 100, 64), 2, 32, residual=16)
    low.seal()
    held = sum(t.nbytes for t in low.tensors())
    # 84 rows quantized in 3 key groups (the last padded): per head 3·64·(8 codes + 4) key bytes,
    # 84·(16 codes + 2 groups·4) value bytes, and the 16-row fp16 tail
    assert held == 3 * (3 * 64 * 12 + 84 * 24 + 16 * 64 * 4) == lowbit_bytes(100, 3, 64, 2, 32, 16, 16, pads=0)
    assert held <= lowbit_bytes(100, 3, 64, 2, 32, 16, 16)
    low = LowBitKV(torch.randn(3, 100, 64), torch.randn(3, 100, 64), 2, 32, residual=16, value_group=64)
    low.seal()                                   # one value scale per token: 4 bytes less per row
    assert sum(t.nbytes for t in low.tensors()) == held - 3 * 84 * 4


@torch.inference_mode()
def test_exact_rows_for_every_candidate_reproduce_full_kv(tiny_model):
    """top_k >= every quantized row: each step's mixed cache is exact, so greedy decoding equals
    the full cache's token for token, and every prefetch holds the oracle's rows."""
    runner = Runner(tiny_model, torch.float16, prefetch_wait_s=30.0)     # the `wait` policy: none is late
    full = runner.run(PROMPT, full_plan(tiny_model.num_layers, "t"), Sampling(8))
    store = LocalHandle()
    got = runner.run(PROMPT, offload_plan(tiny_model.num_layers, low_bits=2, top_k=128), Sampling(8),
                     store=store, measure_recall=True)
    assert got.token_ids == full.token_ids and len(got.token_ids) == 8
    assert got.offload["recall"] == 1.0 and got.offload["stats"]["late"] == 0
    assert got.offload["stats"]["prefetches"] == tiny_model.num_layers * 8     # predecode + 7 steps, per layer
    assert got.layers[0].kind == "offload" and not got.degraded
    k, _ = store.read(0)
    assert k.shape == (tiny_model.num_kv_heads, 71 + 7, tiny_model.head_dim)     # every committed row offloaded
    store.release()


@torch.inference_mode()
def test_offload_bytes_are_the_tensors_held_and_fit_the_budget(tiny_model):
    runner = Runner(tiny_model, torch.float16)
    prompt = Prompt(list(range(100, 240)), [])
    run = runner.run(prompt, offload_plan(tiny_model.num_layers, group_size=32, top_k=64, recent_window=64),
                     Sampling(5), budget=0.6)
    part = OffloadPlan(**run.offload["part"])
    assert part.top_k < 64 or part.recent_window < 64          # shrunk to fit
    ratio = run.kv_bytes / run.full_kv_bytes
    assert ratio <= 0.6
    assert ratio <= offload_budget.ratio(part, 140, 5, tiny_model.head_dim) + 1e-9
    cache = runner.new_cache(runner.fit(offload_plan(tiny_model.num_layers), prompt, Sampling(5), None), LocalHandle())
    runner.prefill(prompt, cache)
    layer = cache.layers[0]
    assert cache.layer_bytes()[0].kv_bytes == sum(t.nbytes for t in layer.tensors())
    assert layer.keys is None                                     # the dense copy is gone


@torch.inference_mode()
@pytest.mark.parametrize("rerank", [1, 32])
def test_the_prefetch_takes_the_low_bit_top_k_or_re_ranks_candidates_by_exact_keys(tiny_model, rerank):
    """rerank 1 (SpeCache as published): the top-k of the low-bit scores. rerank 32: all 71
    quantized rows are candidates, so the rows brought are the query's top-k over the exact keys
    whatever the low-bit scores say."""
    runner, store = Runner(tiny_model, torch.float16), LocalHandle()
    plan = offload_plan(tiny_model.num_layers, top_k=4, rerank=rerank)
    cache = runner.new_cache(runner.fit(plan, PROMPT, Sampling(4), None), store)
    runner.prefill(PROMPT, cache)
    layer, hk, d = cache.layers[1], tiny_model.num_kv_heads, tiny_model.head_dim
    hn = tiny_model.num_query_heads // hk
    g = torch.Generator().manual_seed(5)
    scores, query = torch.rand(hk, 71, generator=g), torch.randn(hk, hn, d, generator=g)   # [H_kv, L], [H_kv, h_n, D]
    layer._select(scores, query, step=3)
    got = store.take(1, 3, wait_s=5.0).idx.sort(-1).values                                  # [H_kv, 4]
    if rerank == 1:
        expect = scores.topk(4, dim=-1).indices
    else:
        keys = store.read(1)[0].float()                                                     # [H_kv, 71, D] exact
        expect = torch.softmax(torch.einsum("ghd,gld->ghl", query, keys), dim=-1).mean(1).topk(4, dim=-1).indices
    assert torch.equal(got, expect.sort(-1).values)
    store.release()


@torch.inference_mode()
def test_decode_scores_from_the_codes_equal_scores_over_the_dequantized_rows(tiny_model):
    """A decode step scores the low-bit keys straight from their codes (`kernels.lowbit_scores`):
    with sinks, a padded key group (71 = 2·32 + 7 prompt rows, window 4) and prefetched rows put
    in place, the scores and values equal those over `_lowbit`'s dequantized K and V."""
    from cachestore.handle import Fetched
    runner, store = Runner(tiny_model, torch.float16), LocalHandle()
    plan = offload_plan(tiny_model.num_layers, top_k=8, sink_tokens=2, recent_window=4)
    cache = runner.new_cache(runner.fit(plan, PROMPT, Sampling(4), None), store)
    runner.prefill(PROMPT, cache)
    layer, hk, d = cache.layers[1], tiny_model.num_kv_heads, tiny_model.head_dim
    assert layer.low.pads, "the case needs a padded key group"
    g = torch.Generator().manual_seed(9)
    q, nk, nv = torch.randn(hk, 6, d, generator=g), torch.randn(hk, 2, d, generator=g), torch.randn(hk, 2, d, generator=g)
    idx = torch.stack([torch.randperm(60, generator=g)[:8] + 2 for _ in range(hk)])             # [H_kv, 8]
    k_all, v_all = store.read(1)
    fetched = Fetched(idx, k_all.gather(1, idx[..., None].expand(-1, -1, d)), v_all.gather(1, idx[..., None].expand(-1, -1, d)))
    k, v = layer._lowbit(torch.float32)                                                          # [H_kv, 71, D]
    k.scatter_(1, idx[..., None].expand(-1, -1, d), fetched.k.float())
    v.scatter_(1, idx[..., None].expand(-1, -1, d), fetched.v.float())
    k, v = torch.cat([k, nk], dim=1), torch.cat([v, nv], dim=1)                                # [H_kv, 73, D]
    assert torch.allclose(layer._scores(q, fetched, nk), torch.einsum("hrd,hld->hrl", q, k), atol=1e-4)
    assert torch.equal(layer._values(torch.float32, fetched, nv), v)
    store.release()


class DiesAfter(LocalHandle):
    """A store that goes away after `n` puts, as a killed cachestore does."""

    def __init__(self, n: int):
        super().__init__()
        self.left = n

    def _put(self, layer, k, v):
        self.left -= 1
        if self.left < 0:
            raise StoreUnavailable("cachestore at 127.0.0.1:1 went away")
        super()._put(layer, k, v)


@torch.inference_mode()
def test_a_store_lost_mid_job_finishes_on_the_low_bit_copy(tiny_model):
    runner = Runner(tiny_model, torch.float16)
    plan = offload_plan(tiny_model.num_layers)
    store = DiesAfter(tiny_model.num_layers + 3)        # the prompt's rows, then three decode rows
    run = runner.run(PROMPT, plan, Sampling(8), store=store)
    assert len(run.token_ids) == 8 and run.finish_reason == "length"
    assert run.degraded and "went away" in run.offload["error"]
    assert run.offload["stats"]["in_time"] > 0                 # prefetches worked before the loss
    unreachable = runner.run(PROMPT, plan, Sampling(4), store=Unavailable("connection refused"))
    assert len(unreachable.token_ids) == 4 and unreachable.degraded and unreachable.offload["transport"] == "none"


def test_an_offload_plan_without_a_store_is_refused(tiny_model):
    from executor.cache import UnsupportedPlan
    with pytest.raises(UnsupportedPlan, match="no cachestore handle"):
        Runner(tiny_model, torch.float16).new_cache(offload_plan(tiny_model.num_layers))


@torch.inference_mode()
def test_cachestore_killed_mid_job_over_shared_memory_the_job_completes_degraded(tiny_model):
    """The real transport: a `python -m cachestore` process, the job's rows in its segment; it is
    SIGKILLed after the second token; the job still produces every token, reports degraded, and
    leaves nothing in /dev/shm once released."""
    from cachestore.process import spawn
    from cachestore.segment import leftovers

    with spawn(timeout_s=2) as (proc, client):
        plan = offload_plan(tiny_model.num_layers)
        store = client.open("acme", "killed-mid-job", tiny_model.num_layers, tiny_model.num_kv_heads,
                            tiny_model.head_dim, torch.float16, PROMPT.num_tokens + 10, plan.offload.top_k)
        assert store.transport == "shm"
        steps = []

        def cancelled():                      # asked per prefill chunk (one) and per token: kill after the second token
            steps.append(1)
            if len(steps) == 3:
                proc.kill()
                proc.wait(30)
            return False

        run = Runner(tiny_model, torch.float16, prefetch_wait_s=5.0).run(PROMPT, plan, Sampling(8), cancelled=cancelled,
                                                                        store=store)
        assert len(run.token_ids) == 8 and run.degraded and run.offload["transport"] == "shm"
        assert run.offload["stats"]["in_time"] > 0 and "UNAVAILABLE" in run.offload["error"]
        store.release()
        assert store.seg.name not in leftovers()
