// Attention of a layer's last queries over its K/V as KIVI quantization at several bit widths would
// store them (`quant_attention`; launcher and torch reference: kernels/quant_attention.py): what
// the statistics' quant losses measure (kvcore/statistics.py). Each width's quantized copy is made
// on the fly, a few groups of rows at a time, and attended flash-style (kernels/cpu_flash.h) — never
// stored: the statistics run inside the executor's prefill, and writing a dequantized K and V per
// width per layer was most of their cost. K and V are read as they are, row after row (a transposed
// K, read a channel at a time, cost a cache miss per channel per group and was half the kernel's time).
// K and V come in fp32 or bf16 (widened a span at a time as they are read). A task is one KV head's
// width over one of PARTS runs of whole spans; the parts' flash states are combined in part order, so
// a result does not depend on the thread count.
//
// Quantization as the pool's (kernels.quant: min/max levels, no refits): K per channel over groups
// of `rows` rows, V per row over groups of `vgroup` channels; scale (max - min) / (2^b - 1) and
// zero min both rounded to fp16, code floor((x - zero) / scale + 0.5) clamped to [0, 2^b - 1] (scale
// 0: code 0), value zero + code * scale in fp32. Rows past the last whole group stay exact.
//
// AVX-512 (16 lanes) and AVX2 (8 lanes) find a group's min/max and requantize in registers, K's
// channels a vector at a time down the group's rows, V's groups 16 at a time through each stage
// (AVX-512); other hosts and shapes take scalar loops of the same math.
//
// Shapes: G KV heads, Qn query rows per head (g query heads x Wq window rows, head-major: row r sits
// at position T - Wq + r % Wq and sees rows 0..that), T rows, D head dim, B widths.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_flash.h"
#include "cpu_vec.h"

namespace {

namespace flash = kvplan::flash;
using flash::KB;
constexpr int64_t SPAN = 3 * KB;  // rows quantized at a time (whole groups): 192 = 8, 4, 2 and 1 bits' 24, 48, 96 and
                                  // 192 rows, whole KB-row blocks for the flash core (a group a time left 24-row
                                  // groups in 64-row blocks: 8-bit attention took 2.7x the work)

constexpr int64_t PARTS = 2;      // rows of a (head, width) split in this many tasks

inline int64_t span_rows(int64_t rows) { return rows * ((SPAN + rows - 1) / rows); }   // whole groups, >= SPAN

inline float fp16_round(float x) { return static_cast<float>(c10::Half(x)); }       // nearest even

// code * scale + zero of x, as kernels.quant's dequantized_at
inline float requant(float x, float s, float z, float levels) {
  const float safe = s > 0.f ? s : 1.f;
  float c = std::floor((x - z) / safe + 0.5f);
  c = c < 0.f ? 0.f : (c > levels ? levels : c);
  return z + c * s;
}

// scalar: K's group of n rows k [n, D] (row stride D) quantized per channel -> kq [n, D]
inline void quant_k_scalar(const float* k, int64_t n, int64_t D, float levels, float* kq) {
  for (int64_t c = 0; c < D; ++c) {
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t r = 0; r < n; ++r) {
      lo = std::min(lo, k[r * D + c]);
      hi = std::max(hi, k[r * D + c]);
    }
    const float s = fp16_round((hi - lo) / levels), z = fp16_round(lo);
    for (int64_t r = 0; r < n; ++r) kq[r * D + c] = requant(k[r * D + c], s, z, levels);
  }
}

// scalar: one V row [D] in groups of g channels (g dividing D) -> out [D]
inline void quant_v_scalar(const float* x, int64_t D, int64_t g, float levels, float* out) {
  for (int64_t c0 = 0; c0 < D; c0 += g) {
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t c = c0; c < c0 + g; ++c) {
      lo = std::min(lo, x[c]);
      hi = std::max(hi, x[c]);
    }
    const float s = fp16_round((hi - lo) / levels), z = fp16_round(lo);
    for (int64_t c = c0; c < c0 + g; ++c) out[c] = requant(x[c], s, z, levels);
  }
}

