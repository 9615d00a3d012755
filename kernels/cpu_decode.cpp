// Decode attention on the CPU over the engine's paged pool (`paged_decode_mixed`, launcher and torch
// reference in kernels/paged_decode.py): a few query rows per stream, every stream of a layer (KV
// head x sequence) in one call, each stream's rows read in place from its pages — quant pages of
// any form, coded rows (entries x magnitudes), dense fp16 rows — never a float copy of the cache.
// Also the pool's quantizers (`quantize_pack`, `dequantized_forms`: kernels/quant.py).
//
// Split-K (flash-decoding): each stream's pages are cut into runs of a fixed size, each (stream,
// run) task keeps its running max, sum and h accumulators in its own slot, and the runs combine in
// a fixed order — the same result whatever the thread count, whichever thread ran a task, or the
// other streams of the call. torch's own thread pool (at::parallel_for), so no second thread team
// competes with it; its threads take tasks one after another from a shared counter, so unequal
// tasks (a stream's last run, other forms) or a thread the host holds back leave no thread
// waiting on a fixed share. AVX2 + F16C + FMA fast paths (8 floats a register) for the shapes
// kvplan runs, 16-lane AVX-512 ones for dense rows (a task's pages in one pass: each 16-key
// block's scores, online softmax and values, the pages ahead prefetched) and the pool's 4- and
// 8-bit forms where the host has it; any other shape runs a scalar loop of the same math.
//
// Shapes: G streams; h query rows per stream; D head dim; g rows a quant page, g_k a key group's
// rows, g_v a value group's channels; R dense rows a page.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_vec.h"            // KVPLAN_AVX2 and its 8-lane helpers

namespace {

// ---------------------------------------------------------------------------------------------
// One block's partial result: m [h] running max, z [h] sum of exp, a [h, D] weighted sum.
struct Partial {
  float* m;
  float* z;
  float* a;
};

#ifdef KVPLAN_AVX2
using kvplan::exp_neg8;
using kvplan::hsum8;
inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif

inline float half1(uint16_t x) { return _cvtsh_ss(x); }

// scores s [h, n] (already scaled) -> probabilities in place, with the block's max and sum; a
// head that sees no row of the block gets m = -inf, z = 0 (it weighs nothing when blocks combine).
// The max and the exponentials 16 lanes a step on an AVX-512 host (a tail's lanes masked), 8 on an
// AVX2 one then a scalar tail (a NaN score is passed over by the max as by the scalar loop, and
// kept by the exponential).
void softmax_rows(float* s, int64_t h, int64_t n, int64_t stride, float* m, float* z) {
  for (int64_t j = 0; j < h; ++j) {
    float* sj = s + j * stride;
    float mx = -INFINITY;
    int64_t t = 0;
#if defined(KVPLAN_AVX512)
    const __m512 ninf = _mm512_set1_ps(-INFINITY);       // a tail's missing lanes: -inf, weight 0
    __m512 m16 = ninf;
    for (; t < n; t += 16) {
      const __mmask16 in = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
      m16 = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, in, sj + t), m16);
    }
    mx = _mm512_reduce_max_ps(m16);
#elif defined(KVPLAN_AVX2)
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(sj + t), m8);
    mx = kvplan::hmax8(m8);
#endif
    for (; t < n; ++t) mx = sj[t] > mx ? sj[t] : mx;
    m[j] = mx;
    if (mx == -INFINITY) {
      z[j] = 0.f;
      std::fill(sj, sj + n, 0.f);
      continue;
    }
    t = 0;
    float zz = 0.f;
#if defined(KVPLAN_AVX512)
    const __m512 mj = _mm512_set1_ps(mx);
    __m512 zs = _mm512_setzero_ps();
    for (; t < n; t += 16) {
      const __mmask16 in = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
      const __m512 x = _mm512_mask_loadu_ps(ninf, in, sj + t);
      const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_UQ),
                                           kvplan::exp_neg16(_mm512_sub_ps(x, mj)));
      _mm512_mask_storeu_ps(sj + t, in, p);
      zs = _mm512_add_ps(zs, p);
    }
    zz = _mm512_reduce_add_ps(zs);
#elif defined(KVPLAN_AVX2)
    const __m256 mj = _mm256_set1_ps(mx);
    __m256 zs = _mm256_setzero_ps();
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) {
      const __m256 x = _mm256_loadu_ps(sj + t);
      const __m256 p = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), exp_neg8(_mm256_sub_ps(x, mj)));
      _mm256_storeu_ps(sj + t, p);
      zs = _mm256_add_ps(zs, p);
    }
    zz = hsum8(zs);
#endif
    for (; t < n; ++t) { sj[t] = sj[t] == -INFINITY ? 0.f : std::exp(sj[t] - mx); zz += sj[t]; }
    z[j] = zz;
  }
}

// ---------------------------------------------------------------------------------------------
// Dense fp16 rows. A split-K task's rows come as segments, one a page (n K rows at k, their V rows
// at v, rows D apart); q [h, D] pre-scaled. Two passes (AVX2, scalar): scores s [h, n] (the task's
// row t in column t, over its segments in order), `softmax_rows`, values a [h, D] over all of
// them. One pass (AVX-512, `dense_task16`): m, z, a of the task straight from its pages.
struct DenseSeg {
  const uint16_t* k;
  const uint16_t* v;
  int64_t n;
};

// The scores ask for the rows PREFETCH_SEGS segments (pages) ahead of the one they read, a pair of
// rows' lines beside each pair of keys scored (a page's lines at once stall on the line fill
// buffers with nothing to overlap them): K rows into L1 (scored first), V rows into L2 (weighed
// after the block's scores, or the task's in two passes). Pages lie anywhere in the pool, so the
// hardware's streams stop at each (without these, one pass read ~20% slower on 2 threads of a
// Xeon). A task's first segments are asked for at its start (and in one pass by the task before
// it on the thread). The helpers are always inlined: GCC 12's mod/ref analysis takes a function
// that only prefetches for one without effects and drops its calls, prefetches and all.
constexpr int64_t PREFETCH_SEGS = 2;

__attribute__((always_inline)) inline void prefetch_lines(const void* k, const void* v, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(k) + o, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v) + o, _MM_HINT_T1);
  }
}

// a task's first PREFETCH_SEGS segments; the segment PREFETCH_SEGS after i (nullptr: none)
__attribute__((always_inline)) inline const DenseSeg* prefetch_start(const DenseSeg* seg, int64_t nseg, int64_t i,
                                                                     int64_t D) {
  if (i == 0)
    for (int64_t j = 0; j < PREFETCH_SEGS && j < nseg; ++j) prefetch_lines(seg[j].k, seg[j].v, seg[j].n * D * 2);
  return i + PREFETCH_SEGS < nseg ? seg + i + PREFETCH_SEGS : nullptr;
}

// one segment's n rows k for h query rows (columns [0, n) of s); a += p [h, n] . its n rows v
void dense_scores_any(const float* q, const uint16_t* k, int64_t n, int64_t h, int64_t D, float* s,
                      int64_t stride) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < h; ++j) {
      float d = 0.f;
      for (int64_t e = 0; e < D; ++e) d += q[j * D + e] * half1(k[t * D + e]);
      s[j * stride + t] = d;
    }
}

void dense_values_any(const float* p, const uint16_t* v, int64_t n, int64_t h, int64_t D, float* a,
                      int64_t stride) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < h; ++j)
      for (int64_t e = 0; e < D; ++e) a[j * D + e] += p[j * stride + t] * half1(v[t * D + e]);
}

// Scores a block of keys at a time with vertical FMAs only: each key's H dot products as W-lane
// partial sums (q . k channel by channel, the K row converted once for the H query rows), then
// the block's W vectors of partials summed into one vector with key t in lane t, by a tree of
// shuffles and adds in which every key's lanes add in the same order (where a horizontal sum per
// key and query row took most of the scores' time). A block past the segment's rows gets zeros for
// the keys it lacks and stores only its own.
#ifdef KVPLAN_AVX2
// 8 lanes: key t's partials for each query row (zeros for a key past the block's nk)
template <int H, int DV>
inline void row_dots8(const float* q, const uint16_t* k, bool live, __m256* d) {
  for (int j = 0; j < H; ++j) d[j] = _mm256_setzero_ps();
  if (!live) return;
  for (int c = 0; c < DV; ++c) {
    const __m256 kr = half8(k + c * 8);
    for (int j = 0; j < H; ++j) d[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (j * DV + c) * 8), kr, d[j]);
  }
}

// scores of keys [0, nk) (nk <= 8, rows 8 * DV apart) for H query rows: out[j] lane t = q_j . k_t
// (hadd pairs lanes, twice: lanes 0-3 of each half hold keys 0-3, then 4-7; the halves' sums last)
template <int H, int DV>
inline void dense_block8(const float* q, const uint16_t* k, int nk, __m256* out, const uint16_t* pk,
                         const uint16_t* pv) {
  constexpr int D = 8 * DV;
  __m256 r2[H][2];
#pragma GCC unroll 2
  for (int quad = 0; quad < 2; ++quad) {
    __m256 r1[H][2];
#pragma GCC unroll 2
    for (int pr = 0; pr < 2; ++pr) {
      const int t = quad * 4 + pr * 2;
      __m256 da[H], db[H];
      row_dots8<H, DV>(q, k + t * D, t < nk, da);
      row_dots8<H, DV>(q, k + (t + 1) * D, t + 1 < nk, db);
      if (pk) prefetch_lines(pk + t * D, pv + t * D, 4 * D);
      for (int j = 0; j < H; ++j) r1[j][pr] = _mm256_hadd_ps(da[j], db[j]);
    }
    for (int j = 0; j < H; ++j) r2[j][quad] = _mm256_hadd_ps(r1[j][0], r1[j][1]);
  }
  for (int j = 0; j < H; ++j)
    out[j] = _mm256_add_ps(_mm256_permute2f128_ps(r2[j][0], r2[j][1], 0x20),
                           _mm256_permute2f128_ps(r2[j][0], r2[j][1], 0x31));
}

