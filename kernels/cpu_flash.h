// The fp32 core of a flash-style attention over blocks of KB keys, shared by the CPU kernels that
// attend (kernels/cpu_prefill.cpp: the pool's pages; kernels/cpu_quant_attention.cpp: quantized
// copies made on the fly): scores of a few query rows against a block's keys held transposed
// [D, KB], the online softmax of a row's block, and P·V into fp32 accumulators [Dp] (Dp: D rounded
// up to 16). AVX-512 where the compiler targets it (kernels/cpu_vec.h), 8-lane AVX2 where that is the
// widest, scalar loops elsewhere.
// kernels/cpu_extension.py hashes this header into the build flags.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_vec.h"

namespace kvplan {
namespace flash {

constexpr int64_t KB = 64;        // key rows a block holds: NV 16-lane vectors of scores per query row (the
constexpr int64_t NV = KB / 16;   // softmax's per-row reductions and rescales once per KB keys)

#ifdef KVPLAN_AVX512
// scores of ROWS rows from q (row stride qs floats, already scaled) against kt [D, KB] -> out [ROWS, KB]
template <int ROWS>
inline void scores(const float* q, int64_t qs, const float* kt, int64_t D, float* out) {
  __m512 s[ROWS][NV];
  for (int x = 0; x < ROWS; ++x)
    for (int v = 0; v < NV; ++v) s[x][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = in_register(_mm512_loadu_ps(kt + d * KB + 16 * v));
    for (int x = 0; x < ROWS; ++x) {
      const __m512 b = _mm512_set1_ps(q[x * qs + d]);
      for (int v = 0; v < NV; ++v) s[x][v] = _mm512_fmadd_ps(b, k[v], s[x][v]);
    }
  }
  for (int x = 0; x < ROWS; ++x)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + x * KB + 16 * v, s[x][v]);
}

// acc rows (ROWS of them, stride Dp) = acc * alpha + p · vb over nk rows (p [ROWS, KB], zero past each
// row's keys), for Dp columns, 64 at a time
template <int ROWS>
inline void accumulate(float* acc, int64_t Dp, const float* p, const float* alpha, const float* vb, int64_t nk) {
  for (int64_t c = 0; c < Dp; c += 64) {
    const int nc = (int)std::min<int64_t>(4, (Dp - c) / 16);
    __m512 a[ROWS][4];
    for (int x = 0; x < ROWS; ++x)
      for (int v = 0; v < 4; ++v)
        if (v < nc) a[x][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + x * Dp + c + 16 * v), _mm512_set1_ps(alpha[x]));
    for (int64_t r = 0; r < nk; ++r) {
      const float* vr = vb + r * Dp + c;
      __m512 vv[4];
      for (int v = 0; v < 4; ++v) vv[v] = v < nc ? in_register(_mm512_loadu_ps(vr + 16 * v)) : _mm512_setzero_ps();
      for (int x = 0; x < ROWS; ++x) {
        const __m512 pr = _mm512_set1_ps(p[x * KB + r]);
        for (int v = 0; v < 4; ++v)
          if (v < nc) a[x][v] = _mm512_fmadd_ps(pr, vv[v], a[x][v]);
      }
    }
    for (int x = 0; x < ROWS; ++x)
      for (int v = 0; v < 4; ++v)
        if (v < nc) _mm512_storeu_ps(acc + x * Dp + c + 16 * v, a[x][v]);
  }
}
#elif defined(KVPLAN_AVX2)
// AVX2 (8 lanes, 16 registers): the same math, a row pair against 32 keys at a time (8 accumulators)
template <int ROWS>
inline void scores(const float* q, int64_t qs, const float* kt, int64_t D, float* out) {
  constexpr int P = ROWS % 2 == 0 ? 2 : 1;
  for (int x0 = 0; x0 < ROWS; x0 += P)
    for (int64_t h = 0; h < KB; h += 32) {
      __m256 s[P][4];
      for (int x = 0; x < P; ++x)
        for (int v = 0; v < 4; ++v) s[x][v] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const float* k = kt + d * KB + h;
        for (int x = 0; x < P; ++x) {
          const __m256 b = _mm256_broadcast_ss(q + (x0 + x) * qs + d);
          for (int v = 0; v < 4; ++v) s[x][v] = _mm256_fmadd_ps(b, _mm256_loadu_ps(k + 8 * v), s[x][v]);
        }
      }
      for (int x = 0; x < P; ++x)
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out + (x0 + x) * KB + h + 8 * v, s[x][v]);
    }
}

