// Decode attention on the CPU: one query row per head over a KV group's stored rows, read in
// place — dense fp16 rows (`dense_decode`) or KIVI-quantized codes with a dense fp16 tail
// (`quant_decode`) — never a float copy of the cache. Both take a *list* of groups (the KV heads
// of one layer of one or many sequences, each with its own row count), so one call serves a
// layer of every sequence in a step.
//
// Split-K (flash-decoding): each group's rows are cut into blocks of a fixed size, each
// (group, block) task keeps its running max, sum and h accumulators, and the blocks combine in
// a fixed order — the same result whatever the thread count or the other groups of the call.
// torch's own thread pool (at::parallel_for), so no second thread team competes with it.
// AVX2 + F16C + FMA fast paths (8 floats a register) for the shapes kvplan runs; any other
// shape runs a scalar loop of the same math. Launchers and torch references:
// kernels/dense_decode.py and kernels/quant_decode.py.
//
// Shapes: G groups; h query heads per group; T_i rows of group i; D head dim; for quantized
// groups n_i key groups of g tokens, Q_i = n_i * g quantized rows, R_i tail rows, U_i = Q_i + R_i.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KVPLAN_AVX2 1
#endif

namespace {

// ---------------------------------------------------------------------------------------------
// One block's partial result: m [h] running max, z [h] sum of exp, a [h, D] weighted sum.
struct Partial {
  float* m;
  float* z;
  float* a;
};

#ifdef KVPLAN_AVX2
// e^x for x <= 0 (scores minus their max): 2^(x log2 e) as 2^round * 2^frac, 2^frac by its
// degree-6 Taylor polynomial of e^(frac ln 2) (|frac| <= 1/2: relative error ~1e-7)
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif

inline float half1(uint16_t x) { return _cvtsh_ss(x); }

// scores s [h, n] (already scaled) -> probabilities in place, with the block's max and sum; a
// head that sees no row of the block gets m = -inf, z = 0 (it weighs nothing when blocks combine)
void softmax_rows(float* s, int64_t h, int64_t n, int64_t stride, float* m, float* z) {
  for (int64_t j = 0; j < h; ++j) {
    float* sj = s + j * stride;
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; ++t) mx = sj[t] > mx ? sj[t] : mx;
    m[j] = mx;
    if (mx == -INFINITY) {
      z[j] = 0.f;
      std::fill(sj, sj + n, 0.f);
      continue;
    }
    int64_t t = 0;
    float zz = 0.f;
#ifdef KVPLAN_AVX2
    const __m256 mj = _mm256_set1_ps(mx);
    __m256 zs = _mm256_setzero_ps();
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) {
      const __m256 x = _mm256_loadu_ps(sj + t);
      const __m256 p = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), exp_neg(_mm256_sub_ps(x, mj)));
      _mm256_storeu_ps(sj + t, p);
      zs = _mm256_add_ps(zs, p);
    }
    zz = hsum(zs);
#endif
    for (; t < n; ++t) { sj[t] = sj[t] == -INFINITY ? 0.f : std::exp(sj[t] - mx); zz += sj[t]; }
    z[j] = zz;
  }
}

// masked columns of a block's scores -> -inf; mask [h, *] bool rows `mstride` apart, already at
// the block's first column
void apply_mask(float* s, int64_t h, int64_t n, int64_t stride, const bool* mask, int64_t mstride) {
  if (!mask) return;
  for (int64_t j = 0; j < h; ++j)
    for (int64_t t = 0; t < n; ++t)
      if (!mask[j * mstride + t]) s[j * stride + t] = -INFINITY;
}

// ---------------------------------------------------------------------------------------------
// Dense fp16 rows: one (group, block) of n rows. q [h, D] pre-scaled; k, v rows kst / vst apart.
void dense_scores_any(const float* q, const uint16_t* k, int64_t kst, int64_t n, int64_t h, int64_t D, float* s,
                      int64_t stride) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < h; ++j) {
      float d = 0.f;
      for (int64_t e = 0; e < D; ++e) d += q[j * D + e] * half1(k[t * kst + e]);
      s[j * stride + t] = d;
    }
}

void dense_values_any(const float* p, const uint16_t* v, int64_t vst, int64_t n, int64_t h, int64_t D, float* a,
                      int64_t stride) {
  std::fill(a, a + h * D, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < h; ++j)
      for (int64_t e = 0; e < D; ++e) a[j * D + e] += p[j * stride + t] * half1(v[t * vst + e]);
}

#ifdef KVPLAN_AVX2
template <int H, int DV>
void dense_scores(const float* q, const uint16_t* k, int64_t kst, int64_t n, float* s, int64_t stride) {
  for (int64_t t = 0; t < n; ++t) {
    __m256 acc[H];
    for (int j = 0; j < H; ++j) acc[j] = _mm256_setzero_ps();
    for (int c = 0; c < DV; ++c) {
      const __m256 kr = half8(k + t * kst + c * 8);
      for (int j = 0; j < H; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (j * DV + c) * 8), kr, acc[j]);
    }
    for (int j = 0; j < H; ++j) s[j * stride + t] = hsum(acc[j]);
  }
}

template <int H, int DV>
void dense_values(const float* p, const uint16_t* v, int64_t vst, int64_t n, float* a, int64_t stride) {
  for (int j = 0; j < H; ++j) {          // one query head at a time: DV accumulators in registers
    const float* pj = p + j * stride;
    __m256 acc[DV];
    for (int c = 0; c < DV; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m256 w = _mm256_set1_ps(pj[t]);
      for (int c = 0; c < DV; ++c) acc[c] = _mm256_fmadd_ps(w, half8(v + t * vst + c * 8), acc[c]);
    }
    for (int c = 0; c < DV; ++c) _mm256_storeu_ps(a + (j * DV + c) * 8, acc[c]);
  }
}
#endif