template <int H, int DV>
void dense_scores(const float* q, const DenseSeg* seg, int64_t nseg, float* s, int64_t stride) {
  constexpr int D = 8 * DV;
  int64_t t0 = 0;
  for (int64_t i = 0; i < nseg; ++i) {
    const DenseSeg* ahead = prefetch_start(seg, nseg, i, D);
    for (int64_t b = 0; b < seg[i].n; b += 8) {
      const int nk = (int)std::min<int64_t>(8, seg[i].n - b);
      const bool pf = ahead && b < ahead->n;
      __m256 out[H];
      dense_block8<H, DV>(q, seg[i].k + b * D, nk, out, pf ? ahead->k + b * D : nullptr,
                          pf ? ahead->v + b * D : nullptr);
      float* st = s + t0 + b;
      for (int j = 0; j < H; ++j) {
        if (nk == 8) { _mm256_storeu_ps(st + j * stride, out[j]); continue; }
        alignas(32) float buf[8];
        _mm256_store_ps(buf, out[j]);
        std::copy(buf, buf + nk, st + j * stride);
      }
    }
    t0 += seg[i].n;
  }
}

// a [H, D] = p [H, n] . v: one query row at a time, its DV accumulators in registers over every segment
template <int H, int DV>
void dense_values(const float* p, const DenseSeg* seg, int64_t nseg, float* a, int64_t stride) {
  constexpr int D = 8 * DV;
  for (int j = 0; j < H; ++j) {
    const float* pj = p + j * stride;
    __m256 acc[DV];
    for (int c = 0; c < DV; ++c) acc[c] = _mm256_setzero_ps();
    int64_t t0 = 0;
    for (int64_t i = 0; i < nseg; ++i) {
      const uint16_t* v = seg[i].v;
      for (int64_t t = 0; t < seg[i].n; ++t) {
        const __m256 w = _mm256_set1_ps(pj[t0 + t]);
        for (int c = 0; c < DV; ++c) acc[c] = _mm256_fmadd_ps(w, half8(v + t * D + c * 8), acc[c]);
      }
      t0 += seg[i].n;
    }
    for (int c = 0; c < DV; ++c) _mm256_storeu_ps(a + (j * DV + c) * 8, acc[c]);
  }
}
#endif

#if defined(KVPLAN_AVX512)
// 16 lanes (an AVX-512 host): blocks of 16 keys, a row's D channels as D / 16 vectors, and the
// whole task in one pass (`dense_task16`).
template <int H, int DV>
inline void row_dots16(const float* q, const uint16_t* k, bool live, __m512* d) {
  for (int j = 0; j < H; ++j) d[j] = _mm512_setzero_ps();
  if (!live) return;
  for (int c = 0; c < DV; ++c) {
    const __m512 kr = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(k + c * 16)));
    for (int j = 0; j < H; ++j) d[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (j * DV + c) * 16), kr, d[j]);
  }
}

// pair sums: within each 128-bit lane, a's and b's lanes (0+2, 1+3) interleaved
inline __m512 sum_pair(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
// two pair sums (keys a, b and c, d) -> each 128-bit lane holds keys a, b, c, d
inline __m512 sum_quad(__m512 x, __m512 y) {
  const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)), _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd)));
}
// 128-bit lanes 0+1 and 2+3 of x, then of y (keys of x's lane pairs first)
inline __m512 sum_lanes(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// scores of keys [0, nk) (nk <= 16, rows 16 * DV apart) for H query rows: out[j] lane t = q_j . k_t.
// Keys four at a time to one vector a quad (each 128-bit lane: keys 4u .. 4u+3, that lane's share),
// quads 0-1 and 2-3 to one vector a half, the halves to the block's: keys in order. Beside each
// pair of keys, the lines of the same two rows of the segment ahead (pk, pv; nullptr: none).
template <int H, int DV>
inline void dense_block16(const float* q, const uint16_t* k, int nk, __m512* out, const uint16_t* pk,
                          const uint16_t* pv) {
  constexpr int D = 16 * DV;
  __m512 r3[H][2];
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    __m512 r2[H][2];
#pragma GCC unroll 2
    for (int quad = 0; quad < 2; ++quad) {
      __m512 r1[H][2];
#pragma GCC unroll 2
      for (int pr = 0; pr < 2; ++pr) {
        const int t = half * 8 + quad * 4 + pr * 2;
        __m512 da[H], db[H];
        row_dots16<H, DV>(q, k + t * D, t < nk, da);
        row_dots16<H, DV>(q, k + (t + 1) * D, t + 1 < nk, db);
        if (pk) prefetch_lines(pk + t * D, pv + t * D, 4 * D);
        for (int j = 0; j < H; ++j) r1[j][pr] = sum_pair(da[j], db[j]);
      }
      for (int j = 0; j < H; ++j) r2[j][quad] = sum_quad(r1[j][0], r1[j][1]);
    }
    for (int j = 0; j < H; ++j) r3[j][half] = sum_lanes(r2[j][0], r2[j][1]);
  }
  for (int j = 0; j < H; ++j) out[j] = sum_lanes(r3[j][0], r3[j][1]);
}

// A task's dense rows for H query rows in one pass, block by block (16 keys of a segment): the
// block's scores, each row's running max raised to the block's (its sum and accumulators scaled by
// e^(old - new) when it rises), the block's probabilities e^(s - max) into the sum, then the
// block's V rows, each converted once for the H rows and weighed by every row's broadcast
// probability -> m, z [H], a [H, D] (what `softmax_rows` and the values give, bar the rescaling's
// rounding). A page's K and V rows are read together, so the loads it waits on spread evenly over
// the task; the segments ahead are asked for beside the scores (prefetch_lines), past the task's
// end those of `after` (the thread's next task, when dense; nafter 0: none).
template <int H, int DV>
void dense_task16(const float* q, const DenseSeg* seg, int64_t nseg, const DenseSeg* after, int64_t nafter,
                  float* m, float* z, float* a) {
  constexpr int D = 16 * DV;
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 acc[H][DV], zs[H];
  float mr[H];
  for (int j = 0; j < H; ++j) {
    for (int c = 0; c < DV; ++c) acc[j][c] = _mm512_setzero_ps();
    zs[j] = _mm512_setzero_ps();
    mr[j] = -INFINITY;
  }
  for (int64_t i = 0; i < std::min<int64_t>(PREFETCH_SEGS, nseg); ++i)
    prefetch_lines(seg[i].k, seg[i].v, seg[i].n * D * 2);
  for (int64_t i = 0; i < nseg; ++i) {
    const int64_t ia = i + PREFETCH_SEGS;
    const DenseSeg* ahead = ia < nseg ? seg + ia : ia - nseg < nafter ? after + (ia - nseg) : nullptr;
    const uint16_t* v = seg[i].v;
    for (int64_t b = 0; b < seg[i].n; b += 16) {
      const int nk = (int)std::min<int64_t>(16, seg[i].n - b);
      const __mmask16 in = (__mmask16)((1u << nk) - 1);
      const bool pf = ahead && b < ahead->n;
      __m512 sc[H];
      dense_block16<H, DV>(q, seg[i].k + b * D, nk, sc, pf ? ahead->k + b * D : nullptr,
                           pf ? ahead->v + b * D : nullptr);
      alignas(64) float pb[H][16];
      for (int j = 0; j < H; ++j) {
        const __m512 x = _mm512_mask_mov_ps(ninf, in, sc[j]);          // keys past the block: -inf
        const float bm = _mm512_reduce_max_ps(x);
        if (bm > mr[j]) {                                              // the max rises: rescale
          const __m512 f = mr[j] == -INFINITY ? _mm512_setzero_ps() : kvplan::exp_neg16(_mm512_set1_ps(mr[j] - bm));
          for (int c = 0; c < DV; ++c) acc[j][c] = _mm512_mul_ps(acc[j][c], f);
          zs[j] = _mm512_mul_ps(zs[j], f);
          mr[j] = bm;
        }
        __m512 p = _mm512_setzero_ps();                                 // (no finite score yet: none weighs)
        if (mr[j] != -INFINITY)
          p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_UQ),
                                  kvplan::exp_neg16(_mm512_sub_ps(x, _mm512_set1_ps(mr[j]))));
        zs[j] = _mm512_add_ps(zs[j], p);
        _mm512_store_ps(pb[j], p);
      }
      for (int t = 0; t < nk; ++t) {
        __m512 vr[DV];
        for (int c = 0; c < DV; ++c)
          vr[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(v + (b + t) * D + c * 16)));
        for (int j = 0; j < H; ++j) {
          const __m512 w = _mm512_set1_ps(pb[j][t]);
          for (int c = 0; c < DV; ++c) acc[j][c] = _mm512_fmadd_ps(w, vr[c], acc[j][c]);
        }
      }
    }
  }
  for (int j = 0; j < H; ++j) {
    m[j] = mr[j];
    z[j] = mr[j] == -INFINITY ? 0.f : _mm512_reduce_add_ps(zs[j]);
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(a + (j * DV + c) * 16, acc[j][c]);
  }
}
#endif