#ifdef KVPLAN_AVX512
// requant of 16 lanes: (x - z) times 1/s first, and the exact quotient only where that lands within
// 2e-4 of a rounding boundary (the product is within a few ulp of the quotient, < 1e-4 at 255
// levels), so every code is the division's at a fraction of its cost (a division per element was
// a quarter of the kernel)
inline __m512 safe16(__m512 s) {            // scale 0 (all values alike): divide by 1
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.f), s);
}

// x's code at scale s (safe: safe16(s), inv: 1 / safe) and zero z, back to a value
inline __m512 requant16(__m512 x, __m512 s, __m512 safe, __m512 inv, __m512 z, __m512 levels) {
  const __m512 half = _mm512_set1_ps(0.5f);
  const __m512 y = _mm512_fmadd_ps(_mm512_sub_ps(x, z), inv, half);
  __m512 c = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 frac = _mm512_sub_ps(y, c);
  const __mmask16 near = _mm512_cmp_ps_mask(frac, _mm512_set1_ps(2e-4f), _CMP_LT_OQ) |
                         _mm512_cmp_ps_mask(frac, _mm512_set1_ps(1.f - 2e-4f), _CMP_GT_OQ);
  if (near)
    c = _mm512_mask_roundscale_ps(c, near, _mm512_add_ps(_mm512_div_ps(_mm512_sub_ps(x, z), safe), half),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  c = _mm512_min_ps(_mm512_max_ps(c, _mm512_setzero_ps()), levels);
  return _mm512_add_ps(z, _mm512_mul_ps(c, s));
}

// fp16 rounding of 16 floats at once (nearest even, subnormals kept: c10::Half's)
inline __m512 fp16_round16(__m512 x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// every lane the min (max) of its group of g lanes (g in 1, 2, 4, 8, 16): a butterfly over lane ^ k, by
// in-lane swaps for k = 1, 2 and 128-bit block swaps for k = 4, 8 (no lane-crossing index permutes)
inline __m512 swap_lanes(__m512 x, int k) {
  switch (k) {
    case 1: return _mm512_permute_ps(x, 0xB1);
    case 2: return _mm512_permute_ps(x, 0x4E);
    case 4: return _mm512_shuffle_f32x4(x, x, 0xB1);
    default: return _mm512_shuffle_f32x4(x, x, 0x4E);
  }
}

// 1 / s to within 2 ulp, s > 0 (the reciprocal estimate and one Newton step: a division's latency was
// most of a value group's chain)
inline __m512 recip16(__m512 s) {
  const __m512 r = _mm512_rcp14_ps(s);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(s, r, _mm512_set1_ps(2.f)));
}

// K's group of n rows k [n, D]: per channel min/max down the rows (16 channels a vector, no
// reduction across lanes), then the same rows requantized -> kq [n, D]
inline void quant_k_group(const float* k, int64_t n, int64_t D, float levels, float* kq) {
  const __m512 lv = _mm512_set1_ps(levels);
  for (int64_t c0 = 0; c0 < D; c0 += 16) {
    const __mmask16 cm = D - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - c0)) - 1u);
    __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY);
    for (int64_t r = 0; r < n; ++r) {
      const __m512 v = _mm512_maskz_loadu_ps(cm, k + r * D + c0);
      mn = _mm512_min_ps(mn, v);
      mx = _mm512_max_ps(mx, v);
    }
    const __m512 sc = fp16_round16(_mm512_div_ps(_mm512_sub_ps(mx, mn), lv)), zc = fp16_round16(mn);
    const __m512 safe = safe16(sc), inv = recip16(safe);
    for (int64_t r = 0; r < n; ++r)
      _mm512_mask_storeu_ps(kq + r * D + c0, cm,
                            requant16(_mm512_maskz_loadu_ps(cm, k + r * D + c0), sc, safe, inv, zc, lv));
  }
}