using ScoresFn = void (*)(const float*, const uint16_t*, int64_t, int64_t, float*, int64_t);
using ValuesFn = void (*)(const float*, const uint16_t*, int64_t, int64_t, float*, int64_t);

struct DenseFns {
  ScoresFn scores = nullptr;
  ValuesFn values = nullptr;
};

DenseFns pick_dense(int64_t H, int64_t D) {
  DenseFns f;
#ifdef KVPLAN_AVX2
#define KVPLAN_CASE(h, dv) \
  if (H == h && D == 8 * dv) { f.scores = dense_scores<h, dv>; f.values = dense_values<h, dv>; return f; }
  KVPLAN_CASE(1, 4) KVPLAN_CASE(1, 8) KVPLAN_CASE(1, 16) KVPLAN_CASE(2, 4) KVPLAN_CASE(2, 6) KVPLAN_CASE(2, 8)
  KVPLAN_CASE(2, 16) KVPLAN_CASE(3, 8) KVPLAN_CASE(3, 16) KVPLAN_CASE(4, 8) KVPLAN_CASE(4, 16) KVPLAN_CASE(5, 8)
  KVPLAN_CASE(6, 8) KVPLAN_CASE(7, 8) KVPLAN_CASE(8, 8) KVPLAN_CASE(8, 16)
#undef KVPLAN_CASE
#endif
  return f;
}

// A dense block: rows [0, n) of k / v; mask at the block's first column or null.
void dense_block(const DenseFns& f, const float* q, const uint16_t* k, int64_t kst, const uint16_t* v, int64_t vst,
                 int64_t n, int64_t h, int64_t D, const bool* mask, int64_t mstride, float* s, int64_t stride,
                 Partial out) {
  if (f.scores) f.scores(q, k, kst, n, s, stride);
  else dense_scores_any(q, k, kst, n, h, D, s, stride);
  apply_mask(s, h, n, stride, mask, mstride);
  softmax_rows(s, h, n, stride, out.m, out.z);
  if (f.values) f.values(s, v, vst, n, out.a, stride);
  else dense_values_any(s, v, vst, n, h, D, out.a, stride);
}

// Combine each group's blocks (in block order) into out [G, h, D].
void combine(const std::vector<int64_t>& first, int64_t h, int64_t D, const std::vector<float>& mx,
             const std::vector<float>& sm, const std::vector<float>& acc, float* op) {
  const int64_t G = (int64_t)first.size() - 1;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < h; ++j) {
      float M = -INFINITY;
      for (int64_t task = first[g]; task < first[g + 1]; ++task) M = std::max(M, mx[task * h + j]);
      float Z = 0.f;
      float* o = op + (g * h + j) * D;
      std::fill(o, o + D, 0.f);
      if (M == -INFINITY) continue;                   // no row seen: zeros (callers never ask this)
      for (int64_t task = first[g]; task < first[g + 1]; ++task) {
        if (mx[task * h + j] == -INFINITY) continue;
        const float w = std::exp(mx[task * h + j] - M);
        Z += w * sm[task * h + j];
        const float* a = acc.data() + (task * h + j) * D;
        for (int64_t e = 0; e < D; ++e) o[e] += w * a[e];
      }
      for (int64_t e = 0; e < D; ++e) o[e] /= Z;
    }
}

const bool* mask_ptr(const std::vector<torch::Tensor>& masks, int64_t g) {
  if (masks.empty() || masks[g].numel() == 0) return nullptr;
  return masks[g].data_ptr<bool>();
}

}  // namespace

// q [G, h, D] fp32; ks[i], vs[i] [T_i, D] fp16 (rows contiguous, any row stride); masks: empty, or
// one [h, T_i] bool per group (an empty tensor: every row seen) -> [G, h, D] fp32
torch::Tensor dense_decode(torch::Tensor q, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                           std::vector<torch::Tensor> masks, double scaling, int64_t block) {
  const int64_t G = q.size(0), h = q.size(1), D = q.size(2);
  std::vector<int64_t> first(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) first[g + 1] = first[g] + (ks[g].size(0) + block - 1) / block;
  const int64_t tasks = first[G];
  auto qs = (q * scaling).contiguous();
  auto out = torch::empty({G, h, D}, q.options());
  std::vector<float> mx(tasks * h), sm(tasks * h), acc(tasks * h * D);
  const float* qp = qs.data_ptr<float>();
  const DenseFns fns = pick_dense(h, D);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(h * block);
    int64_t g = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first[g + 1]) ++g;
      const int64_t t0 = (task - first[g]) * block, n = std::min(ks[g].size(0), t0 + block) - t0;
      const uint16_t* kp = reinterpret_cast<const uint16_t*>(ks[g].data_ptr<at::Half>());
      const uint16_t* vp = reinterpret_cast<const uint16_t*>(vs[g].data_ptr<at::Half>());
      const int64_t kst = ks[g].stride(0), vst = vs[g].stride(0);
      const bool* mk = mask_ptr(masks, g);
      const int64_t mst = mk ? masks[g].stride(0) : 0;
      dense_block(fns, qp + g * h * D, kp + t0 * kst, kst, vp + t0 * vst, vst, n, h, D, mk ? mk + t0 : nullptr, mst,
                  s.data(), block, Partial{mx.data() + task * h, sm.data() + task * h, acc.data() + task * h * D});
    }
  });
  combine(first, h, D, mx, sm, acc, out.data_ptr<float>());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Quantized rows (KIVI, `executor.layers.quant.QuantGroup`): keys per channel in key groups of g