using ScoresFn = void (*)(const float*, const DenseSeg*, int64_t, float*, int64_t);
using ValuesFn = void (*)(const float*, const DenseSeg*, int64_t, float*, int64_t);
using TaskFn = void (*)(const float*, const DenseSeg*, int64_t, const DenseSeg*, int64_t, float*, float*, float*);

struct DenseFns {
  ScoresFn scores = nullptr;       // two passes (AVX2): scores, then `softmax_rows`, then values
  ValuesFn values = nullptr;
  TaskFn task = nullptr;           // one pass (AVX-512)
};

// Query rows of a one-pass chunk: its accumulators (H * D / 16 vectors) in 16 of the 32 registers
int64_t task_chunk(int64_t D) {
#if defined(KVPLAN_AVX512)
  if (D == 64 || D == 128) return 256 / D;
#endif
  return 0;
}

DenseFns pick_dense(int64_t H, int64_t D) {
  DenseFns f;
#if defined(KVPLAN_AVX512)
#define KVPLAN_CASE16(h, dv) \
  if (H == h && D == 16 * dv) { f.task = dense_task16<h, dv>; return f; }
  KVPLAN_CASE16(1, 4) KVPLAN_CASE16(2, 4) KVPLAN_CASE16(3, 4) KVPLAN_CASE16(4, 4) KVPLAN_CASE16(1, 8)
  KVPLAN_CASE16(2, 8)
#undef KVPLAN_CASE16
#endif
#ifdef KVPLAN_AVX2
#define KVPLAN_CASE(h, dv) \
  if (H == h && D == 8 * dv) { f.scores = dense_scores<h, dv>; f.values = dense_values<h, dv>; return f; }
  KVPLAN_CASE(1, 4) KVPLAN_CASE(1, 8) KVPLAN_CASE(1, 16) KVPLAN_CASE(2, 4) KVPLAN_CASE(2, 6) KVPLAN_CASE(2, 8)
  KVPLAN_CASE(2, 16) KVPLAN_CASE(3, 4) KVPLAN_CASE(3, 8) KVPLAN_CASE(3, 16) KVPLAN_CASE(4, 4) KVPLAN_CASE(4, 8)
  KVPLAN_CASE(4, 16) KVPLAN_CASE(5, 8) KVPLAN_CASE(5, 16) KVPLAN_CASE(6, 8) KVPLAN_CASE(6, 16) KVPLAN_CASE(7, 8)
  KVPLAN_CASE(7, 16) KVPLAN_CASE(8, 8) KVPLAN_CASE(8, 16)
#undef KVPLAN_CASE
#endif
  return f;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Quantized rows (KIVI, a quant page of `kvcore.blocks`): keys per channel (a channel's codes for
// the page's g rows, kc [D, g*b/8], one fp16 scale and zero per key group of g_k rows and channel),
// values per row (vc [g, D*b/8], one fp16 scale and zero per run of g_v channels), codes packed low
// bits first: byte k of a row holds elements k*P .. k*P + P - 1 (P = 8 / b codes a byte).
namespace {

inline int code_at(const uint8_t* row, int64_t i, int bits) {
  const int per = 8 / bits;
  return (row[i / per] >> ((i % per) * bits)) & ((1 << bits) - 1);
}

// scores of one key group of kg rows: s[hh, i] for i < kg; channel e's codes at kc + e * cst, its
// scale and zero ks[e], kz[e]; q [h, D] pre-scaled
void quant_scores_any(const float* q, const uint8_t* kc, int64_t cst, const uint16_t* ks, const uint16_t* kz,
                      int64_t h, int64_t D, int64_t kg, int bits, float* s, int64_t stride) {
  for (int64_t i = 0; i < kg; ++i)
    for (int64_t hh = 0; hh < h; ++hh) {
      float d = 0.f;
      for (int64_t e = 0; e < D; ++e) {
        const float x = code_at(kc + e * cst, i, bits) * half1(ks[e]) + half1(kz[e]);
        d += q[hh * D + e] * x;
      }
      s[hh * stride + i] = d;
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

// Keys of one key group of G = 8 * BK / BITS rows: per channel (its BK bytes at kc + e * cst, C =
// BK / 8 chunks of 8 bytes), the G codes scaled into the query, accumulated in the order the bytes
// hold them (vector p * C + c holds code p of bytes c*8 .. c*8+7), then written in token order.
template <int H, int BITS, int BK>
void quant_scores_g(const float* q, const uint8_t* kc, int64_t cst, const uint16_t* ks, const uint16_t* kz,
                    int64_t D, float* s, int64_t stride) {
  constexpr int P = 8 / BITS, C = BK / 8;         // codes a byte; 8-byte chunks of a channel's codes
  constexpr int G = BK * P;                       // rows of a key group
  __m256 acc[H][C * P];
  float bias[H];
  for (int hh = 0; hh < H; ++hh) {
    bias[hh] = 0.f;
    for (int a = 0; a < C * P; ++a) acc[hh][a] = _mm256_setzero_ps();
  }
  for (int64_t e = 0; e < D; ++e) {
    const float sc = half1(ks[e]), zr = half1(kz[e]);
    __m256 w[H];
    for (int hh = 0; hh < H; ++hh) {
      w[hh] = _mm256_set1_ps(q[hh * D + e] * sc);
      bias[hh] += q[hh * D + e] * zr;
    }
    const uint8_t* row = kc + e * cst;
    for (int c = 0; c < C; ++c) {
      const __m256i b = bytes8(row + c * 8);
      for (int p = 0; p < P; ++p) {
        const __m256 x = codes8<BITS>(b, p);
        for (int hh = 0; hh < H; ++hh) acc[hh][p * C + c] = _mm256_fmadd_ps(w[hh], x, acc[hh][p * C + c]);
      }
    }
  }
  for (int hh = 0; hh < H; ++hh) {
    alignas(32) float buf[G];
    for (int a = 0; a < C * P; ++a) _mm256_store_ps(buf + a * 8, acc[hh][a]);
    float* sj = s + hh * stride;
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < C; ++c)
        for (int k = 0; k < 8; ++k) sj[(c * 8 + k) * P + p] = buf[(p * C + c) * 8 + k] + bias[hh];
  }
}

// Keys of one 1-bit key group of 32 rows (4 bytes a channel, SpeCache's): the channel's codes as
// one 32-bit word, vector p holding rows 8p .. 8p+7 (bit 8p + lane), so they come out in order.
template <int H>
void quant_scores_w(const float* q, const uint8_t* kc, int64_t cst, const uint16_t* ks, const uint16_t* kz,
                    int64_t D, float* s, int64_t stride) {
  __m256 acc[H][4];
  float bias[H];
  for (int hh = 0; hh < H; ++hh) {
    bias[hh] = 0.f;
    for (int p = 0; p < 4; ++p) acc[hh][p] = _mm256_setzero_ps();
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
  for (int64_t e = 0; e < D; ++e) {
    const float sc = half1(ks[e]), zr = half1(kz[e]);
    __m256 w[H];
    for (int hh = 0; hh < H; ++hh) {
      w[hh] = _mm256_set1_ps(q[hh * D + e] * sc);
      bias[hh] += q[hh * D + e] * zr;
    }
    uint32_t word;
    std::memcpy(&word, kc + e * cst, 4);
    const __m256i bits = _mm256_set1_epi32((int)word);
    for (int p = 0; p < 4; ++p) {
      const __m256i shift = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * p));
      const __m256 x = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(bits, shift), one));
      for (int hh = 0; hh < H; ++hh) acc[hh][p] = _mm256_fmadd_ps(w[hh], x, acc[hh][p]);
    }
  }
  for (int hh = 0; hh < H; ++hh) {
    const __m256 b = _mm256_set1_ps(bias[hh]);
    for (int p = 0; p < 4; ++p) _mm256_storeu_ps(s + hh * stride + 8 * p, _mm256_add_ps(acc[hh][p], b));
  }
}

// Values of rows [t0, t0 + n), D = 8 * DV: out_h = sum_t (p_ht s_t) code_t + sum_t p_ht z_t,
// accumulated over panels of channels (PV vectors per head in registers), codes in the order the
// bytes hold them (lane k of chunk c's vector pp: channel (c*8 + k)*P + pp). LANES false: each
// 8-byte chunk of a row inside one run of gv channels (one scale a chunk); LANES true: a run of
// gv < 8P channels (gv a multiple of P, D / gv <= 8 runs), so each lane takes its own run's scale.
template <int H, int BITS, int DV, bool LANES>
void quant_values(const float* p, const uint8_t* vc, const uint16_t* vs, const uint16_t* vz, int64_t t0, int64_t n,
                  int64_t gv, float* a, int64_t stride) {
  constexpr int P = 8 / BITS, D = DV * 8, BV = D / P;     // bytes of a row
  constexpr int CH = BV / 8;                                // 8-byte chunks of a row
  constexpr int PV = H <= 3 ? 4 : 2;                        // vectors a panel holds per head
  constexpr int PC = PV / P > 0 ? PV / P : 1;               // chunks a panel covers
  constexpr int NV = PC * P;                                // vectors a panel holds per head
  const int64_t runs = D / gv;
  // rows8: a row's 8 chunks are its 8 runs (8-bit values of D = 64: one scale per 8 channels). Each
  // row's scales and zeros are then read as one vector each and its codes dequantized in registers
  // (value = code * scale + zero, weighed by p): a scalar scale conversion and broadcast per chunk and
  // a scalar zero sum per run made 8-bit decode 2.15x dense fp16's on an AVX2 host.
  const bool rows8 = !LANES && gv == 8 * P && runs == 8;
  float zsum[H * 8 * DV];                                   // [H, runs] (runs <= D)
  for (int64_t i = 0; i < H * runs; ++i) zsum[i] = 0.f;
  for (int64_t t = 0; t < n && !rows8; ++t)
    for (int64_t r = 0; r < runs; ++r) {
      const float zr = half1(vz[(t0 + t) * runs + r]);
      for (int hh = 0; hh < H; ++hh) zsum[hh * runs + r] += p[hh * stride + t] * zr;
    }
  __m256i lane_run[PC];                                     // LANES: each lane's run in the panel's chunks
  for (int c0 = 0; c0 < CH; c0 += PC) {
    if (LANES)
      for (int cc = 0; cc < PC; ++cc) {
        alignas(32) int32_t idx[8];
        for (int k = 0; k < 8; ++k) idx[k] = (int32_t)std::min<int64_t>(((c0 + cc) * 8 + k) * P / gv, runs - 1);
        lane_run[cc] = _mm256_load_si256((const __m256i*)idx);
      }
    __m256 acc[H][NV];
    for (int hh = 0; hh < H; ++hh)
      for (int a2 = 0; a2 < NV; ++a2) acc[hh][a2] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = t0 + t;
      const uint8_t* vr = vc + row * BV;
      if (rows8) {                                          // chunk c is run c
        const __m256 s8 = half8(vs + row * 8), z8 = half8(vz + row * 8);
        __m256 pw[H];
        for (int hh = 0; hh < H; ++hh) pw[hh] = _mm256_set1_ps(p[hh * stride + t]);
        for (int cc = 0; cc < PC && c0 + cc < CH; ++cc) {
          const __m256i ic = _mm256_set1_epi32(c0 + cc);
          const __m256 sc = _mm256_permutevar8x32_ps(s8, ic), zc = _mm256_permutevar8x32_ps(z8, ic);
          const __m256i b = bytes8(vr + (c0 + cc) * 8);
          for (int pp = 0; pp < P; ++pp) {
            const __m256 x = _mm256_fmadd_ps(codes8<BITS>(b, pp), sc, zc);
            for (int hh = 0; hh < H; ++hh) acc[hh][cc * P + pp] = _mm256_fmadd_ps(pw[hh], x, acc[hh][cc * P + pp]);
          }
        }
        continue;
      }
      __m256 w[H];
      __m256 scales = _mm256_setzero_ps();
      if (LANES) {
        alignas(32) float rs[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int64_t r = 0; r < runs; ++r) rs[r] = half1(vs[row * runs + r]);
        scales = _mm256_load_ps(rs);
      }
      int64_t run = -1;
      for (int cc = 0; cc < PC && c0 + cc < CH; ++cc) {
        const int c = c0 + cc;
        if (LANES) {
          const __m256 sc8 = _mm256_permutevar8x32_ps(scales, lane_run[cc]);
          for (int hh = 0; hh < H; ++hh) w[hh] = _mm256_mul_ps(_mm256_set1_ps(p[hh * stride + t]), sc8);
        } else if ((c * 8 * P) / gv != run) {               // the weights change with the run's scale
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

#if defined(__AVX512F__)
// The pool's forms on 16 lanes (an AVX-512 host; 4- and 8-bit, D = 64): what the 8-lane loops above
// do in twice the lanes, with each row's scales and zeros read as vectors.
inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }

// 8 bytes at a in lanes 0-7, 8 bytes at b in lanes 8-15 (32-bit lanes)
inline __m512i bytes8x2(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)a), _mm_loadl_epi64((const __m128i*)b)));
}

