"""The storage-form losses against the attention they stand for, computed the plain way: for
each eviction share, SDPA over exactly the tokens kept (sinks, window, the best-ranked share of
the rest per KV head, GQA heads sharing their KV head's set); for each bit width, SDPA over K/V
quantized and dequantized by the quant layer's own kernels in the pool's groups (one page a group:
`kvcore.blocks.quant_shape`, 24/48/96 rows at 8/4/2 bits, the rest of the rows exact); the retained
mass summed over the kept tokens."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import quantize_pack, unpack_dequantize
from kvcore import scoring
from kvcore import statistics as S
from kvcore.blocks import quant_shape


def _plain(q, k, v, mass_h, scaling, window):
    """The losses by masked SDPA, one attention per share and per bit width."""
    h, wq, d = q.shape
    hk, t, _ = k.shape
    sinks = min(S.SINKS, t - window)
    n_ctx = t - window - sinks
    cols = torch.arange(t)
    causal = cols[None, :] <= cols[t - wq:, None]

    def out(kk, vv, mask):
        return F.scaled_dot_product_attention(q[None], kk[None], vv[None], attn_mask=mask[None], scale=scaling,
                                              enable_gqa=True)[0]

    def rel(a, b):
        return float((a - b).pow(2).sum() / b.pow(2).sum())
    exact = out(k, v, causal[None])
    mass = scoring.group_mean(mass_h, hk)
    mass = mass / mass.sum(-1, keepdim=True)
    order = scoring.spread(scoring.pool(mass, S.POOL), S.SPAN)[:, sinks:t - window].argsort(-1, descending=True) + sinks
    evict, retained = [], []
    for f in S.FRACTIONS:
        kept = torch.zeros(hk, t, dtype=torch.bool)
        kept[:, :sinks] = kept[:, t - window:] = True
        kept.scatter_(1, order[:, :round(f * n_ctx)], True)
        evict.append(rel(out(k, v, kept.repeat_interleave(h // hk, 0)[:, None] & causal[None]), exact))
        retained.append(float((mass * kept).sum(-1).mean()))
    quant = []
    for bits in S.BITS:
        if bits == 16:
            quant.append(0.0)
            continue
        rows, value_group = quant_shape(bits)
        q_t, g = t - t % rows, math.gcd(value_group, d)
        kq, vq = k.clone(), v.clone()
        if q_t:
            kt = k[:, :q_t].transpose(1, 2).reshape(hk * d, q_t)
            kq[:, :q_t] = unpack_dequantize(*quantize_pack(kt, bits, rows), bits, rows).view(hk, d, q_t).transpose(1, 2)
            vq[:, :q_t] = unpack_dequantize(*quantize_pack(v[:, :q_t].reshape(-1, d), bits, g), bits, g).view(hk, q_t, d)
        quant.append(rel(out(kq, vq, causal[None]), exact))
    return np.array(evict), np.array(retained), np.array(quant)


def test_the_losses_are_the_attention_error_of_each_storage_form():
    for t, seed in ((300, 0), (157, 1), (45, 2)):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(9, 8, 64, generator=gen)
        k, v = torch.randn(3, t, 64, generator=gen) * 2, torch.randn(3, t, 64, generator=gen)
        mass = scoring.window_scores(torch.randn(9, 32, 64, generator=gen), k, 0.125)
        got = S.layer_losses(q, k, v, mass, 0.125, 32)
        want = _plain(q, k, v, mass, 0.125, 32)
        for g, w, name in zip(got, want, ("evict", "retained", "quant")):
            assert g.shape == w.shape, name
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7, err_msg=f"{name} at {t} tokens")
        assert got[0][0] == 0.0 and got[0][-1] > got[0][1] > 0          # all kept: exact; fewer kept: worse
        quantized = [t >= quant_shape(b)[0] for b in S.BITS[1:]]          # a group's rows, or all dense
        assert [float(x) > 0 for x in got[2][1:]] == quantized, t
        if all(quantized):
            assert 0 < got[2][1] < got[2][2] < got[2][3]                  # 8 < 4 < 2 bits


def test_the_window_probabilities_are_the_window_scores_and_the_loss_queries_rows():
    from kernels.window_stats import window_stats
    gen = torch.Generator().manual_seed(3)
    for t, w in ((300, 32), (20, 20)):
        q, k = torch.randn(9, w, 64, generator=gen), torch.randn(3, t, 64, generator=gen)
        e = min(S.ERROR_QUERIES, t)
        s, last = window_stats(q.reshape(3, 3 * w, 64), k, w, e, 0.125)          # [H_kv, g, T], [H_kv, g e, T]
        assert s.shape == (3, 3, t) and last.shape == (3, 3 * e, t)
        torch.testing.assert_close(s.reshape(9, t), scoring.window_scores(q, k, 0.125), rtol=1e-5, atol=1e-6)
        cols = torch.arange(t)
        causal = cols[None, :] <= cols[t - e:, None]
        torch.testing.assert_close(last, S._grouped_probs(q[:, -e:], k.transpose(1, 2), causal, 0.125),
                                   rtol=1e-5, atol=1e-6)


def test_angle_is_the_mean_arccos_of_the_rows_cosines():
    torch.manual_seed(1)
    a, b = torch.randn(3, 50, 64), torch.randn(3, 50, 64)
    want = float(torch.arccos(F.cosine_similarity(a, b, dim=-1).clamp(-1, 1)).mean() / math.pi)
    assert S.angle(a, b) == pytest.approx(want, abs=1e-6)
    assert S.angle(a, a) == pytest.approx(0.0, abs=1e-3) and S.angle(a, -a) == pytest.approx(1.0, abs=1e-3)


def test_without_shares_the_statistics_travel_and_check_as_with_them():
    """The executor's prefill leaves the similar-row shares out (no plan reads them): its
    statistics say so with none, and the planner's check takes none or one a layer, not other counts."""
    torch.manual_seed(2)
    m, hk, h, t, d = 3, 2, 4, 40, 16
    got = {}
    for shares in (True, False):
        st = S.LayerStatistics("repeat", False, window=8, shares=shares)
        for _ in range(m):
            k, v = torch.randn(hk, t, d), torch.randn(hk, t, d)
            st.add(torch.randn(h, 8, d), k, k, v, 0.25)
        got[shares] = st.result()
    assert got[True].k_similar.shape == (m,) and got[False].k_similar.shape == got[False].v_similar.shape == (0,)
    assert got[False].k_angle.shape == (m - 1,)
    back = S.from_proto(S.to_proto(got[False]), m, h, t)
    assert back.k_similar.shape == (0,) and np.allclose(back.k_angle, got[False].k_angle)
    msg = S.to_proto(got[True])
    del msg.k_similar[-1]
    with pytest.raises(ValueError, match=r"^stats\.k_similar: expected 3 values, got 2$"):
        S.from_proto(msg, m, h, t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here: the host-sync check needs a CUDA device")
def test_gathering_on_cuda_reads_nothing_back_until_the_result():
    """An executor's CUDA prefill adds each layer's statistics between its layers: nothing in `add`
    may wait on the device (torch's sync debug mode makes any such wait an error); `result` then
    copies every layer's figures back at once, the same as gathered on the CPU."""
    gen = torch.Generator().manual_seed(3)
    layers = [(torch.randn(9, 64, 64, generator=gen), torch.randn(3, 700, 64, generator=gen),
               torch.randn(3, 700, 64, generator=gen), torch.randn(3, 700, 64, generator=gen)) for _ in range(3)]
    got = {}
    for dev in ("cpu", "cuda"):
        st = S.LayerStatistics("mean", True, shares=False)
        on_dev = [[t.to(dev) for t in layer] for layer in layers]          # copied before: a copy from the host waits
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for q, k_rot, k_pre, v in on_dev:
                st.add(q, k_rot, k_pre, v, 0.125)
        finally:
            torch.cuda.set_sync_debug_mode(0) if dev == "cuda" else None
        got[dev] = st.result()
    cpu, cuda = got["cpu"], got["cuda"]
    np.testing.assert_allclose(cuda.window_scores, cpu.window_scores, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(cuda.k_angle, cpu.k_angle, rtol=1e-4)
    for name in ("evict", "retained", "quant"):
        np.testing.assert_allclose(getattr(cuda.losses, name), getattr(cpu.losses, name), rtol=2e-2, atol=1e-6, err_msg=name)


def test_the_layers_angles_are_those_of_adjacent_layers():
    """`LayerStatistics` reuses a layer's row norms for the next layer's angle: the same figures as
    `angle` of each adjacent pair."""
    gen = torch.Generator().manual_seed(5)
    ks = [torch.randn(3, 40, 64, generator=gen).half() for _ in range(3)]
    vs = [torch.randn(3, 40, 64, generator=gen).half() for _ in range(3)]
    ls = S.LayerStatistics("repeat", losses=False, shares=False)
    for k, v in zip(ks, vs):
        ls.add(torch.randn(9, 32, 64, generator=gen), k, k, v, 0.125)
    got = ls.result()
    np.testing.assert_allclose(got.k_angle, [S.angle(ks[0], ks[1]), S.angle(ks[1], ks[2])], rtol=1e-5)
    np.testing.assert_allclose(got.v_angle, [S.angle(vs[0], vs[1]), S.angle(vs[1], vs[2])], rtol=1e-5)


def test_window_scores_go_on_the_wire_as_numpys_fp16_bytes():
    """The wire's fp16 bytes (made through torch: numpy converts subnormal halves in software) are
    numpy's little-endian fp16, subnormals, zeros and the largest half included, and come back as
    numpy reads them."""
    x = np.array([0.0, 1.0, 2.0 ** -24, 3e-7, 6.0e-5, 6.2e-5, 65504.0, 1 / 3, 1e-9], np.float32)
    x = np.concatenate([x, np.random.default_rng(0).random(4096, np.float32) ** 8 / 4096])   # most subnormal
    b = S._fp16_bytes(x.reshape(1, 1, -1))
    assert b == x.astype("<f2").tobytes()
    back = S._from_fp16_bytes(b)
    assert back.dtype == np.float32 and np.array_equal(back, np.frombuffer(b, "<f2").astype(np.float32))