// tokens (kc [n, D, g*b/8], one fp16 scale and zero per key group and channel), values per token
// (vc [Q, D*b/8], one fp16 scale and zero per run of gv channels), codes packed low bits first:
// byte k of a row holds elements k*P .. k*P + P - 1 (P = 8 / b codes a byte).
namespace {

inline int code_at(const uint8_t* row, int64_t i, int bits) {
  const int per = 8 / bits;
  return (row[i / per] >> ((i % per) * bits)) & ((1 << bits) - 1);
}

// scores of key groups [j0, j1): s[j, (j - j0) * g + i]; q [h, D] pre-scaled
void quant_scores_any(const float* q, const uint8_t* kc, const uint16_t* ks, const uint16_t* kz, int64_t j0,
                      int64_t j1, int64_t h, int64_t D, int64_t g, int bits, float* s, int64_t stride) {
  const int64_t bk = g * bits / 8;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t i = 0; i < g; ++i)
      for (int64_t hh = 0; hh < h; ++hh) {
        float d = 0.f;
        for (int64_t e = 0; e < D; ++e) {
          const float x = code_at(kc + (j * D + e) * bk, i, bits) * half1(ks[j * D + e]) + half1(kz[j * D + e]);
          d += q[hh * D + e] * x;
        }
        s[hh * stride + (j - j0) * g + i] = d;
      }
}

// a [h, D] = p [h, rows t0..t0+n) . values of those rows
void quant_values_any(const float* p, const uint8_t* vc, const uint16_t* vs, const uint16_t* vz, int64_t t0,
                      int64_t n, int64_t h, int64_t D, int64_t gv, int bits, float* a, int64_t stride) {
  const int64_t bv = D * bits / 8, runs = D / gv;
  std::fill(a, a + h * D, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t e = 0; e < D; ++e) {
      const int64_t row = t0 + t;
      const float x = code_at(vc + row * bv, e, bits) * half1(vs[row * runs + e / gv]) + half1(vz[row * runs + e / gv]);
      for (int64_t hh = 0; hh < h; ++hh) a[hh * D + e] += p[hh * stride + t] * x;
    }
}

#ifdef KVPLAN_AVX2
// 8 codes at position p of 8 consecutive bytes (already widened to 32-bit lanes)
template <int BITS>
inline __m256 codes8(__m256i bytes, int p) {
  if (BITS == 8) return _mm256_cvtepi32_ps(bytes);
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(bytes, _mm256_set1_epi32(p * BITS)), mask));
}

inline __m256i bytes8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

// Keys of key groups [j0, j1), g = 32: per channel, the 32 codes of a key group (8 / P bytes
// a chunk) scaled into the query, accumulated in the order the bytes hold them (vector
// p * C + c holds code p of bytes c*8 .. c*8+7, C = 4 / P chunks), then written in token order.
template <int H, int BITS>
void quant_scores32(const float* q, const uint8_t* kc, const uint16_t* ks, const uint16_t* kz, int64_t j0,
                    int64_t j1, int64_t D, float* s, int64_t stride) {
  constexpr int P = 8 / BITS, C = 4 / P;          // codes a byte; 8-byte chunks of a channel's 32 codes
  constexpr int BK = 32 / P;                      // bytes of a channel's key group
  for (int64_t j = j0; j < j1; ++j) {
    __m256 acc[H][4];
    float bias[H];
    for (int hh = 0; hh < H; ++hh) {
      bias[hh] = 0.f;
      for (int a = 0; a < 4; ++a) acc[hh][a] = _mm256_setzero_ps();
    }
    const uint8_t* kj = kc + j * D * BK;
    for (int64_t e = 0; e < D; ++e) {
      const float sc = half1(ks[j * D + e]), zr = half1(kz[j * D + e]);
      __m256 w[H];
      for (int hh = 0; hh < H; ++hh) {
        w[hh] = _mm256_set1_ps(q[hh * D + e] * sc);
        bias[hh] += q[hh * D + e] * zr;
      }
      const uint8_t* row = kj + e * BK;
      for (int c = 0; c < C; ++c) {
        const __m256i b = bytes8(row + c * 8);
        for (int p = 0; p < P; ++p) {
          const __m256 x = codes8<BITS>(b, p);
          for (int hh = 0; hh < H; ++hh) acc[hh][p * C + c] = _mm256_fmadd_ps(w[hh], x, acc[hh][p * C + c]);
        }
      }
    }
    for (int hh = 0; hh < H; ++hh) {
      alignas(32) float buf[32];
      for (int a = 0; a < 4; ++a) _mm256_store_ps(buf + a * 8, acc[hh][a]);
      float* sj = s + hh * stride + (j - j0) * 32;
      for (int p = 0; p < P; ++p)
        for (int c = 0; c < C; ++c)
          for (int k = 0; k < 8; ++k) sj[(c * 8 + k) * P + p] = buf[(p * C + c) * 8 + k] + bias[hh];
    }
  }
}