// V rows x [n, D] in groups of g channels (g dividing 16, or a multiple of 16 dividing D) -> out [n, D]. A
// group's chain (min/max, butterfly, scale, requantization) is long and a row holds few groups, so up
// to 16 groups of several rows go through each stage together (one row at a time was latency-bound).
inline void quant_v_rows(const float* x, int64_t n, int64_t D, int64_t g, float levels, float* out) {
  constexpr int MAXU = 16;
  const int64_t step = std::max<int64_t>(g, 16), nv = step / 16, units = D / step;   // a unit: one group's vectors
  const __m512 lv = _mm512_set1_ps(levels);
  __m512 mn[MAXU], mx[MAXU], sc[MAXU], zc[MAXU], safe[MAXU], inv[MAXU];
  for (int64_t u0 = 0; u0 < n * units; u0 += MAXU) {             // units u0 .. of all rows' (row-major)
    const int64_t upto = std::min<int64_t>(MAXU, n * units - u0);
    for (int64_t u = 0; u < upto; ++u) {
      const float* at = x + ((u0 + u) / units) * D + ((u0 + u) % units) * step;
      mn[u] = mx[u] = _mm512_loadu_ps(at);
      for (int64_t j = 1; j < nv; ++j) {
        const __m512 v = _mm512_loadu_ps(at + 16 * j);
        mn[u] = _mm512_min_ps(mn[u], v);
        mx[u] = _mm512_max_ps(mx[u], v);
      }
    }
    for (int k = 1; k < g && k < 16; k *= 2)
      for (int64_t u = 0; u < upto; ++u) {
        mn[u] = _mm512_min_ps(mn[u], swap_lanes(mn[u], k));
        mx[u] = _mm512_max_ps(mx[u], swap_lanes(mx[u], k));
      }
    for (int64_t u = 0; u < upto; ++u) {
      sc[u] = fp16_round16(_mm512_div_ps(_mm512_sub_ps(mx[u], mn[u]), lv));
      zc[u] = fp16_round16(mn[u]);
      safe[u] = safe16(sc[u]);
      inv[u] = recip16(safe[u]);
    }
    for (int64_t u = 0; u < upto; ++u) {
      const int64_t off = ((u0 + u) / units) * D + ((u0 + u) % units) * step;
      for (int64_t j = 0; j < nv; ++j)
        _mm512_storeu_ps(out + off + 16 * j,
                         requant16(_mm512_loadu_ps(x + off + 16 * j), sc[u], safe[u], inv[u], zc[u], lv));
    }
  }
}

// 16 rows of 16 floats in registers -> their transpose, in place (unpack 32-bit and 64-bit pairs,
// then 128-bit lanes twice)
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// rows [nk, D] (row stride D, D a multiple of 16, nk <= KB) -> kt [D, KB], zero past nk
inline void transpose_block(const float* rows, int64_t nk, int64_t D, float* kt) {
  for (int64_t r0 = 0; r0 < KB; r0 += 16)
    for (int64_t c0 = 0; c0 < D; c0 += 16) {
      __m512 t[16];
      for (int i = 0; i < 16; ++i) t[i] = r0 + i < nk ? _mm512_loadu_ps(rows + (r0 + i) * D + c0) : _mm512_setzero_ps();
      transpose16(t);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(kt + (c0 + c) * KB + r0, t[c]);
    }
}

// acc rows [ROWS, 64] = acc * alpha + p · vb over nk rows (p [ROWS, KB]; vb [nk, 64]): flash::accumulate
// for a head dim of 64, its 4 vectors a row fixed
template <int ROWS>
inline void accumulate64(float* acc, const float* p, const float* alpha, const float* vb, int64_t nk) {
  __m512 a[ROWS][4];
  for (int x = 0; x < ROWS; ++x)
    for (int v = 0; v < 4; ++v) a[x][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + x * 64 + 16 * v), _mm512_set1_ps(alpha[x]));
  for (int64_t r = 0; r < nk; ++r) {
    __m512 vr[4];
    for (int v = 0; v < 4; ++v) vr[v] = kvplan::in_register(_mm512_loadu_ps(vb + r * 64 + 16 * v));
    for (int x = 0; x < ROWS; ++x) {
      const __m512 pr = _mm512_set1_ps(p[x * KB + r]);
      for (int v = 0; v < 4; ++v) a[x][v] = _mm512_fmadd_ps(pr, vr[v], a[x][v]);
    }
  }
  for (int x = 0; x < ROWS; ++x)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc + x * 64 + 16 * v, a[x][v]);
}

