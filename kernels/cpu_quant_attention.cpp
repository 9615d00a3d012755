// Attention of a layer's last queries over its K/V as KIVI quantization at several bit widths would
// store them (`quant_attention`; launcher and torch reference: kernels/quant_attention.py): what
// the statistics' quant losses measure (kvcore/statistics.py). Each width's quantized copy is made
// on the fly, one group of rows at a time, and attended flash-style (kernels/cpu_flash.h) — never
// stored: the statistics run inside the executor's prefill, and writing a dequantized K and V per
// width per layer was most of their cost. K is read transposed (made once per call), so a channel's
// group of rows is one contiguous span, as a V row's channel group is.
//
// Quantization as the pool's (kernels.quant: min/max levels, no refits): K per channel over groups
// of `rows` rows, V per row over groups of `vgroup` channels; scale (max - min) / (2^b - 1) and
// zero min both rounded to fp16, code floor((x - zero) / scale + 0.5) clamped to [0, 2^b - 1] (scale
// 0: code 0), value zero + code * scale in fp32. Rows past the last whole group stay exact.
//
// Shapes: G KV heads, Qn query rows per head (g query heads x Wq window rows, head-major: row r sits
// at position T - Wq + r % Wq and sees rows 0..that), T rows, D head dim, B widths.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_flash.h"
#include "cpu_vec.h"

namespace {

namespace flash = kvplan::flash;
using flash::KB;

inline float fp16_round(float x) { return static_cast<float>(c10::Half(x)); }       // nearest even

// code * scale + zero of x, as kernels.quant's dequantized_at
inline float requant(float x, float s, float z, float levels) {
  const float safe = s > 0.f ? s : 1.f;
  float c = std::floor((x - z) / safe + 0.5f);
  c = c < 0.f ? 0.f : (c > levels ? levels : c);
  return z + c * s;
}

#ifdef KVPLAN_AVX512
inline __m512 requant16(__m512 x, __m512 s, __m512 z, __m512 levels) {
  const __m512 safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.f), s);
  __m512 c = _mm512_roundscale_ps(_mm512_add_ps(_mm512_div_ps(_mm512_sub_ps(x, z), safe), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  c = _mm512_min_ps(_mm512_max_ps(c, _mm512_setzero_ps()), levels);
  return _mm512_add_ps(z, _mm512_mul_ps(c, s));
}
#endif

// n contiguous values quantized as one group (K: one channel over a group's rows, read from K
// transposed; V: one row's channel group) -> out [n]
inline void quant_span(const float* x, int64_t n, float levels, float* out) {
#ifdef KVPLAN_AVX512
  __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    mn = _mm512_mask_min_ps(mn, m, mn, v);
    mx = _mm512_mask_max_ps(mx, m, mx, v);
  }
  const float lo = _mm512_reduce_min_ps(mn), hi = _mm512_reduce_max_ps(mx);
  const __m512 s = _mm512_set1_ps(fp16_round((hi - lo) / levels)), z = _mm512_set1_ps(fp16_round(lo));
  const __m512 lv = _mm512_set1_ps(levels);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(out + i, m, requant16(_mm512_maskz_loadu_ps(m, x + i), s, z, lv));
  }
#else
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const float s = fp16_round((hi - lo) / levels), z = fp16_round(lo);
  for (int64_t i = 0; i < n; ++i) out[i] = requant(x[i], s, z, levels);
#endif
}

#ifdef KVPLAN_AVX512
// fp16 rounding of 16 floats at once (nearest even, subnormals kept: c10::Half's)
inline __m512 fp16_round16(__m512 x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// every lane the min (max) of its group of g lanes (g in 1, 2, 4, 8, 16): a butterfly over lane ^ k
inline void group_minmax(__m512& mn, __m512& mx, int64_t g) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int k = 1; k < g && k < 16; k *= 2) {
    const __m512i idx = _mm512_xor_si512(lane, _mm512_set1_epi32(k));
    mn = _mm512_min_ps(mn, _mm512_permutexvar_ps(idx, mn));
    mx = _mm512_max_ps(mx, _mm512_permutexvar_ps(idx, mx));
  }
}