// Values of rows [t0, t0 + n), D = 8 * DV, each 8-byte chunk of a row inside one run of gv
// channels: out_h = sum_t (p_ht s_t) code_t + sum_t p_ht z_t, accumulated over panels of
// channels (PV vectors per head in registers), codes in the order the bytes hold them.
template <int H, int BITS, int DV>
void quant_values(const float* p, const uint8_t* vc, const uint16_t* vs, const uint16_t* vz, int64_t t0, int64_t n,
                  int64_t gv, float* a, int64_t stride) {
  constexpr int P = 8 / BITS, D = DV * 8, BV = D / P;     // bytes of a row
  constexpr int CH = BV / 8;                                // 8-byte chunks of a row
  constexpr int PV = H <= 3 ? 4 : 2;                        // vectors a panel holds per head
  constexpr int PC = PV / P > 0 ? PV / P : 1;               // chunks a panel covers
  constexpr int NV = PC * P;                                // vectors a panel holds per head
  const int64_t runs = D / gv;
  std::vector<float> zsum(H * runs, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < runs; ++r) {
      const float zr = half1(vz[(t0 + t) * runs + r]);
      for (int hh = 0; hh < H; ++hh) zsum[hh * runs + r] += p[hh * stride + t] * zr;
    }
  for (int c0 = 0; c0 < CH; c0 += PC) {
    __m256 acc[H][NV];
    for (int hh = 0; hh < H; ++hh)
      for (int a2 = 0; a2 < NV; ++a2) acc[hh][a2] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = t0 + t;
      const uint8_t* vr = vc + row * BV;
      __m256 w[H];
      int64_t run = -1;
      for (int cc = 0; cc < PC && c0 + cc < CH; ++cc) {
        const int c = c0 + cc;
        if ((c * 8 * P) / gv != run) {                      // the weights change with the run's scale
          run = (c * 8 * P) / gv;
          const float sc = half1(vs[row * runs + run]);
          for (int hh = 0; hh < H; ++hh) w[hh] = _mm256_set1_ps(p[hh * stride + t] * sc);
        }
        const __m256i b = bytes8(vr + c * 8);
        for (int pp = 0; pp < P; ++pp) {
          const __m256 x = codes8<BITS>(b, pp);
          for (int hh = 0; hh < H; ++hh) acc[hh][cc * P + pp] = _mm256_fmadd_ps(w[hh], x, acc[hh][cc * P + pp]);
        }
      }
    }
    for (int hh = 0; hh < H; ++hh) {
      alignas(32) float buf[NV * 8];
      for (int a2 = 0; a2 < NV; ++a2) _mm256_store_ps(buf + a2 * 8, acc[hh][a2]);
      for (int cc = 0; cc < PC && c0 + cc < CH; ++cc)
        for (int pp = 0; pp < P; ++pp)
          for (int k = 0; k < 8; ++k) {
            const int e = ((c0 + cc) * 8 + k) * P + pp;        // the channel code pp of byte k holds
            a[hh * D + e] = buf[(cc * P + pp) * 8 + k] + zsum[hh * runs + e / gv];
          }
    }
  }
}
#endif

using QScoresFn = void (*)(const float*, const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t,
                           float*, int64_t);
using QValuesFn = void (*)(const float*, const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t,
                           float*, int64_t);

struct QuantFns {
  QScoresFn scores = nullptr;
  QValuesFn values = nullptr;
};

QuantFns pick_quant(int64_t H, int64_t D, int64_t g, int64_t gv, int bits) {
  QuantFns f;
#ifdef KVPLAN_AVX2
  const int P = 8 / bits;
  if (g == 32 && bits >= 2) {
#define KVPLAN_QS(h, b) if (H == h && bits == b) f.scores = quant_scores32<h, b>;
    KVPLAN_QS(1, 2) KVPLAN_QS(1, 4) KVPLAN_QS(1, 8) KVPLAN_QS(2, 2) KVPLAN_QS(2, 4) KVPLAN_QS(2, 8)
    KVPLAN_QS(3, 2) KVPLAN_QS(3, 4) KVPLAN_QS(3, 8) KVPLAN_QS(4, 2) KVPLAN_QS(4, 4) KVPLAN_QS(4, 8)
#undef KVPLAN_QS
  }
  if (bits >= 2 && (D / P) % 8 == 0 && gv % (8 * P) == 0) {
#define KVPLAN_QV(h, b, dv) if (H == h && bits == b && D == 8 * dv) f.values = quant_values<h, b, dv>;
    KVPLAN_QV(1, 2, 8) KVPLAN_QV(1, 4, 8) KVPLAN_QV(1, 8, 8) KVPLAN_QV(2, 2, 8) KVPLAN_QV(2, 4, 8) KVPLAN_QV(2, 8, 8)
    KVPLAN_QV(3, 2, 8) KVPLAN_QV(3, 4, 8) KVPLAN_QV(3, 8, 8) KVPLAN_QV(4, 2, 8) KVPLAN_QV(4, 4, 8) KVPLAN_QV(4, 8, 8)
    KVPLAN_QV(1, 4, 16) KVPLAN_QV(1, 8, 16) KVPLAN_QV(2, 4, 16) KVPLAN_QV(2, 8, 16) KVPLAN_QV(3, 4, 16)
    KVPLAN_QV(3, 8, 16) KVPLAN_QV(4, 4, 16) KVPLAN_QV(4, 8, 16)
#undef KVPLAN_QV
  }
#endif
  return f;
}

}  // namespace