template <int BITS>
inline __m512 codes16(__m512i bytes, int p) {
  if (BITS == 8) return _mm512_cvtepi32_ps(bytes);
  return _mm512_cvtepi32_ps(
      _mm512_and_si512(_mm512_srlv_epi32(bytes, _mm512_set1_epi32(p * BITS)), _mm512_set1_epi32((1 << BITS) - 1)));
}

// Keys of one key group of the pool's forms (24 bytes of codes a channel: G = 24 * P rows), two
// channels at a time: lanes 0-7 hold chunk c of channel e, lanes 8-15 the same chunk of channel
// e + 1, each weighed by its own q·scale; the halves are summed at the end (every channel adds into
// the same scores). Vector p * 3 + c holds code p of the chunk's bytes, as in `quant_scores_g`.
template <int H, int BITS>
void quant_scores_g16(const float* q, const uint8_t* kc, int64_t cst, const uint16_t* ks, const uint16_t* kz,
                      int64_t D, float* s, int64_t stride) {
  constexpr int P = 8 / BITS, C = 3, G = 24 * P;
  alignas(64) float qs[H][64];                    // q · scale per channel (D = 64)
  float bias[H];
  for (int hh = 0; hh < H; ++hh) {
    __m512 b = _mm512_setzero_ps();
    for (int e = 0; e < 64; e += 16) {
      const __m512 qv = _mm512_loadu_ps(q + hh * D + e);
      _mm512_store_ps(qs[hh] + e, _mm512_mul_ps(qv, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ks + e)))));
      b = _mm512_fmadd_ps(qv, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(kz + e))), b);
    }
    bias[hh] = _mm512_reduce_add_ps(b);
  }
  __m512 acc[H][C * P];
  for (int hh = 0; hh < H; ++hh)
    for (int a = 0; a < C * P; ++a) acc[hh][a] = _mm512_setzero_ps();
  for (int64_t e = 0; e < 64; e += 2) {
    __m512 w[H];
    for (int hh = 0; hh < H; ++hh)
      w[hh] = _mm512_mask_mov_ps(_mm512_set1_ps(qs[hh][e]), (__mmask16)0xFF00, _mm512_set1_ps(qs[hh][e + 1]));
    const uint8_t* r0 = kc + e * cst;
    for (int c = 0; c < C; ++c) {
      const __m512i b = bytes8x2(r0 + c * 8, r0 + cst + c * 8);
      for (int p = 0; p < P; ++p) {
        const __m512 x = codes16<BITS>(b, p);
        for (int hh = 0; hh < H; ++hh) acc[hh][p * C + c] = _mm512_fmadd_ps(w[hh], x, acc[hh][p * C + c]);
      }
    }
  }
  for (int hh = 0; hh < H; ++hh) {
    alignas(32) float buf[G];
    for (int a = 0; a < C * P; ++a) {
      const __m512 v = acc[hh][a];
      const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
      _mm256_store_ps(buf + a * 8, half);
    }
    float* sj = s + hh * stride;
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < C; ++c)
        for (int k = 0; k < 8; ++k) sj[(c * 8 + k) * P + p] = buf[(p * C + c) * 8 + k] + bias[hh];
  }
}

// Values of rows [t0, t0 + n) of the pool's forms (D = 64, one scale per 8 bytes of a row: gv = 8P
// channels), 16 bytes of a row at a time: lanes 0-7 the first 8 bytes (run 2g), lanes 8-15 the next
// (run 2g + 1); each row's scales and zeros converted once as a vector, every lane's picked by a
// permute; codes dequantized in registers and weighed by each head's p. Lane k of vector g * P + pp
// holds channel (16g + k) * P + pp, put in order at the end.
template <int H, int BITS>
void quant_values16(const float* p, const uint8_t* vc, const uint16_t* vs, const uint16_t* vz, int64_t t0, int64_t n,
                    int64_t, float* a, int64_t stride) {
  constexpr int P = 8 / BITS, D = 64, BV = D / P, RUNS = BV / 8, NG = BV / 16;
  __m512i idx[NG];
  for (int g = 0; g < NG; ++g)
    idx[g] = _mm512_mask_mov_epi32(_mm512_set1_epi32(2 * g), (__mmask16)0xFF00, _mm512_set1_epi32(2 * g + 1));
  __m512 acc[H][NG * P];
  for (int hh = 0; hh < H; ++hh)
    for (int v = 0; v < NG * P; ++v) acc[hh][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = t0 + t;
    const uint8_t* vr = vc + row * BV;
    auto runs = [&](const uint16_t* x) {                   // the row's RUNS halves in lanes 0 .. RUNS-1
      const __m128i h = RUNS == 8 ? _mm_loadu_si128((const __m128i*)x) : _mm_loadl_epi64((const __m128i*)x);
      return _mm512_castps256_ps512(_mm256_cvtph_ps(h));
    };
    const __m512 sv = runs(vs + row * RUNS), zv = runs(vz + row * RUNS);
    __m512 pw[H];
    for (int hh = 0; hh < H; ++hh) pw[hh] = _mm512_set1_ps(p[hh * stride + t]);
    for (int g = 0; g < NG; ++g) {
      const __m512 sc = _mm512_permutexvar_ps(idx[g], sv), zc = _mm512_permutexvar_ps(idx[g], zv);
      const __m512i b = bytes16(vr + g * 16);
      for (int pp = 0; pp < P; ++pp) {
        const __m512 x = _mm512_fmadd_ps(codes16<BITS>(b, pp), sc, zc);
        for (int hh = 0; hh < H; ++hh) acc[hh][g * P + pp] = _mm512_fmadd_ps(pw[hh], x, acc[hh][g * P + pp]);
      }
    }
  }
  for (int hh = 0; hh < H; ++hh) {
    alignas(64) float buf[16];
    for (int g = 0; g < NG; ++g)
      for (int pp = 0; pp < P; ++pp) {
        _mm512_store_ps(buf, acc[hh][g * P + pp]);
        for (int k = 0; k < 16; ++k) a[hh * D + (16 * g + k) * P + pp] = buf[k];
      }
  }
}
#endif

