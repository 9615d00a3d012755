// 16 floats at a time from and to fp32, bf16 and fp16 memory, for the CPU kernels that take either
// compute dtype (kernels/cpu_decoder_ops.cpp, kernels/cpu_prefill.cpp). AVX-512 where the compiler
// targets it (-march=native on such a host), else scalar (8-lane AVX2 helpers below for the kernels
// that have an AVX2 path): every kernel keeps a scalar loop of the
// same math for its tails and for other hosts. Rounding to bf16 and fp16 is to nearest even, as
// torch's Tensor.to() (bf16 by hand, not VCVTNEPS2BF16, which flushes subnormals), so a kernel's
// rows round as its torch reference's.
//
// Included by the extension's sources; kernels/cpu_extension.py puts this file's hash in the
// build flags, so an edit here rebuilds them (torch hashes sources and flags, not headers).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <cstdint>

namespace kvplan {

using bf16 = c10::BFloat16;
using f16 = c10::Half;

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }
inline float to_f(f16 x) { return static_cast<float>(x); }
template <typename T> inline T from_f(float x) { return T(x); }      // c10's conversions: nearest even

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVPLAN_AVX512 1
// x held in a register from here on: a vector loaded once and used by several FMAs is otherwise folded
// back into each as a memory operand (GCC 12), a load per FMA where the loads, not the FMAs, then bound
// the loop
template <typename V>
inline V in_register(V x) {
  asm("" : "+v"(x));
  return x;
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// 16 floats -> 16 bf16 (nearest even; NaN stays NaN)
inline __m256i bf16_bits(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v)); }
inline void store16(f16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// e^x for x <= 0 (scores minus their max): 2^(x log2 e) as 2^round * 2^frac, 2^frac by its degree-6
// Taylor polynomial of e^(frac ln 2) (|frac| <= 1/2: relative error ~1e-7); x below -87 (-inf
// included) counts as -87: e^-87 ~ 1.6e-38, nothing beside any kept score
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KVPLAN_AVX2 1
// 8 lanes where the host has AVX2 (and F16C, FMA) but not AVX-512: the same math, half as wide
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const bf16* p) {           // exact: a bf16 is an fp32's upper half
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// e^x for x <= 0, as exp_neg16 (2^round * a degree-6 polynomial of 2^frac; x below -87 counts as -87)
inline __m256 exp_neg8(__m256 x) {
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

inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmin8(__m256 x) {
  __m128 s = _mm_min_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_min_ps(s, _mm_movehl_ps(s, s));
  s = _mm_min_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// fp16 rounding of 8 floats at once (nearest even, subnormals kept: c10::Half's)
inline __m256 fp16_round8(__m256 x) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

}  // namespace kvplan