// q [G, h, D] fp32; per group: kc [n, D, g*b/8] u8, ks, kz [n, D] fp16, vc [Q, D*b/8] u8, vs, vz [Q, D/gv]
// fp16, kt, vt [R, D] fp16 (rows contiguous, any row stride); masks: empty, or one [h, Q + R] bool
// per group (empty: every row seen). bits, g, gv, D alike over the groups. -> [G, h, D] fp32
torch::Tensor quant_decode(torch::Tensor q, std::vector<torch::Tensor> kc, std::vector<torch::Tensor> ks,
                           std::vector<torch::Tensor> kz, std::vector<torch::Tensor> vc, std::vector<torch::Tensor> vs,
                           std::vector<torch::Tensor> vz, std::vector<torch::Tensor> kt, std::vector<torch::Tensor> vt,
                           std::vector<torch::Tensor> masks, int64_t bits, int64_t g, int64_t gv, double scaling,
                           int64_t block) {
  const int64_t G = q.size(0), h = q.size(1), D = q.size(2);
  const int64_t kb = std::max<int64_t>(1, block / g);          // key groups a block
  std::vector<int64_t> first(G + 1, 0), quant_blocks(G);
  for (int64_t i = 0; i < G; ++i) {
    quant_blocks[i] = (kc[i].size(0) + kb - 1) / kb;
    first[i + 1] = first[i] + quant_blocks[i] + (kt[i].size(0) > 0 ? 1 : 0);
  }
  const int64_t tasks = first[G];
  const int64_t width = std::max<int64_t>(kb * g, 1);
  int64_t longest_tail = 0;
  for (int64_t i = 0; i < G; ++i) longest_tail = std::max(longest_tail, kt[i].size(0));
  const int64_t stride = std::max(width, longest_tail);
  auto qs = (q * scaling).contiguous();
  auto out = torch::empty({G, h, D}, q.options());
  std::vector<float> mx(tasks * h), sm(tasks * h), acc(tasks * h * D);
  const float* qp = qs.data_ptr<float>();
  const QuantFns qf = pick_quant(h, D, g, gv, (int)bits);
  const DenseFns df = pick_dense(h, D);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(h * stride);
    int64_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first[i + 1]) ++i;
      const int64_t b = task - first[i];
      const float* qi = qp + i * h * D;
      const bool* mk = mask_ptr(masks, i);
      const int64_t mst = mk ? masks[i].stride(0) : 0;
      Partial part{mx.data() + task * h, sm.data() + task * h, acc.data() + task * h * D};
      if (b == quant_blocks[i]) {                            // the dense tail
        const int64_t rows = vc[i].size(0), n = kt[i].size(0);
        dense_block(df, qi, reinterpret_cast<const uint16_t*>(kt[i].data_ptr<at::Half>()), kt[i].stride(0),
                    reinterpret_cast<const uint16_t*>(vt[i].data_ptr<at::Half>()), vt[i].stride(0), n, h, D,
                    mk ? mk + rows : nullptr, mst, s.data(), stride, part);
        continue;
      }
      const int64_t j0 = b * kb, j1 = std::min(kc[i].size(0), j0 + kb), n = (j1 - j0) * g;
      const uint8_t* kcp = kc[i].data_ptr<uint8_t>();
      const uint16_t* ksp = reinterpret_cast<const uint16_t*>(ks[i].data_ptr<at::Half>());
      const uint16_t* kzp = reinterpret_cast<const uint16_t*>(kz[i].data_ptr<at::Half>());
      if (qf.scores) qf.scores(qi, kcp, ksp, kzp, j0, j1, D, s.data(), stride);
      else quant_scores_any(qi, kcp, ksp, kzp, j0, j1, h, D, g, (int)bits, s.data(), stride);
      apply_mask(s.data(), h, n, stride, mk ? mk + j0 * g : nullptr, mst);
      softmax_rows(s.data(), h, n, stride, part.m, part.z);
      const uint8_t* vcp = vc[i].data_ptr<uint8_t>();
      const uint16_t* vsp = reinterpret_cast<const uint16_t*>(vs[i].data_ptr<at::Half>());
      const uint16_t* vzp = reinterpret_cast<const uint16_t*>(vz[i].data_ptr<at::Half>());
      if (qf.values) qf.values(s.data(), vcp, vsp, vzp, j0 * g, n, gv, part.a, stride);
      else quant_values_any(s.data(), vcp, vsp, vzp, j0 * g, n, h, D, gv, (int)bits, part.a, stride);
    }
  });
  combine(first, h, D, mx, sm, acc, out.data_ptr<float>());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Quantize and pack (min/max levels, no refits): per group of g consecutive elements of a row,
// scale = fp16((max - min) / levels), zero = fp16(min), code = clamp(floor((x - zero) / scale +
// 0.5), 0, levels) (scale 0: code 0), 8 / b codes a byte, low bits first — bit for bit
// `kernels.quant.quantize_pack_reference`, the same fp32 operations in the same order.
// x [N, L] fp32 or fp16 (any strides: a transposed view reads in place) -> codes [N, L*b/8] u8, scale, zero [N, L/g] fp16
std::vector<torch::Tensor> quantize_pack(torch::Tensor x, int64_t bits, int64_t group) {
  const int64_t N = x.size(0), L = x.size(1), G = L / group, per = 8 / bits, levels = (1 << bits) - 1;
  auto codes = torch::zeros({N, L / per}, x.options().dtype(torch::kUInt8));
  auto scale = torch::empty({N, G}, x.options().dtype(torch::kHalf));
  auto zero = torch::empty({N, G}, x.options().dtype(torch::kHalf));
  const bool half = x.scalar_type() == torch::kHalf;
  const float* xf = half ? nullptr : x.data_ptr<float>();
  const uint16_t* xh = half ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::Half>()) : nullptr;
  const int64_t xs = x.stride(0), xe = x.stride(1);
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint16_t* sp = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  uint16_t* zp = reinterpret_cast<uint16_t*>(zero.data_ptr<at::Half>());
  std::vector<float> buf(group);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t at = n * xs + gi * group * xe;
      float mn = INFINITY, mx = -INFINITY;
      for (int64_t i = 0; i < group; ++i) {
        const float v = half ? half1(xh[at + i * xe]) : xf[at + i * xe];
        buf[i] = v;
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
      }
      const uint16_t sh = _cvtss_sh((mx - mn) / (float)levels, _MM_FROUND_TO_NEAREST_INT);
      const uint16_t zh = _cvtss_sh(mn, _MM_FROUND_TO_NEAREST_INT);
      sp[n * G + gi] = sh;
      zp[n * G + gi] = zh;
      const float s = half1(sh), z = half1(zh), safe = s > 0.f ? s : 1.f;
      uint8_t* row = cp + n * (L / per) + gi * group / per;
      for (int64_t i = 0; i < group; ++i) {
        float q = std::floor((buf[i] - z) / safe + 0.5f);
        q = q < 0.f ? 0.f : (q > (float)levels ? (float)levels : q);
        row[i / per] |= (uint8_t)((int)q << ((i % per) * bits));
      }
    }
  return {codes, scale, zero};
}