using QScoresFn = void (*)(const float*, const uint8_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, float*,
                           int64_t);
using QValuesFn = void (*)(const float*, const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t,
                           float*, int64_t);

struct QuantFns {
  QScoresFn scores = nullptr;     // one key group of kg rows
  QValuesFn values = nullptr;
};

// H query rows; kg rows a key group (its scale per channel), gv channels a value scale
QuantFns pick_quant(int64_t H, int64_t D, int64_t kg, int64_t gv, int bits) {
  QuantFns f;
#ifdef KVPLAN_AVX2
  const int P = 8 / bits;
  if (kg == 32 && bits >= 2) {                           // key groups of 32 rows (SpeCache's forms)
#define KVPLAN_QS(h, b) if (H == h && bits == b) f.scores = quant_scores_g<h, b, 4 * b>;
    KVPLAN_QS(1, 2) KVPLAN_QS(1, 4) KVPLAN_QS(1, 8) KVPLAN_QS(2, 2) KVPLAN_QS(2, 4) KVPLAN_QS(2, 8)
    KVPLAN_QS(3, 2) KVPLAN_QS(3, 4) KVPLAN_QS(3, 8) KVPLAN_QS(4, 2) KVPLAN_QS(4, 4) KVPLAN_QS(4, 8)
#undef KVPLAN_QS
  }
  if (kg == 32 && bits == 1) {                           // SpeCache's 1-bit keys: 4 bytes a channel
    if (H == 1) f.scores = quant_scores_w<1>;
    if (H == 2) f.scores = quant_scores_w<2>;
    if (H == 3) f.scores = quant_scores_w<3>;
    if (H == 4) f.scores = quant_scores_w<4>;
  }
  if (kg * bits == 24 * 8) {                             // the pool's groups: 24 bytes of codes a channel
#define KVPLAN_QS(h, b) if (H == h && bits == b) f.scores = quant_scores_g<h, b, 24>;
    KVPLAN_QS(1, 1) KVPLAN_QS(1, 2) KVPLAN_QS(1, 4) KVPLAN_QS(1, 8) KVPLAN_QS(2, 1) KVPLAN_QS(2, 2)
    KVPLAN_QS(2, 4) KVPLAN_QS(2, 8) KVPLAN_QS(3, 1) KVPLAN_QS(3, 2) KVPLAN_QS(3, 4) KVPLAN_QS(3, 8)
    KVPLAN_QS(4, 1) KVPLAN_QS(4, 2) KVPLAN_QS(4, 4) KVPLAN_QS(4, 8)
#undef KVPLAN_QS
  }
  const bool chunked = gv % (8 * P) == 0, lanes = !chunked && gv % P == 0 && D / gv <= 8 && D % gv == 0;
  if ((D / P) % 8 == 0 && (chunked || lanes)) {
#define KVPLAN_QV(h, b, dv)               \
  if (H == h && bits == b && D == 8 * dv) \
    f.values = chunked ? quant_values<h, b, dv, false> : quant_values<h, b, dv, true>;
    KVPLAN_QV(1, 1, 8) KVPLAN_QV(2, 1, 8) KVPLAN_QV(3, 1, 8) KVPLAN_QV(4, 1, 8)
    KVPLAN_QV(1, 2, 8) KVPLAN_QV(1, 4, 8) KVPLAN_QV(1, 8, 8) KVPLAN_QV(2, 2, 8) KVPLAN_QV(2, 4, 8) KVPLAN_QV(2, 8, 8)
    KVPLAN_QV(3, 2, 8) KVPLAN_QV(3, 4, 8) KVPLAN_QV(3, 8, 8) KVPLAN_QV(4, 2, 8) KVPLAN_QV(4, 4, 8) KVPLAN_QV(4, 8, 8)
    KVPLAN_QV(1, 4, 16) KVPLAN_QV(1, 8, 16) KVPLAN_QV(2, 4, 16) KVPLAN_QV(2, 8, 16) KVPLAN_QV(3, 4, 16)
    KVPLAN_QV(3, 8, 16) KVPLAN_QV(4, 4, 16) KVPLAN_QV(4, 8, 16)
#undef KVPLAN_QV
  }
#endif
#if defined(__AVX512F__)
  if (D == 64 && (bits == 4 || bits == 8)) {             // the pool's forms: 16 lanes
    const bool keys = kg * bits == 24 * 8, values = gv == 8 * (8 / bits);
#define KVPLAN_Q16(h, b)                                 \
  if (H == h && bits == b) {                             \
    if (keys) f.scores = quant_scores_g16<h, b>;         \
    if (values) f.values = quant_values16<h, b>;         \
  }
    KVPLAN_Q16(1, 4) KVPLAN_Q16(2, 4) KVPLAN_Q16(3, 4) KVPLAN_Q16(4, 4)
    KVPLAN_Q16(1, 8) KVPLAN_Q16(2, 8) KVPLAN_Q16(3, 8) KVPLAN_Q16(4, 8)
#undef KVPLAN_Q16
  }
#endif
  return f;
}

}  // namespace

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
// Paged decode over mixed storage forms (`kernels.paged_decode`): a few query rows per stream,
// every stream of a layer (KV head x sequence) in one call, each over its rows in the pool of equal
// pages (`kvcore.blocks`), in one softmax per query row:
//   quant  qn pages of its quant form (K codes per channel, fp16 scale and zero per channel and
//          key group; V codes per row, scale and zero per run of gv channels); rows whose bit is
//          set in its skip page are left out
//   coded  cn rows, each k = mag_k * E_k[ref_k] (turned by RoPE at pos when pos >= 0), v = mag_v *
//          E_v[ref_v]; ref_k < 0: no row; query row j sees it when bit j % group_heads of heads is set
//   dense  rows [start, end) of fp16 pages of R rows (K rows, then V rows)
// Split-K tasks per stream: runs of whole quant pages, runs of whole coded pages, runs of whole
// dense pages, each at most `task_rows` rows (one page at least; the size fixed by the call's
// task_rows, never by the thread count or the other streams); a stream's tasks combine in that
// fixed order, so its result is its own whatever else the call holds or the thread count.
// Query rows go through the AVX2 kernels in chunks (4 for quant pages, 8 for dense; the AVX-512
// one-pass dense kernel 256 / D, its accumulators in 16 registers), so any h runs the vector
// paths; coded rows take plain vector loads (a row of entries, RoPE from the tables).
namespace {

constexpr int QUANT_CHUNK = 4, DENSE_CHUNK = 8;

struct FormDesc {            // a quant form (`Layout.quant_forms`, byte offsets as `Layout.form_parts`)
  int bits = 0;
  int64_t g = 0, kg = 0, gv = 0;
  int64_t kc = 0, ks = 0, kz = 0, vc = 0, vs = 0, vz = 0, bytes = 0;
  QuantFns fns[QUANT_CHUNK + 1];   // by query rows of a chunk
};

FormDesc form_desc(const int32_t* row, int64_t f, int64_t D, int64_t page_bytes) {
  FormDesc d;
  d.bits = row[0];
  d.g = row[1];
  d.kg = row[2];
  d.gv = row[3];
  if (f == 0) return d;                                  // form 0: no quant rows
  TORCH_CHECK(d.bits == 1 || d.bits == 2 || d.bits == 4 || d.bits == 8, "form ", f, ": bits ", d.bits);
  TORCH_CHECK(d.g > 0 && d.kg > 0 && d.g % d.kg == 0 && (d.kg * d.bits) % 8 == 0, "form ", f, ": ", d.g,
              " rows in key groups of ", d.kg);
  TORCH_CHECK(d.gv > 0 && D % d.gv == 0 && (D * d.bits) % 8 == 0, "form ", f, ": value group ", d.gv, " of ", D);
  const int64_t n = d.g / d.kg;
  d.kc = 0;
  d.ks = d.kc + D * d.g * d.bits / 8;
  d.kz = d.ks + n * D * 2;
  d.vc = d.kz + n * D * 2;
  d.vs = d.vc + d.g * D * d.bits / 8;
  d.vz = d.vs + d.g * (D / d.gv) * 2;
  d.bytes = d.vz + d.g * (D / d.gv) * 2;
  TORCH_CHECK(d.bytes <= page_bytes, "form ", f, ": ", d.bytes, " bytes past a page of ", page_bytes);
  for (int c = 1; c <= QUANT_CHUNK; ++c) d.fns[c] = pick_quant(c, D, d.kg, d.gv, d.bits);
  return d;
}

struct CodedDesc {           // a coded page's fields' byte offsets (`Layout.coded_parts`): M rows each
  int64_t ref_k, ref_v, pos, mag_k, mag_v, heads;
};

CodedDesc coded_desc(int64_t M) { return {0, 4 * M, 8 * M, 12 * M, 14 * M, 16 * M}; }

inline int32_t load_i32(const uint8_t* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

inline float load_half(const uint8_t* p) {
  uint16_t x;
  std::memcpy(&x, p, 2);
  return half1(x);
}

// scores of a task's dense rows (segments seg [nseg]) for h query rows, DENSE_CHUNK rows at a time
void dense_scores_rows(const DenseFns* df, const float* q, const DenseSeg* seg, int64_t nseg, int64_t h, int64_t D,
                       float* s, int64_t stride) {
  for (int64_t j0 = 0; j0 < h; j0 += DENSE_CHUNK) {
    const int64_t c = std::min<int64_t>(DENSE_CHUNK, h - j0);
    if (df[c].scores) {
      df[c].scores(q + j0 * D, seg, nseg, s + j0 * stride, stride);
      continue;
    }
    for (int64_t i = 0, t0 = 0; i < nseg; t0 += seg[i].n, ++i)
      dense_scores_any(q + j0 * D, seg[i].k, seg[i].n, c, D, s + j0 * stride + t0, stride);
  }
}

// a [h, D] = p [h, n] . the task's dense rows v (segments seg [nseg])
void dense_values_rows(const DenseFns* df, const float* p, const DenseSeg* seg, int64_t nseg, int64_t h, int64_t D,
                       float* a, int64_t stride) {
  for (int64_t j0 = 0; j0 < h; j0 += DENSE_CHUNK) {
    const int64_t c = std::min<int64_t>(DENSE_CHUNK, h - j0);
    if (df[c].values) {
      df[c].values(p + j0 * stride, seg, nseg, a + j0 * D, stride);
      continue;
    }
    std::fill(a + j0 * D, a + (j0 + c) * D, 0.f);
    for (int64_t i = 0, t0 = 0; i < nseg; t0 += seg[i].n, ++i)
      dense_values_any(p + j0 * stride + t0, seg[i].v, seg[i].n, c, D, a + j0 * D, stride);
  }
}

// scores of a quant page's g rows (s[j, 0..g)), key group by key group
void quant_scores_page(const FormDesc& f, const float* q, const uint8_t* page, int64_t h, int64_t D, float* s,
                       int64_t stride) {
  const int64_t cst = f.g * f.bits / 8, kb = f.kg * f.bits / 8;     // a channel's code bytes; a key group's
  const uint16_t* ks = reinterpret_cast<const uint16_t*>(page + f.ks);
  const uint16_t* kz = reinterpret_cast<const uint16_t*>(page + f.kz);
  for (int64_t n = 0; n < f.g / f.kg; ++n)
    for (int64_t j0 = 0; j0 < h; j0 += QUANT_CHUNK) {
      const int64_t c = std::min<int64_t>(QUANT_CHUNK, h - j0);
      const uint8_t* kc = page + f.kc + n * kb;
      float* sj = s + j0 * stride + n * f.kg;
      if (f.fns[c].scores) f.fns[c].scores(q + j0 * D, kc, cst, ks + n * D, kz + n * D, D, sj, stride);
      else quant_scores_any(q + j0 * D, kc, cst, ks + n * D, kz + n * D, c, D, f.kg, f.bits, sj, stride);
    }
}

// a [h, D] = p [h, g] . a quant page's g values
void quant_values_page(const FormDesc& f, const float* p, const uint8_t* page, int64_t h, int64_t D, float* a,
                       int64_t stride) {
  const uint16_t* vs = reinterpret_cast<const uint16_t*>(page + f.vs);
  const uint16_t* vz = reinterpret_cast<const uint16_t*>(page + f.vz);
  for (int64_t j0 = 0; j0 < h; j0 += QUANT_CHUNK) {
    const int64_t c = std::min<int64_t>(QUANT_CHUNK, h - j0);
    if (f.fns[c].values) f.fns[c].values(p + j0 * stride, page + f.vc, vs, vz, 0, f.g, f.gv, a + j0 * D, stride);
    else quant_values_any(p + j0 * stride, page + f.vc, vs, vz, 0, f.g, c, D, f.gv, f.bits, a + j0 * D, stride);
  }
}

// out [D] = m * x (x fp16)
void scaled_row(const uint16_t* x, float m, int64_t D, float* out) {
  int64_t e = 0;
#ifdef KVPLAN_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  for (; e + 8 <= D; e += 8) _mm256_storeu_ps(out + e, _mm256_mul_ps(half8(x + e), mv));
#endif
  for (; e < D; ++e) out[e] = half1(x[e]) * m;
}

// k [D] := k * cos + rotate_half(k) * sin (HF's rotate_half: (-k[D/2:], k[:D/2])); tmp [D]
void rope_row(float* k, const float* cos, const float* sin, int64_t D, float* tmp) {
  const int64_t half = D / 2;
  int64_t e = 0;
#ifdef KVPLAN_AVX2
  for (; e + 8 <= half; e += 8) {
    const __m256 lo = _mm256_loadu_ps(k + e), hi = _mm256_loadu_ps(k + half + e);
    _mm256_storeu_ps(tmp + e,
                     _mm256_fnmadd_ps(hi, _mm256_loadu_ps(sin + e), _mm256_mul_ps(lo, _mm256_loadu_ps(cos + e))));
    _mm256_storeu_ps(tmp + half + e, _mm256_fmadd_ps(lo, _mm256_loadu_ps(sin + half + e),
                                                     _mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + e))));
  }
#endif
  for (; e < half; ++e) {
    tmp[e] = k[e] * cos[e] - k[half + e] * sin[e];
    tmp[half + e] = k[half + e] * cos[half + e] + k[e] * sin[half + e];
  }
  std::copy(tmp, tmp + 2 * half, k);
}