template <int ROWS>
inline void accumulate(float* acc, int64_t Dp, const float* p, const float* alpha, const float* vb, int64_t nk) {
  for (int64_t c = 0; c < Dp; c += 32) {
    const int nc = (int)std::min<int64_t>(4, (Dp - c) / 8);
    __m256 a[ROWS][4];
    for (int x = 0; x < ROWS; ++x)
      for (int v = 0; v < 4; ++v)
        if (v < nc) a[x][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + x * Dp + c + 8 * v), _mm256_set1_ps(alpha[x]));
    for (int64_t r = 0; r < nk; ++r) {
      const float* vr = vb + r * Dp + c;
      for (int x = 0; x < ROWS; ++x) {
        const __m256 pr = _mm256_broadcast_ss(p + x * KB + r);
        for (int v = 0; v < 4; ++v)
          if (v < nc) a[x][v] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(vr + 8 * v), a[x][v]);
      }
    }
    for (int x = 0; x < ROWS; ++x)
      for (int v = 0; v < 4; ++v)
        if (v < nc) _mm256_storeu_ps(acc + x * Dp + c + 8 * v, a[x][v]);
  }
}
#else
template <int ROWS>
inline void scores(const float* q, int64_t qs, const float* kt, int64_t D, float* out) {
  for (int x = 0; x < ROWS; ++x) {
    float* s = out + x * KB;
    std::fill(s, s + KB, 0.f);
    for (int64_t d = 0; d < D; ++d)
      for (int64_t r = 0; r < KB; ++r) s[r] += q[x * qs + d] * kt[d * KB + r];
  }
}

template <int ROWS>
inline void accumulate(float* acc, int64_t Dp, const float* p, const float* alpha, const float* vb, int64_t nk) {
  for (int x = 0; x < ROWS; ++x)
    for (int64_t c = 0; c < Dp; ++c) {
      float y = acc[x * Dp + c] * alpha[x];
      for (int64_t r = 0; r < nk; ++r) y += p[x * KB + r] * vb[r * Dp + c];
      acc[x * Dp + c] = y;
    }
}
#endif

// a row's KB scores with `seen` keys visible (0 .. KB) -> probabilities in place (0 past `seen`), its
// running max m and sum l updated -> the factor its accumulator must be scaled by first (1: no key seen)
inline float softmax_block(float* s, int64_t seen, float& m, float& l) {
  if (seen <= 0) {
    std::fill(s, s + KB, 0.f);
    return 1.f;
  }
#ifdef KVPLAN_AVX512
  __m512 sv[NV];
  __mmask16 keep[NV];
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int v = 0; v < NV; ++v) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, seen - 16 * v));
    keep[v] = (__mmask16)((1u << n) - 1u);
    sv[v] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), keep[v], s + 16 * v);
    mx = _mm512_max_ps(mx, sv[v]);
  }
  const float mnew = std::max(m, _mm512_reduce_max_ps(mx));
  const __m512 mb = _mm512_set1_ps(mnew);
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < NV; ++v) {
    const __m512 p = _mm512_maskz_mov_ps(keep[v], kvplan::exp_neg16(_mm512_sub_ps(sv[v], mb)));
    _mm512_storeu_ps(s + 16 * v, p);
    sum = _mm512_add_ps(sum, p);
  }
  const float alpha = std::exp(m - mnew);         // m = -inf at the first block: 0 (the accumulator is 0)
  l = l * alpha + _mm512_reduce_add_ps(sum);
#elif defined(KVPLAN_AVX2)
  constexpr int NV8 = KB / 8;
  __m256 sv[NV8], keep[NV8];
  __m256 mx = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int v = 0; v < NV8; ++v) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(8, seen - 8 * v));
    keep[v] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane));
    sv[v] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + 8 * v), keep[v]);
    mx = _mm256_max_ps(mx, sv[v]);
  }
  const float mnew = std::max(m, kvplan::hmax8(mx));
  const __m256 mb = _mm256_set1_ps(mnew);
  __m256 sum = _mm256_setzero_ps();
  for (int v = 0; v < NV8; ++v) {
    const __m256 p = _mm256_and_ps(keep[v], kvplan::exp_neg8(_mm256_sub_ps(sv[v], mb)));
    _mm256_storeu_ps(s + 8 * v, p);
    sum = _mm256_add_ps(sum, p);
  }
  const float alpha = std::exp(m - mnew);
  l = l * alpha + kvplan::hsum8(sum);
#else
  float mnew = m;
  for (int64_t r = 0; r < seen; ++r) mnew = std::max(mnew, s[r]);
  float sum = 0.f;
  for (int64_t r = 0; r < KB; ++r) {
    s[r] = r < seen ? std::exp(s[r] - mnew) : 0.f;
    sum += s[r];
  }
  const float alpha = std::exp(m - mnew);
  l = l * alpha + sum;
#endif
  m = mnew;
  return alpha;
}

}  // namespace flash
}  // namespace kvplan