// a group's K rows [n, D] and V rows [n, D] (value groups of g channels) -> kq, vq [n, D]
inline bool quant_group(const float* k, const float* v, int64_t n, int64_t D, int64_t g, float levels, float* kq,
                        float* vq) {
  if (D % 16 || !(16 % g == 0 || g % 16 == 0)) return false;    // whole vectors only
  quant_k_group(k, n, D, levels, kq);
  quant_v_rows(v, n, D, g, levels, vq);
  return true;
}
#elif defined(KVPLAN_AVX2)
// the 8-lane forms, for hosts with AVX2 but not AVX-512
inline __m256 requant8(__m256 x, __m256 s, __m256 z, __m256 levels) {
  const __m256 safe = _mm256_blendv_ps(_mm256_set1_ps(1.f), s, _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ));
  __m256 c = _mm256_floor_ps(_mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(x, z), safe), _mm256_set1_ps(0.5f)));
  c = _mm256_min_ps(_mm256_max_ps(c, _mm256_setzero_ps()), levels);
  return _mm256_add_ps(z, _mm256_mul_ps(c, s));
}

// K's group of n rows k [n, D] (D a multiple of 8): per channel min/max down the rows, 8 channels a
// vector, then the same rows requantized -> kq [n, D]
inline void quant_k_group8(const float* k, int64_t n, int64_t D, float levels, float* kq) {
  const __m256 lv = _mm256_set1_ps(levels);
  for (int64_t c0 = 0; c0 < D; c0 += 8) {
    __m256 mn = _mm256_set1_ps(INFINITY), mx = _mm256_set1_ps(-INFINITY);
    for (int64_t r = 0; r < n; ++r) {
      const __m256 v = _mm256_loadu_ps(k + r * D + c0);
      mn = _mm256_min_ps(mn, v);
      mx = _mm256_max_ps(mx, v);
    }
    const __m256 sc = kvplan::fp16_round8(_mm256_div_ps(_mm256_sub_ps(mx, mn), lv)), zc = kvplan::fp16_round8(mn);
    for (int64_t r = 0; r < n; ++r) _mm256_storeu_ps(kq + r * D + c0, requant8(_mm256_loadu_ps(k + r * D + c0), sc, zc, lv));
  }
}

// one V row [D] in groups of g channels (g a multiple of 8 dividing D) -> out [D]
inline void quant_v_row8(const float* x, int64_t D, int64_t g, float levels, float* out) {
  const __m256 lv = _mm256_set1_ps(levels);
  for (int64_t c0 = 0; c0 < D; c0 += g) {
    __m256 mn = _mm256_set1_ps(INFINITY), mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < g; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + c0 + j);
      mn = _mm256_min_ps(mn, v);
      mx = _mm256_max_ps(mx, v);
    }
    const float lo = kvplan::hmin8(mn), hi = kvplan::hmax8(mx);
    const __m256 sc = _mm256_set1_ps(fp16_round((hi - lo) / levels)), zc = _mm256_set1_ps(fp16_round(lo));
    for (int64_t j = 0; j < g; j += 8)
      _mm256_storeu_ps(out + c0 + j, requant8(_mm256_loadu_ps(x + c0 + j), sc, zc, lv));
  }
}

inline bool quant_group(const float* k, const float* v, int64_t n, int64_t D, int64_t g, float levels, float* kq,
                        float* vq) {
  if (D % 8 || g % 8) return false;                             // whole 8-lane vectors only
  quant_k_group8(k, n, D, levels, kq);
  for (int64_t r = 0; r < n; ++r) quant_v_row8(v + r * D, D, g, levels, vq + r * D);
  return true;
}
#else
inline bool quant_group(const float*, const float*, int64_t, int64_t, int64_t, float, float*, float*) { return false; }
#endif

struct Scratch {
  std::vector<float> kq, vq, kf, vf, kt, vb, q, p, acc, m, l;   // kq, vq: a span's quantized copies [rows, D]; kf, vf:
                                                               // its bf16 rows widened; kt: a block's K [D, KB]
  Scratch(int64_t rows, int64_t Qn, int64_t D, int64_t Dp)
      : kq(rows * D), vq(rows * D), kf(rows * D), vf(rows * D), kt(D * KB), vb(KB * Dp), q(Qn * Dp), p(Qn * KB),
        acc(Qn * Dp), m(Qn), l(Qn) {}
};