float dot_row(const float* a, const float* b, int64_t D) {
  int64_t e = 0;
  float d = 0.f;
#ifdef KVPLAN_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; e + 8 <= D; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), acc);
  d = hsum8(acc);
#endif
  for (; e < D; ++e) d += a[e] * b[e];
  return d;
}

// y [D] += w * x
void axpy_row(float w, const float* x, float* y, int64_t D) {
  int64_t e = 0;
#ifdef KVPLAN_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; e + 8 <= D; e += 8)
    _mm256_storeu_ps(y + e, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + e), _mm256_loadu_ps(y + e)));
#endif
  for (; e < D; ++e) y[e] += w * x[e];
}

// Combine each stream's tasks (in task order) into out [G, h, D] and lse [G, h]; a query row that
// saw no row: zeros and -inf. One thread: a few microseconds of work, and a second parallel region
// costs more than that on a busy host.
void combine_lse(const std::vector<int64_t>& first, int64_t h, int64_t D, const std::vector<float>& mx,
                 const std::vector<float>& sm, const std::vector<float>& acc, float* op, float* lp) {
  const int64_t G = (int64_t)first.size() - 1;
  for (int64_t gj = 0; gj < G * h; ++gj) {
    const int64_t g = gj / h, j = gj % h;
    float M = -INFINITY;
    for (int64_t task = first[g]; task < first[g + 1]; ++task) M = std::max(M, mx[task * h + j]);
    float* o = op + gj * D;
    std::fill(o, o + D, 0.f);
    lp[gj] = -INFINITY;
    if (M == -INFINITY) continue;
    float Z = 0.f;
    for (int64_t task = first[g]; task < first[g + 1]; ++task) {
      if (mx[task * h + j] == -INFINITY) continue;
      const float w = std::exp(mx[task * h + j] - M);
      Z += w * sm[task * h + j];
      axpy_row(w, acc.data() + (task * h + j) * D, o, D);
    }
    for (int64_t e = 0; e < D; ++e) o[e] /= Z;
    lp[gj] = M + std::log(Z);
  }
}

void check_table(const torch::Tensor& t, const char* name, int64_t G, bool two) {
  TORCH_CHECK(t.scalar_type() == torch::kInt && t.dim() == (two ? 2 : 1) && t.size(0) == G, name, " must be int32 [",
              G, two ? ", MB]" : "]");
  TORCH_CHECK(two ? t.stride(1) == 1 : t.is_contiguous(), name, " must have contiguous rows");
}

}  // namespace