// The same quantization and back to fp32 at several bit widths in one pass over x (`auto`'s
// storage-form losses, `kvcore.statistics`): per group of g elements along a row, its min and max
// once, then for each bit width scale, zero and code as `quantize_pack` and zero + code * scale.
// Rows [R, L] (or a batch of them [B, R, L]) of fp32, any strides; only the first `quantized`
// elements of the first `rows` rows are quantized, the rest copied exact (a quant layer's dense
// tail). -> one [R, L] (or [B, R, L]) fp32 per bit width
std::vector<torch::Tensor> dequantized_forms(torch::Tensor x, std::vector<int64_t> bits, int64_t group,
                                             int64_t quantized, int64_t rows) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x must be [R, L] or [B, R, L]");
  const bool batched = x.dim() == 3;
  const int64_t Bn = batched ? x.size(0) : 1, R = x.size(-2), L = x.size(-1);
  const int64_t xb = batched ? x.stride(0) : 0, xs = x.stride(-2), xe = x.stride(-1), B = bits.size();
  std::vector<torch::Tensor> outs;
  std::vector<float*> op;
  for (int64_t b = 0; b < B; ++b) {
    outs.push_back(batched ? torch::empty({Bn, R, L}, x.options()) : torch::empty({R, L}, x.options()));
    op.push_back(outs.back().data_ptr<float>());
  }
  const float* xp = x.data_ptr<float>();
  const int64_t G = quantized / group;
  at::parallel_for(0, Bn * R, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(group);
    for (int64_t br = begin; br < end; ++br) {
      const int64_t r = br % R;
      const float* row = xp + (br / R) * xb + r * xs;
      const int64_t at = br * L;                          // the row's start in every output
      const int64_t groups = r < rows ? G : 0;
      for (int64_t gi = 0; gi < groups; ++gi) {
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t i = 0; i < group; ++i) {
          const float v = row[(gi * group + i) * xe];
          buf[i] = v;
          mn = v < mn ? v : mn;
          mx = v > mx ? v : mx;
        }
        for (int64_t b = 0; b < B; ++b) {
          const float levels = (float)((1 << bits[b]) - 1);
          const float s = half1(_cvtss_sh((mx - mn) / levels, _MM_FROUND_TO_NEAREST_INT));
          const float z = half1(_cvtss_sh(mn, _MM_FROUND_TO_NEAREST_INT));
          const float safe = s > 0.f ? s : 1.f;
          float* o = op[b] + at + gi * group;
          for (int64_t i = 0; i < group; ++i) {
            float q = std::floor((buf[i] - z) / safe + 0.5f);
            q = q < 0.f ? 0.f : (q > levels ? levels : q);
            o[i] = z + q * s;
          }
        }
      }
      for (int64_t i = groups * group; i < L; ++i)
        for (int64_t b = 0; b < B; ++b) op[b][at + i] = row[i * xe];
    }
  });
  return outs;
}

// ---------------------------------------------------------------------------------------------
// New rows into the dense fp16 tails of a layer's KV groups (a decode step's append): k, v
// [G, T, D] fp32 or fp16 (any strides); per group i, kt[i], vt[i] [cap_i, D] fp16 with contiguous
// rows, at[i] of them used. Rows at[i] .. at[i] + T of group i := k[i], v[i] rounded to fp16 (to
// nearest even, as `Tensor.to(torch.float16)`), in place where the tail has room; else into new
// storage of min(ceil((at[i] + T) / chunk) * chunk, limit) rows holding the tail's at[i] rows
// first (an error if even that is too small). -> the 2G tails after it: kt'[0..G), vt'[0..G).
std::vector<torch::Tensor> append_tails(torch::Tensor k, torch::Tensor v, std::vector<torch::Tensor> kt,
                                        std::vector<torch::Tensor> vt, std::vector<int64_t> rows_at, int64_t chunk,
                                        int64_t limit) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must both be [G, T, D]");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
              (k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kHalf), "k and v must be fp32 or fp16");
  TORCH_CHECK(chunk > 0, "chunk must be positive");
  const int64_t G = k.size(0), T = k.size(1), D = k.size(2);
  TORCH_CHECK((int64_t)kt.size() == G && (int64_t)vt.size() == G && (int64_t)rows_at.size() == G,
              "one tail pair and one row count per group");
  std::vector<int64_t> cap(G);
  for (int64_t i = 0; i < G; ++i) {
    TORCH_CHECK(kt[i].size(0) == vt[i].size(0), "group ", i, ": k and v tails of different sizes");
    for (const auto* t : {&kt[i], &vt[i]})
      TORCH_CHECK(t->scalar_type() == torch::kHalf && t->dim() == 2 && t->size(1) == D && t->stride(1) == 1,
                  "tails must be fp16 [cap, D] with contiguous rows");
    const int64_t need = rows_at[i] + T;
    TORCH_CHECK(rows_at[i] >= 0 && rows_at[i] <= kt[i].size(0), "group ", i, ": ", rows_at[i], " rows used of ",
                kt[i].size(0));
    cap[i] = need <= kt[i].size(0) ? kt[i].size(0) : std::min((need + chunk - 1) / chunk * chunk, limit);
    TORCH_CHECK(need <= cap[i], "group ", i, ": rows ", rows_at[i], "..", need, " past its tail's limit of ", limit);
  }
  std::vector<torch::Tensor> out(2 * G);
  for (int64_t i = 0; i < G; ++i)
    for (int w = 0; w < 2; ++w) {
      torch::Tensor dst = w ? vt[i] : kt[i];
      if (cap[i] > dst.size(0)) {                          // a larger storage, the used rows first
        torch::Tensor grown = torch::empty({cap[i], D}, dst.options());
        for (int64_t j = 0; j < rows_at[i]; ++j)
          std::copy_n(dst.data_ptr<at::Half>() + j * dst.stride(0), D, grown.data_ptr<at::Half>() + j * D);
        dst = grown;
      }
      const torch::Tensor& src = w ? v : k;
      const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
      for (int64_t j = 0; j < T; ++j) {
        uint16_t* o = reinterpret_cast<uint16_t*>(dst.data_ptr<at::Half>()) + (rows_at[i] + j) * dst.stride(0);
        if (src.scalar_type() == torch::kHalf) {
          const uint16_t* x = reinterpret_cast<const uint16_t*>(src.data_ptr<at::Half>()) + i * s0 + j * s1;
          for (int64_t d = 0; d < D; ++d) o[d] = x[d * s2];
        } else {
          const float* x = src.data_ptr<float>() + i * s0 + j * s1;
          for (int64_t d = 0; d < D; ++d) o[d] = _cvtss_sh(x[d * s2], _MM_FROUND_TO_NEAREST_INT);
        }
      }
      out[w * G + i] = dst;
    }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Paged decode (`kernels.paged_decode`): one query row per head over every stream of a layer in