// n bf16 values -> fp32
inline void widen(const kvplan::bf16* x, int64_t n, float* out) {
  int64_t i = 0;
#ifdef KVPLAN_AVX512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, kvplan::load16(x + i));
#endif
  for (; i < n; ++i) out[i] = kvplan::to_f(x[i]);
}

// one block of nk <= KB keys (kt [D, KB] in sc): every query row's scores (q rows qs apart) -> sc.p
inline void block_scores(Scratch& sc, int64_t Qn, int64_t qs, int64_t D) {
  int64_t i = 0;
  for (; i + 4 <= Qn; i += 4) flash::scores<4>(sc.q.data() + i * qs, qs, sc.kt.data(), D, sc.p.data() + i * KB);
  for (; i < Qn; ++i) flash::scores<1>(sc.q.data() + i * qs, qs, sc.kt.data(), D, sc.p.data() + i * KB);
}

// rows i .. i + cnt - 1 of the block at k0 (nk keys): their online softmax, each row's rescale -> alpha;
// -> the most keys any of them sees (row r sits at position T - wq + r % wq)
inline int64_t rows_softmax(Scratch& sc, int64_t i, int64_t cnt, int64_t T, int64_t wq, int64_t nk, int64_t k0,
                            float* alpha) {
  int64_t upto = 0;
  for (int64_t x = 0; x < cnt; ++x) {
    const int64_t pos = T - wq + (i + x) % wq;
    const int64_t seen = std::min(nk, pos - k0 + 1);
    alpha[x] = flash::softmax_block(sc.p.data() + (i + x) * KB, seen, sc.m[i + x], sc.l[i + x]);
    upto = std::max(upto, seen);
  }
  return upto;
}

#ifdef KVPLAN_AVX512
// one block of nk <= KB keys (kt [D, KB] in sc, vb [nk, 64] in place) for every query row, D = 64: the
// same scores, softmax and accumulation as the general path, 4 rows at a time
inline void block64(Scratch& sc, int64_t Qn, int64_t T, int64_t wq, int64_t nk, int64_t k0, const float* vb,
                    float* alpha) {
  block_scores(sc, Qn, 64, 64);
  for (int64_t i = 0; i < Qn; i += 4) {
    const int64_t cnt = std::min<int64_t>(4, Qn - i);
    const int64_t upto = rows_softmax(sc, i, cnt, T, wq, nk, k0, alpha);
    if (upto <= 0) continue;
    float* acc = sc.acc.data() + i * 64;
    const float* p = sc.p.data() + i * KB;
    if (cnt == 4) accumulate64<4>(acc, p, alpha, vb, upto);
    else if (cnt == 3) accumulate64<3>(acc, p, alpha, vb, upto);
    else if (cnt == 2) accumulate64<2>(acc, p, alpha, vb, upto);
    else accumulate64<1>(acc, p, alpha, vb, upto);
  }
}
#endif