// q [G, h, D] fp32; arena [bytes] u8; dtable [G, MBd], dstart, dend [G]; qtable [G, MBq], qn,
// qform [G]; ctable [G, MBc], cn [G]; ektable [G, MBk], evtable [G, MBv]; xpage [G] (all int32:
// pages, row counts, form ids; xpage -1: no skip page); forms [F, 4] int32 (bits, rows, key group,
// value group per form; form 0: none); cos, sin [T, D] fp32 (RoPE of coded keys stored pre-RoPE);
// page_bytes, R dense rows a page, coded_rows M a coded page, entry_rows E an entry page;
// group_heads: query row j is head j % group_heads of its group (1..8); task_rows: split-K size
// -> out [G, h, D] fp32, lse [G, h] fp32
std::tuple<torch::Tensor, torch::Tensor> paged_decode_mixed(
    torch::Tensor q, torch::Tensor arena, torch::Tensor dtable, torch::Tensor dstart, torch::Tensor dend,
    torch::Tensor qtable, torch::Tensor qn, torch::Tensor qform, torch::Tensor ctable, torch::Tensor cn,
    torch::Tensor ektable, torch::Tensor evtable, torch::Tensor xpage, torch::Tensor forms, torch::Tensor cos,
    torch::Tensor sin, int64_t page_bytes, int64_t R, int64_t coded_rows, int64_t entry_rows, int64_t group_heads,
    double scaling, int64_t task_rows) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat, "q must be fp32 [G, h, D]");
  TORCH_CHECK(arena.scalar_type() == torch::kUInt8 && arena.dim() == 1 && arena.is_contiguous(),
              "arena must be contiguous uint8 [bytes]");
  const int64_t G = q.size(0), h = q.size(1), D = q.size(2);
  TORCH_CHECK(R > 0 && 4 * R * D <= page_bytes, "a dense page of ", R, " K and V rows of ", D, " fp16 past ",
              page_bytes, " bytes");
  TORCH_CHECK(entry_rows > 0 && 2 * entry_rows * D <= page_bytes, "entry pages of ", entry_rows, " rows past a page");
  TORCH_CHECK(coded_rows > 0 && 17 * coded_rows <= page_bytes, "coded pages of ", coded_rows, " rows past a page");
  TORCH_CHECK(group_heads >= 1 && group_heads <= 8, "group_heads must be 1..8 (a byte of heads a coded row)");
  TORCH_CHECK(task_rows > 0, "task_rows must be positive");
  check_table(dtable, "dtable", G, true);
  check_table(qtable, "qtable", G, true);
  check_table(ctable, "ctable", G, true);
  check_table(ektable, "ektable", G, true);
  check_table(evtable, "evtable", G, true);
  check_table(dstart, "dstart", G, false);
  check_table(dend, "dend", G, false);
  check_table(qn, "qn", G, false);
  check_table(qform, "qform", G, false);
  check_table(cn, "cn", G, false);
  check_table(xpage, "xpage", G, false);
  TORCH_CHECK(forms.scalar_type() == torch::kInt && forms.dim() == 2 && forms.size(1) == 4 && forms.size(0) >= 1 &&
              forms.is_contiguous(), "forms must be int32 [F, 4]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.dim() == 2 &&
              cos.sizes() == sin.sizes() && cos.size(1) == D && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be fp32 [T, D]");
  const int64_t npages = arena.numel() / page_bytes, T = cos.size(0), F = forms.size(0);
  const int64_t M = coded_rows, E = entry_rows;
  std::vector<FormDesc> fd(F);
  for (int64_t f = 0; f < F; ++f) fd[f] = form_desc(forms.data_ptr<int32_t>() + 4 * f, f, D, page_bytes);
  const CodedDesc cd = coded_desc(M);

  const int32_t *dt = dtable.data_ptr<int32_t>(), *qt = qtable.data_ptr<int32_t>(), *ct = ctable.data_ptr<int32_t>();
  const int32_t *ekt = ektable.data_ptr<int32_t>(), *evt = evtable.data_ptr<int32_t>();
  const int32_t *ds = dstart.data_ptr<int32_t>(), *de = dend.data_ptr<int32_t>(), *qnp = qn.data_ptr<int32_t>();
  const int32_t *qfp = qform.data_ptr<int32_t>(), *cnp = cn.data_ptr<int32_t>(), *xp = xpage.data_ptr<int32_t>();
  const int64_t dts = dtable.stride(0), qts = qtable.stride(0), cts = ctable.stride(0);
  const int64_t ekts = ektable.stride(0), evts = evtable.stride(0);
  const int64_t ekw = ektable.size(1), evw = evtable.size(1);
  auto page_ok = [&](int64_t p, int64_t i, const char* what) {
    TORCH_CHECK(p >= 0 && p < npages, "stream ", i, ": ", what, " page ", p, " outside the arena's ", npages);
  };

  // tasks: per stream its quant runs, coded runs, dense runs
  const int64_t db = std::max<int64_t>(1, task_rows / R), cb = std::max<int64_t>(1, task_rows / M);
  std::vector<int64_t> first(G + 1, 0), qtasks(G), ctasks(G), kbs(G, 1);
  int64_t width = 1;
  for (int64_t i = 0; i < G; ++i) {
    const int64_t f = qfp[i];
    TORCH_CHECK(f >= 0 && f < F, "stream ", i, ": quant form ", f, " not in the form table's ", F);
    const int64_t pages = f ? (int64_t)qnp[i] : 0;
    TORCH_CHECK(pages >= 0 && pages <= qtable.size(1), "stream ", i, ": ", pages, " quant pages, table width ",
                qtable.size(1));
    for (int64_t j = 0; j < pages; ++j) page_ok(qt[i * qts + j], i, "quant");
    if (pages && xp[i] >= 0) {
      page_ok(xp[i], i, "skip");
      TORCH_CHECK(pages * fd[f].g <= 8 * page_bytes, "stream ", i, ": ", pages * fd[f].g,
                  " quant rows past a skip page");
    }
    const int64_t g = f ? fd[f].g : 1;
    kbs[i] = std::max<int64_t>(1, task_rows / g);
    qtasks[i] = (pages + kbs[i] - 1) / kbs[i];
    if (qtasks[i]) width = std::max(width, kbs[i] * g);
    const int64_t c = cnp[i], cpages = (c + M - 1) / M;
    TORCH_CHECK(c >= 0 && cpages <= ctable.size(1), "stream ", i, ": ", c, " coded rows, table width ", ctable.size(1));
    for (int64_t j = 0; j < cpages; ++j) page_ok(ct[i * cts + j], i, "coded");
    ctasks[i] = (cpages + cb - 1) / cb;
    if (ctasks[i]) width = std::max(width, cb * M);
    TORCH_CHECK(ds[i] >= 0 && de[i] >= ds[i] && (de[i] + R - 1) / R <= dtable.size(1), "stream ", i,
                ": dense rows [", ds[i], ", ", de[i], ") with table width ", dtable.size(1));
    const int64_t blocks = de[i] > ds[i] ? (de[i] + R - 1) / R - ds[i] / R : 0;
    for (int64_t j = 0; j < blocks; ++j) page_ok(dt[i * dts + ds[i] / R + j], i, "dense");
    if (blocks) width = std::max(width, db * R);
    first[i + 1] = first[i] + qtasks[i] + ctasks[i] + (blocks + db - 1) / db;
  }
  const int64_t tasks = first[G];
  auto qs = (q * scaling).contiguous();
  auto out = torch::empty({G, h, D}, q.options());
  auto lse = torch::empty({G, h}, q.options());
  std::vector<float> mx(tasks * h), sm(tasks * h), acc(tasks * h * D);
  const float* qp = qs.data_ptr<float>();
  const float *cosp = cos.data_ptr<float>(), *sinp = sin.data_ptr<float>();
  const uint8_t* base = arena.data_ptr<uint8_t>();
  DenseFns df[DENSE_CHUNK + 1];
  for (int c = 1; c <= DENSE_CHUNK; ++c) df[c] = pick_dense(c, D);

  // a task's dense pages as segments (out [db]) -> how many (0: not a dense task, or none)
  auto dense_segs = [&](int64_t task, DenseSeg* out) -> int64_t {
    if (task >= tasks) return 0;
    const int64_t i = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
    const int64_t b = task - first[i] - qtasks[i] - ctasks[i];
    if (b < 0) return 0;
    const int64_t b0 = ds[i] / R + b * db;                 // whole dense pages [b0, b1), rows from ds on
    const int64_t b1 = std::min<int64_t>((de[i] + R - 1) / R, b0 + db);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t lo = std::max<int64_t>(ds[i], blk * R) - blk * R;
      const int64_t rows = std::min<int64_t>(de[i], (blk + 1) * R) - blk * R - lo;
      const uint16_t* pg = reinterpret_cast<const uint16_t*>(base + (int64_t)dt[i * dts + blk] * page_bytes);
      out[blk - b0] = {pg + lo * D, pg + (R + lo) * D, rows};
    }
    return b1 - b0;
  };
  const int64_t fc = task_chunk(D);

  // Each thread takes the next task until none is left, claiming one ahead (`following`) so a
  // dense task's last pages can ask for the next one's first. A task's result is its own slot's,
  // so which thread runs it changes nothing; a thread the host holds back leaves the rest to the
  // other, where fixed shares of the tasks had the other wait for it.
  std::atomic<int64_t> next{0};
  const int64_t teams = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  at::parallel_for(0, teams, 1, [&](int64_t, int64_t) {
    std::vector<float> s(h * width), tmp(h * D), kr(D), vr(D), rot(D);
    std::vector<DenseSeg> segs(db), after(db);
    for (int64_t task = next.fetch_add(1), following = 0; task < tasks; task = following) {
      following = next.fetch_add(1);
      const int64_t i = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      int64_t b = task - first[i];
      const float* qi = qp + i * h * D;
      Partial part{mx.data() + task * h, sm.data() + task * h, acc.data() + task * h * D};
      float* a = part.a;
      if (b < qtasks[i]) {                                   // whole quant pages [j0, j1)
        const FormDesc& f = fd[qfp[i]];
        const int64_t g = f.g, j0 = b * kbs[i], j1 = std::min<int64_t>(qnp[i], j0 + kbs[i]), n = (j1 - j0) * g;
        for (int64_t j = j0; j < j1; ++j)
          quant_scores_page(f, qi, base + (int64_t)qt[i * qts + j] * page_bytes, h, D, s.data() + (j - j0) * g, width);
        if (xp[i] >= 0) {                                    // rows the skip page marks: seen by none
          const uint8_t* xb = base + (int64_t)xp[i] * page_bytes;
          for (int64_t t = 0; t < n; ++t) {
            const int64_t r = j0 * g + t;
            if ((xb[r >> 3] >> (r & 7)) & 1)
              for (int64_t j = 0; j < h; ++j) s[j * width + t] = -INFINITY;
          }
        }
        softmax_rows(s.data(), h, n, width, part.m, part.z);
        std::fill(a, a + h * D, 0.f);
        for (int64_t j = j0; j < j1; ++j) {
          quant_values_page(f, s.data() + (j - j0) * g, base + (int64_t)qt[i * qts + j] * page_bytes, h, D,
                            tmp.data(), width);
          for (int64_t e = 0; e < h * D; ++e) a[e] += tmp[e];
        }
        continue;
      }
      b -= qtasks[i];
      if (b < ctasks[i]) {                                   // coded rows [r0, r1): whole coded pages
        const int64_t r0 = b * cb * M, r1 = std::min<int64_t>(cnp[i], r0 + cb * M), n = r1 - r0;
        for (int64_t r = r0; r < r1; ++r) {
          const uint8_t* pg = base + (int64_t)ct[i * cts + r / M] * page_bytes;
          const int64_t slot = r % M, col = r - r0;
          const int32_t rk = load_i32(pg + cd.ref_k + 4 * slot);
          if (rk < 0) {                                      // no row
            for (int64_t j = 0; j < h; ++j) s[j * width + col] = -INFINITY;
            continue;
          }
          TORCH_CHECK(rk / E < ekw, "stream ", i, ": coded row ", r, " names K entry ", rk, " past its table");
          const int64_t ep = ekt[i * ekts + rk / E];
          page_ok(ep, i, "K entry");
          scaled_row(reinterpret_cast<const uint16_t*>(base + ep * page_bytes) + (rk % E) * D,
                     load_half(pg + cd.mag_k + 2 * slot), D, kr.data());
          const int32_t pos = load_i32(pg + cd.pos + 4 * slot);
          if (pos >= 0) {
            TORCH_CHECK(pos < T, "stream ", i, ": coded row ", r, " at position ", pos, " past the RoPE tables' ", T);
            rope_row(kr.data(), cosp + pos * D, sinp + pos * D, D, rot.data());
          }
          const int heads = pg[cd.heads + slot];
          for (int64_t j = 0; j < h; ++j)
            s[j * width + col] = (heads >> (j % group_heads)) & 1 ? dot_row(qi + j * D, kr.data(), D) : -INFINITY;
        }
        softmax_rows(s.data(), h, n, width, part.m, part.z);
        std::fill(a, a + h * D, 0.f);
        for (int64_t r = r0; r < r1; ++r) {
          const uint8_t* pg = base + (int64_t)ct[i * cts + r / M] * page_bytes;
          const int64_t slot = r % M, col = r - r0;
          bool any = false;
          for (int64_t j = 0; j < h && !any; ++j) any = s[j * width + col] != 0.f;
          if (!any) continue;                                // no weight (absent, or masked for every row)
          const int32_t rv = load_i32(pg + cd.ref_v + 4 * slot);
          TORCH_CHECK(rv >= 0 && rv / E < evw, "stream ", i, ": coded row ", r, " names V entry ", rv,
                      " past its table");
          const int64_t ep = evt[i * evts + rv / E];
          page_ok(ep, i, "V entry");
          scaled_row(reinterpret_cast<const uint16_t*>(base + ep * page_bytes) + (rv % E) * D,
                     load_half(pg + cd.mag_v + 2 * slot), D, vr.data());
          for (int64_t j = 0; j < h; ++j) {
            const float w = s[j * width + col];
            if (w != 0.f) axpy_row(w, vr.data(), a + j * D, D);
          }
        }
        continue;
      }
      const int64_t nseg = dense_segs(task, segs.data());   // whole dense pages
      if (fc) {                                              // one pass, fc query rows at a time
        const int64_t nafter = dense_segs(following, after.data());
        for (int64_t j0 = 0; j0 < h; j0 += fc) {
          const int64_t c = std::min<int64_t>(fc, h - j0);
          df[c].task(qi + j0 * D, segs.data(), nseg, after.data(), nafter, part.m + j0, part.z + j0, a + j0 * D);
        }
        continue;
      }
      int64_t n = 0;
      for (int64_t j = 0; j < nseg; ++j) n += segs[j].n;
      dense_scores_rows(df, qi, segs.data(), nseg, h, D, s.data(), width);
      softmax_rows(s.data(), h, n, width, part.m, part.z);
      dense_values_rows(df, s.data(), segs.data(), nseg, h, D, a, width);
    }
  });
  combine_lse(first, h, D, mx, sm, acc, out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

// kernels/cpu_decoder_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w, double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
void write_kv(torch::Tensor rows, torch::Tensor at, torch::Tensor k, torch::Tensor v, int64_t R);
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor arena, torch::Tensor table, torch::Tensor kv_len,
                            torch::Tensor q_start, int64_t page_rows, double scaling);   // cpu_prefill.cpp