// one call, each stream's rows in the engine's pool (`executor.engine.kv_pool`): its quantized
// groups (one group of g rows a block, at any of 2/4/8 bits) and its dense rows [start, end) (fp16
// blocks of R rows: K rows then V rows), in one softmax. Split-K tasks: runs of whole groups, then
// runs of whole dense blocks, each at most `task_rows` rows; a stream's tasks combine in a fixed
// order, so its result is its own whatever else the call holds or the thread count.
namespace {

struct QuantParts {            // byte offsets of a quant block's parts (`kvcore.blocks.Layout.quant_parts`)
  int64_t kc, ks, kz, vc, vs, vz;
};

QuantParts quant_parts(int64_t D, int64_t g, int64_t gv, int bits) {
  QuantParts p;
  p.kc = 0;
  p.ks = p.kc + D * g * bits / 8;
  p.kz = p.ks + D * 2;
  p.vc = p.kz + D * 2;
  p.vs = p.vc + g * D * bits / 8;
  p.vz = p.vs + g * (D / gv) * 2;
  return p;
}

}  // namespace

// q [G, h, D] fp32; arena [bytes] u8; dtable [G, MBd] int32 (pages), dstart, dend [G] int32;
// qtable [G, MBq] int32 (pages), qn, qbits [G] int32 (qbits 0 or qn 0: no groups) -> [G, h, D] fp32
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor arena, torch::Tensor dtable, torch::Tensor dstart,
                           torch::Tensor dend, torch::Tensor qtable, torch::Tensor qn, torch::Tensor qbits,
                           int64_t page_bytes, int64_t R, int64_t g, int64_t gv, double scaling, int64_t task_rows) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat, "q must be fp32 [G, h, D]");
  TORCH_CHECK(arena.scalar_type() == torch::kUInt8 && arena.is_contiguous(), "arena must be contiguous uint8");
  const int64_t G = q.size(0), h = q.size(1), D = q.size(2);
  for (const auto* t : {&dtable, &qtable})
    TORCH_CHECK(t->scalar_type() == torch::kInt && t->dim() == 2 && t->size(0) == G && t->stride(1) == 1,
                "tables must be int32 [G, MB] with contiguous rows");
  for (const auto* t : {&dstart, &dend, &qn, &qbits})
    TORCH_CHECK(t->scalar_type() == torch::kInt && t->numel() == G && t->is_contiguous(), "spans must be int32 [G]");
  TORCH_CHECK(g % R == 0 || R % g == 0, "bad block shapes");
  const int32_t* dt = dtable.data_ptr<int32_t>();
  const int32_t* qt = qtable.data_ptr<int32_t>();
  const int32_t *ds = dstart.data_ptr<int32_t>(), *de = dend.data_ptr<int32_t>();
  const int32_t *qnp = qn.data_ptr<int32_t>(), *qbp = qbits.data_ptr<int32_t>();
  const int64_t dts = dtable.stride(0), qts = qtable.stride(0);
  const int64_t kb = std::max<int64_t>(1, task_rows / g), db = std::max<int64_t>(1, task_rows / R);
  std::vector<int64_t> first(G + 1, 0), qtasks(G);
  for (int64_t i = 0; i < G; ++i) {
    const int64_t groups = qbp[i] ? qnp[i] : 0;
    TORCH_CHECK(ds[i] % R == 0 && de[i] >= ds[i], "stream ", i, ": dense rows [", ds[i], ", ", de[i], ") misaligned");
    qtasks[i] = (groups + kb - 1) / kb;
    const int64_t blocks = (de[i] + R - 1) / R - ds[i] / R;
    first[i + 1] = first[i] + qtasks[i] + (blocks + db - 1) / db;
  }
  const int64_t tasks = first[G];
  const int64_t width = std::max(kb * g, db * R);
  auto qs = (q * scaling).contiguous();
  auto out = torch::empty({G, h, D}, q.options());
  std::vector<float> mx(tasks * h), sm(tasks * h), acc(tasks * h * D);
  const float* qp = qs.data_ptr<float>();
  const uint8_t* base = arena.data_ptr<uint8_t>();
  const DenseFns df = pick_dense(h, D);
  QuantFns qf[9];
  for (int b : {2, 4, 8}) qf[b] = pick_quant(h, D, g, gv, b);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(h * width), tmp(h * D);
    int64_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first[i + 1]) ++i;
      const int64_t b = task - first[i];
      const float* qi = qp + i * h * D;
      Partial part{mx.data() + task * h, sm.data() + task * h, acc.data() + task * h * D};
      float* a = part.a;
      if (b < qtasks[i]) {                                   // whole quant groups [j0, j1)
        const int bits = qbp[i];
        const QuantParts pp = quant_parts(D, g, gv, bits);
        const int64_t j0 = b * kb, j1 = std::min<int64_t>(qnp[i], j0 + kb), n = (j1 - j0) * g;
        for (int64_t j = j0; j < j1; ++j) {
          const uint8_t* blk = base + (int64_t)qt[i * qts + j] * page_bytes;
          const uint16_t* ks = reinterpret_cast<const uint16_t*>(blk + pp.ks);
          const uint16_t* kz = reinterpret_cast<const uint16_t*>(blk + pp.kz);
          float* sj = s.data() + (j - j0) * g;
          if (qf[bits].scores) qf[bits].scores(qi, blk + pp.kc, ks, kz, 0, 1, D, sj, width);
          else quant_scores_any(qi, blk + pp.kc, ks, kz, 0, 1, h, D, g, bits, sj, width);
        }
        softmax_rows(s.data(), h, n, width, part.m, part.z);
        std::fill(a, a + h * D, 0.f);
        for (int64_t j = j0; j < j1; ++j) {
          const uint8_t* blk = base + (int64_t)qt[i * qts + j] * page_bytes;
          const uint16_t* vs = reinterpret_cast<const uint16_t*>(blk + pp.vs);
          const uint16_t* vz = reinterpret_cast<const uint16_t*>(blk + pp.vz);
          const float* pj = s.data() + (j - j0) * g;
          if (qf[bits].values) qf[bits].values(pj, blk + pp.vc, vs, vz, 0, g, gv, tmp.data(), width);
          else quant_values_any(pj, blk + pp.vc, vs, vz, 0, g, h, D, gv, bits, tmp.data(), width);
          for (int64_t e = 0; e < h * D; ++e) a[e] += tmp[e];
        }
        continue;
      }
      const int64_t b0 = ds[i] / R + (b - qtasks[i]) * db;   // whole dense blocks [b0, b1)
      const int64_t b1 = std::min<int64_t>((de[i] + R - 1) / R, b0 + db);
      int64_t n = 0;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t rows = std::min<int64_t>(de[i], (blk + 1) * R) - blk * R;
        const uint16_t* k = reinterpret_cast<const uint16_t*>(base + (int64_t)dt[i * dts + blk] * page_bytes);
        if (df.scores) df.scores(qi, k, D, rows, s.data() + n, width);
        else dense_scores_any(qi, k, D, rows, h, D, s.data() + n, width);
        n += rows;
      }
      softmax_rows(s.data(), h, n, width, part.m, part.z);
      std::fill(a, a + h * D, 0.f);
      n = 0;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t rows = std::min<int64_t>(de[i], (blk + 1) * R) - blk * R;
        const uint16_t* v = reinterpret_cast<const uint16_t*>(base + (int64_t)dt[i * dts + blk] * page_bytes) + R * D;
        if (df.values) df.values(s.data() + n, v, D, rows, tmp.data(), width);
        else dense_values_any(s.data() + n, v, D, rows, h, D, tmp.data(), width);
        for (int64_t e = 0; e < h * D; ++e) a[e] += tmp[e];
        n += rows;
      }
    }
  });
  combine(first, h, D, mx, sm, acc, out.data_ptr<float>());
  return out;
}