// one (KV head, width, part) task: q [Qn, D], k, v [T, D] (fp32 or bf16), the part's rows begin .. end (begin a multiple of the
// span, end too or T) -> its unnormalized accumulators acc [Qn, Dp], running max m and sum l [Qn]
template <typename In>
void run_task(const float* q, const In* k, const In* v, int64_t begin, int64_t end, int64_t Qn, int64_t T,
              int64_t D, int64_t wq, int64_t bits, int64_t rows, int64_t gv, float scaling, Scratch& sc, float* acc_out,
              float* m_out, float* l_out) {
  const int64_t Dp = (D + 15) / 16 * 16, qt = T - T % rows;
  const float levels = (float)((1 << bits) - 1);
  const int64_t span = span_rows(rows);                        // groups quantized before they are attended
  for (int64_t r = 0; r < Qn; ++r) {
    for (int64_t d = 0; d < D; ++d) sc.q[r * Dp + d] = q[r * D + d] * scaling;
    std::fill(sc.q.begin() + r * Dp + D, sc.q.begin() + (r + 1) * Dp, 0.f);
  }
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  std::fill(sc.m.begin(), sc.m.end(), -INFINITY);
  std::fill(sc.l.begin(), sc.l.end(), 0.f);
  float alpha[4];
  for (int64_t r0 = begin; r0 < end;) {
    const bool quantized = r0 < qt;
    const int64_t n = std::min(quantized ? std::min(span, qt - r0) : T - r0, end - r0);   // whole groups, or the exact tail
    const float *kr, *vr;                                       // [n, D] each
    if constexpr (std::is_same_v<In, float>) {
      kr = k + r0 * D;
      vr = v + r0 * D;
    } else {                                                    // widened where they are first read
      widen(k + r0 * D, n * D, sc.kf.data());
      widen(v + r0 * D, n * D, sc.vf.data());
      kr = sc.kf.data();
      vr = sc.vf.data();
    }
    if (quantized) {                                            // n / rows groups -> kq, vq [n, D]
      for (int64_t j = 0; j < n; j += rows) {
        const float *kg = kr + j * D, *vg = vr + j * D;
        float *kq = sc.kq.data() + j * D, *vq = sc.vq.data() + j * D;
        if (quant_group(kg, vg, rows, D, gv, levels, kq, vq)) continue;
        quant_k_scalar(kg, rows, D, levels, kq);
        for (int64_t r = 0; r < rows; ++r) quant_v_scalar(vg + r * D, D, gv, levels, vq + r * D);
      }
      kr = sc.kq.data();
      vr = sc.vq.data();
    }
    for (int64_t c0 = 0; c0 < n; c0 += KB) {                    // blocks of KB rows through the flash core
      const int64_t nk = std::min(KB, n - c0), k0 = r0 + c0;
#ifdef KVPLAN_AVX512
      if (D == 64) {                                            // the model's head dim: registers' transposes, V read in place
        transpose_block(kr + c0 * D, nk, D, sc.kt.data());
        block64(sc, Qn, T, wq, nk, k0, vr + c0 * D, alpha);
        continue;
      }
#endif
      if (nk < KB) std::fill(sc.kt.begin(), sc.kt.end(), 0.f);
      for (int64_t r = 0; r < nk; ++r)                          // the block's K rows transposed -> kt [D, KB]
        for (int64_t d = 0; d < D; ++d) sc.kt[d * KB + r] = kr[(c0 + r) * D + d];
      std::fill(sc.vb.begin(), sc.vb.end(), 0.f);
      for (int64_t r = 0; r < nk; ++r) std::copy(vr + (c0 + r) * D, vr + (c0 + r + 1) * D, sc.vb.begin() + r * Dp);
      block_scores(sc, Qn, Dp, D);
      for (int64_t i = 0; i < Qn; i += 2) {
        const int64_t cnt = std::min<int64_t>(2, Qn - i);
        const int64_t upto = rows_softmax(sc, i, cnt, T, wq, nk, k0, alpha);
        if (upto <= 0) continue;
        if (cnt == 2) flash::accumulate<2>(sc.acc.data() + i * Dp, Dp, sc.p.data() + i * KB, alpha, sc.vb.data(), upto);
        else flash::accumulate<1>(sc.acc.data() + i * Dp, Dp, sc.p.data() + i * KB, alpha, sc.vb.data(), upto);
      }
    }
    r0 += n;
  }
  std::copy(sc.acc.begin(), sc.acc.begin() + Qn * Dp, acc_out);
  std::copy(sc.m.begin(), sc.m.begin() + Qn, m_out);
  std::copy(sc.l.begin(), sc.l.begin() + Qn, l_out);
}

}  // namespace