bool prefill_tiles(int64_t mode);                                                          // cpu_prefill.cpp
torch::Tensor quant_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<int64_t> bits,
                              std::vector<int64_t> rows, std::vector<int64_t> vgroups, int64_t wq,
                              double scaling);                                             // cpu_quant_attention.cpp
std::tuple<torch::Tensor, torch::Tensor> window_stats(torch::Tensor q, torch::Tensor k, int64_t w, int64_t e,
                                                      double scaling);                     // cpu_statistics.cpp
std::tuple<torch::Tensor, torch::Tensor> segment_sums(torch::Tensor p, torch::Tensor v, torch::Tensor seg, int64_t S);
torch::Tensor mean_angle(torch::Tensor a, torch::Tensor b);
torch::Tensor rank_sets(torch::Tensor ranked, std::vector<int64_t> cuts);
torch::Tensor copy_span(torch::Tensor scores, int64_t span);
torch::Tensor nested_errors(torch::Tensor num, torch::Tensor den, std::vector<int64_t> upto);
bool stats_kernels();
bool segment_kernel();
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor y, torch::Tensor cos, torch::Tensor sin,
                            std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> o,
                            std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                            std::vector<torch::Tensor> ln_in, std::vector<torch::Tensor> ln_post, double eps,
                            int64_t H, int64_t Hk, torch::Tensor rows, torch::Tensor write_at, int64_t R,
                            torch::Tensor arena, std::vector<torch::Tensor> tables, torch::Tensor forms,
                            torch::Tensor rope_cos, torch::Tensor rope_sin, int64_t page_bytes, int64_t coded_rows,
                            int64_t entry_rows, double scaling, int64_t task_rows);       // cpu_decode_step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 or bf16 rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta in place, then RMSNorm of it");
  m.def("rope_", &rope_, "RoPE on fp32 or bf16 rows in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("write_kv", &write_kv, "a step's K/V rows into the pool's fp16 rows");
  m.def("paged_prefill", &paged_prefill, "causal prefill attention of packed segments over the pool's pages");
  m.def("prefill_tiles", &prefill_tiles, "bf16 prefill on AMX tiles: -1 where the CPU has them, 0 never -> taken?");
  m.def("quant_attention", &quant_attention, "last queries' attention over K/V quantized on the fly, per width");
  m.def("window_stats", &window_stats, "the window's attention summed per query head, and the loss rows'");
  m.def("segment_sums", &segment_sums, "the loss queries' p·v and p summed over disjoint sets of rows");
  m.def("mean_angle", &mean_angle, "mean arccos(cos)/pi between the same rows of two tensors");
  m.def("nested_errors", &nested_errors, "each kept share's output error against every set's, relative");
  m.def("copy_span", &copy_span, "each token's peak over itself and the span before it, ties behind it lowered");
  m.def("rank_sets", &rank_sets, "each row's set from its rank by score, cut at the given ranks");
  m.def("stats_kernels", &stats_kernels, "whether window_stats, segment_sums and mean_angle are built here");
  m.def("segment_kernel", &segment_kernel, "whether segment_sums is built here (AVX-512 or AVX2)");
  m.def("dequantized_forms", &dequantized_forms, "quantization and back at several bit widths, one pass");
  m.def("quantize_pack", &quantize_pack, "min/max quantization and packing of groups along a row");
  m.def("decode_layers", &decode_layers, "a decode step's decoder layers in one call (GIL released)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_mixed", &paged_decode_mixed,
        "decode attention over every stream of a layer in the paged pool, whatever its storage forms");
}