// kernels/cpu_decoder_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w, double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
void write_kv(torch::Tensor rows, torch::Tensor at, torch::Tensor k, torch::Tensor v, int64_t R);
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor arena, torch::Tensor table, torch::Tensor kv_len,
                            torch::Tensor q_start, int64_t page_rows, double scaling);   // cpu_prefill.cpp
torch::Tensor quant_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<int64_t> bits,
                              std::vector<int64_t> rows, std::vector<int64_t> vgroups, int64_t wq,
                              double scaling);                                             // cpu_quant_attention.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 or bf16 rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta in place, then RMSNorm of it");
  m.def("rope_", &rope_, "RoPE on fp32 or bf16 rows in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("write_kv", &write_kv, "a step's K/V rows into the pool's fp16 rows");
  m.def("paged_prefill", &paged_prefill, "causal prefill attention of packed segments over the pool's pages");
  m.def("quant_attention", &quant_attention, "last queries' attention over K/V quantized on the fly, per width");
  m.def("dequantized_forms", &dequantized_forms, "quantization and back at several bit widths, one pass");
  m.def("quantize_pack", &quantize_pack, "min/max quantization and packing of groups along a row");
  m.def("dense_decode", &dense_decode, "decode attention over dense fp16 rows of many groups");
  m.def("quant_decode", &quant_decode, "decode attention over KIVI-quantized rows of many groups");
  m.def("paged_decode", &paged_decode, "decode attention over the streams of a layer in the paged pool");
  m.def("append_tails", &append_tails, "new rows into many groups' fp16 tails (grown where full)");
}