// K's groups of n rows [r0, r0 + n): per channel min/max taken down the rows of k [T, D] (16 channels
// a vector, no reduction across lanes), then each channel's span of kt [D, T] quantized -> kq [D, n]
inline void quant_k_group(const float* k, const float* kt, int64_t T, int64_t D, int64_t r0, int64_t n, float levels,
                          float* kq) {
  const __m512 lv = _mm512_set1_ps(levels);
  for (int64_t c0 = 0; c0 < D; c0 += 16) {
    const __mmask16 cm = D - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - c0)) - 1u);
    __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY);
    for (int64_t r = 0; r < n; ++r) {
      const __m512 v = _mm512_maskz_loadu_ps(cm, k + (r0 + r) * D + c0);
      mn = _mm512_min_ps(mn, v);
      mx = _mm512_max_ps(mx, v);
    }
    alignas(64) float sv[16], zv[16];
    _mm512_store_ps(sv, fp16_round16(_mm512_div_ps(_mm512_sub_ps(mx, mn), lv)));
    _mm512_store_ps(zv, fp16_round16(mn));
    for (int64_t c = c0; c < std::min(D, c0 + 16); ++c) {
      const __m512 sc = _mm512_set1_ps(sv[c - c0]), zc = _mm512_set1_ps(zv[c - c0]);
      const float* x = kt + c * T + r0;
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(kq + c * n + i, m, requant16(_mm512_maskz_loadu_ps(m, x + i), sc, zc, lv));
      }
    }
  }
}

// one V row [D] in groups of g channels (g dividing 16, or a multiple of 16 dividing D) -> out [D]
inline void quant_v_row(const float* x, int64_t D, int64_t g, float levels, float* out) {
  const __m512 lv = _mm512_set1_ps(levels);
  for (int64_t c0 = 0; c0 < D; c0 += std::max<int64_t>(g, 16)) {
    const int64_t nv = std::max<int64_t>(g, 16) / 16;             // vectors a group (or a vector's groups) spans
    __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < nv; ++j) {
      const __m512 v = _mm512_loadu_ps(x + c0 + 16 * j);
      mn = _mm512_min_ps(mn, v);
      mx = _mm512_max_ps(mx, v);
    }
    group_minmax(mn, mx, std::min<int64_t>(g, 16));
    const __m512 sc = fp16_round16(_mm512_div_ps(_mm512_sub_ps(mx, mn), lv)), zc = fp16_round16(mn);
    for (int64_t j = 0; j < nv; ++j)
      _mm512_storeu_ps(out + c0 + 16 * j, requant16(_mm512_loadu_ps(x + c0 + 16 * j), sc, zc, lv));
  }
}
#endif

struct Scratch {
  std::vector<float> kq, vq, kt, vb, q, p, acc, m, l;     // kq: a group's K copy transposed [D, rows]
  Scratch(int64_t rows, int64_t Qn, int64_t D, int64_t Dp)
      : kq(rows * D), vq(rows * D), kt(D * KB), vb(KB * Dp), q(Qn * Dp), p(Qn * KB), acc(Qn * Dp), m(Qn), l(Qn) {}
};