// q [G, Qn, D] fp32, k, v [G, T, D] fp32 or bf16 alike, contiguous; per width b: bits[b], rows[b] (K's group rows),
// vgroups[b] (V's group channels, dividing D) -> [B, G, Qn, D] fp32
torch::Tensor quant_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<int64_t> bits,
                              std::vector<int64_t> rows, std::vector<int64_t> vgroups, int64_t wq, double scaling) {
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && !t->is_cuda(), "q, k, v must be contiguous CPU [G, ., D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kBFloat16),
              "q must be fp32, k and v fp32 or bf16 alike");
  const int64_t G = q.size(0), Qn = q.size(1), D = q.size(2), T = k.size(1), B = bits.size();
  TORCH_CHECK(k.size(0) == G && v.sizes() == k.sizes() && k.size(2) == D, "k, v must be [G, T, D] like q's G and D");
  TORCH_CHECK(rows.size() == (size_t)B && vgroups.size() == (size_t)B, "bits, rows and vgroups must be as long");
  TORCH_CHECK(wq >= 1 && Qn % wq == 0 && wq <= T, "wq must divide the query rows and be <= T");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(bits[b] >= 1 && bits[b] <= 8 && rows[b] >= 1 && vgroups[b] >= 1 && D % vgroups[b] == 0,
                "width ", b, ": bits in 1..8, rows >= 1, vgroups dividing D");
  auto out = torch::empty({B, G, Qn, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const bool bf = k.scalar_type() == torch::kBFloat16;
  const void *kp = k.data_ptr(), *vp = v.data_ptr();
  float* op = out.data_ptr<float>();
  int64_t most = 0;                                             // the longest span of whole groups (run_task's)
  for (const int64_t r : rows) most = std::max(most, span_rows(r));
  // each (head, width) in PARTS parts of whole spans (G·B tasks were too few to share 2 threads evenly: 9 took
  // 5 task-times on one), the parts' flash states combined in order after; tasks taken from a shared counter
  const int64_t Dp = (D + 15) / 16 * 16, tasks = G * B * PARTS;
  std::vector<float> acc(tasks * Qn * Dp), m(tasks * Qn), l(tasks * Qn);
  std::vector<int64_t> cut(B * (PARTS + 1));                    // width b's part p: rows cut[b][p] .. cut[b][p + 1]
  for (int64_t b = 0; b < B; ++b) {
    const int64_t span = span_rows(rows[b]), qt = T - T % rows[b];
    for (int64_t p = 0; p <= PARTS; ++p)
      cut[b * (PARTS + 1) + p] = p == PARTS ? T : std::min(qt / span * span, (T / PARTS * p) / span * span);
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch sc(std::max(most, KB), Qn, D, Dp);
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      const int64_t b = t / (G * PARTS), g = t / PARTS % G, p = t % PARTS;
      const int64_t begin = cut[b * (PARTS + 1) + p], end = cut[b * (PARTS + 1) + p + 1];
      const auto run = [&](const auto* k0, const auto* v0) {       // k0, v0: fp32 or bf16 [G, T, D]
        run_task(qp + g * Qn * D, k0 + g * T * D, v0 + g * T * D, begin, end, Qn, T, D, wq, bits[b], rows[b],
                 vgroups[b], (float)scaling, sc, acc.data() + t * Qn * Dp, m.data() + t * Qn, l.data() + t * Qn);
      };
      if (bf) run(static_cast<const kvplan::bf16*>(kp), static_cast<const kvplan::bf16*>(vp));
      else run(static_cast<const float*>(kp), static_cast<const float*>(vp));
    }
  });
  for (int64_t bg = 0; bg < B * G; ++bg)                        // the parts' states, in order -> out [Qn, D]
    for (int64_t r = 0; r < Qn; ++r) {
      float mx = -INFINITY;
      for (int64_t p = 0; p < PARTS; ++p) mx = std::max(mx, m[(bg * PARTS + p) * Qn + r]);
      float w[PARTS], den = 0.f;
      for (int64_t p = 0; p < PARTS; ++p) {
        const float mp = m[(bg * PARTS + p) * Qn + r];
        w[p] = mp == -INFINITY ? 0.f : std::exp(mp - mx);
        den += w[p] * l[(bg * PARTS + p) * Qn + r];
      }
      for (int64_t d = 0; d < D; ++d) {
        float num = 0.f;
        for (int64_t p = 0; p < PARTS; ++p) num += w[p] * acc[((bg * PARTS + p) * Qn + r) * Dp + d];
        op[(bg * Qn + r) * D + d] = num / den;
      }
    }
  return out;
}