// one (KV head, width) task: q [Qn, D], kt [D, T] (K transposed), v [T, D] -> out [Qn, D]
void run_task(const float* q, const float* k, const float* krows, const float* v, float* out, int64_t Qn, int64_t T,
              int64_t D, int64_t wq, int64_t bits, int64_t rows, int64_t gv, float scaling, Scratch& sc) {
  const int64_t Dp = (D + 15) / 16 * 16, qt = T - T % rows;
  const float levels = (float)((1 << bits) - 1);
  for (int64_t r = 0; r < Qn; ++r) {
    for (int64_t d = 0; d < D; ++d) sc.q[r * Dp + d] = q[r * D + d] * scaling;
    std::fill(sc.q.begin() + r * Dp + D, sc.q.begin() + (r + 1) * Dp, 0.f);
  }
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  std::fill(sc.m.begin(), sc.m.end(), -INFINITY);
  std::fill(sc.l.begin(), sc.l.end(), 0.f);
  float alpha[2];
  for (int64_t r0 = 0; r0 < T;) {
    const bool quantized = r0 < qt;
    const int64_t n = quantized ? rows : T - r0;
    const float *kr = k + r0, *vr = v + r0 * D;                 // kr: channel c's rows at kr + c * ks
    int64_t ks = T;
    if (quantized) {
#ifdef KVPLAN_AVX512
      if (D % 16 == 0 && (16 % gv == 0 || gv % 16 == 0)) {   // whole vectors: groups found in registers
        quant_k_group(krows, k, T, D, r0, n, levels, sc.kq.data());
        for (int64_t r = 0; r < n; ++r) quant_v_row(vr + r * D, D, gv, levels, sc.vq.data() + r * D);
      } else
#endif
      {
        for (int64_t c = 0; c < D; ++c) quant_span(k + c * T + r0, n, levels, sc.kq.data() + c * rows);
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 0; c < D; c += gv) quant_span(vr + r * D + c, gv, levels, sc.vq.data() + r * D + c);
      }
      kr = sc.kq.data();
      ks = rows;
      vr = sc.vq.data();
    }
    for (int64_t c0 = 0; c0 < n; c0 += KB) {                    // blocks of KB rows through the flash core
      const int64_t nk = std::min(KB, n - c0), k0 = r0 + c0;
      for (int64_t d = 0; d < D; ++d) {
        std::copy(kr + d * ks + c0, kr + d * ks + c0 + nk, sc.kt.begin() + d * KB);
        std::fill(sc.kt.begin() + d * KB + nk, sc.kt.begin() + (d + 1) * KB, 0.f);
      }
      std::fill(sc.vb.begin(), sc.vb.end(), 0.f);
      for (int64_t r = 0; r < nk; ++r) std::copy(vr + (c0 + r) * D, vr + (c0 + r + 1) * D, sc.vb.begin() + r * Dp);
      int64_t i = 0;
      for (; i + 4 <= Qn; i += 4) flash::scores<4>(sc.q.data() + i * Dp, Dp, sc.kt.data(), D, sc.p.data() + i * KB);
      for (; i < Qn; ++i) flash::scores<1>(sc.q.data() + i * Dp, Dp, sc.kt.data(), D, sc.p.data() + i * KB);
      for (i = 0; i < Qn; i += 2) {
        const int64_t cnt = std::min<int64_t>(2, Qn - i);
        int64_t upto = 0;
        for (int64_t x = 0; x < cnt; ++x) {
          const int64_t pos = T - wq + (i + x) % wq;
          const int64_t seen = std::min(nk, pos - k0 + 1);
          alpha[x] = flash::softmax_block(sc.p.data() + (i + x) * KB, seen, sc.m[i + x], sc.l[i + x]);
          upto = std::max(upto, seen);
        }
        if (upto <= 0) continue;
        if (cnt == 2) flash::accumulate<2>(sc.acc.data() + i * Dp, Dp, sc.p.data() + i * KB, alpha, sc.vb.data(), upto);
        else flash::accumulate<1>(sc.acc.data() + i * Dp, Dp, sc.p.data() + i * KB, alpha, sc.vb.data(), upto);
      }
    }
    r0 += n;
  }
  for (int64_t r = 0; r < Qn; ++r)
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = sc.acc[r * Dp + d] / sc.l[r];
}

}  // namespace

// q [G, Qn, D], k, v [G, T, D] fp32 contiguous; per width b: bits[b], rows[b] (K's group rows),
// vgroups[b] (V's group channels, dividing D) -> [B, G, Qn, D] fp32
torch::Tensor quant_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<int64_t> bits,
                              std::vector<int64_t> rows, std::vector<int64_t> vgroups, int64_t wq, double scaling) {
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == torch::kFloat && !t->is_cuda(),
                "q, k, v must be contiguous CPU fp32 [G, ., D]");
  const int64_t G = q.size(0), Qn = q.size(1), D = q.size(2), T = k.size(1), B = bits.size();
  TORCH_CHECK(k.size(0) == G && v.sizes() == k.sizes() && k.size(2) == D, "k, v must be [G, T, D] like q's G and D");
  TORCH_CHECK(rows.size() == (size_t)B && vgroups.size() == (size_t)B, "bits, rows and vgroups must be as long");
  TORCH_CHECK(wq >= 1 && Qn % wq == 0 && wq <= T, "wq must divide the query rows and be <= T");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(bits[b] >= 1 && bits[b] <= 8 && rows[b] >= 1 && vgroups[b] >= 1 && D % vgroups[b] == 0,
                "width ", b, ": bits in 1..8, rows >= 1, vgroups dividing D");
  auto out = torch::empty({B, G, Qn, D}, q.options());
  auto kt = k.transpose(1, 2).contiguous();                     // [G, D, T]: a channel's rows contiguous, once for every width
  const float *qp = q.data_ptr<float>(), *kp = kt.data_ptr<float>(), *krp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t most = *std::max_element(rows.begin(), rows.end());
  at::parallel_for(0, G * B, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(std::max(most, KB), Qn, D, (D + 15) / 16 * 16);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t % G, b = t / G;
      run_task(qp + g * Qn * D, kp + g * D * T, krp + g * T * D, vp + g * T * D, op + (b * G + g) * Qn * D, Qn, T, D, wq,
               bits[b], rows[b], vgroups[b], (float)scaling, sc);
    }
  });
  return out;
}
