// The decoder's small per-row ops on the CPU (and the step's K/V rows written into the pool), each
// one pass over its rows instead of the six to eight torch ops (and as many full-size temporaries)
// each composes to: RMSNorm (optionally adding a residual first, in place), RoPE on queries and
// keys in place, SiLU(gate) * up. At a decode step these rows are few (one per sequence) and the
// ops' dispatch, not their arithmetic, was the cost: ~60 torch ops a layer.
//
// Rows in the compute dtype, fp32 or bf16 (`T`), contiguous; the math in fp32 (sums of squares,
// products), each result rounded once to T (torch's bf16 modules round after every op: results
// differ from theirs by a bf16 rounding step at most). AVX-512 16 floats at a time where the host
// has it (kernels/cpu_vec.h), scalar loops of the same math elsewhere and for tails. Launchers and
// torch references: kernels/decoder_ops.py, kernels/kv_write.py. Compiled into the same extension
// as cpu_decode.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

#include "cpu_vec.h"

using kvplan::bf16;
using kvplan::from_f;
using kvplan::to_f;

namespace {

// sum of x[i]^2 over H values, in fp32
template <typename T>
inline float sum_squares(const T* x, int64_t H) {
  int64_t i = 0;
  float ss = 0.f;
#ifdef KVPLAN_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= H; i += 16) {
    const __m512 v = kvplan::load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; i < H; ++i) ss += to_f(x[i]) * to_f(x[i]);
  return ss;
}

// y = w * (x / sqrt(mean(x^2) + eps))
template <typename T>
inline void norm_row(const T* x, const T* w, T* y, int64_t H, float eps) {
  const float r = 1.f / std::sqrt(sum_squares(x, H) / (float)H + eps);
  int64_t i = 0;
#ifdef KVPLAN_AVX512
  const __m512 rv = _mm512_set1_ps(r);
  for (; i + 16 <= H; i += 16)
    kvplan::store16(y + i, _mm512_mul_ps(kvplan::load16(w + i), _mm512_mul_ps(kvplan::load16(x + i), rv)));
#endif
  for (; i < H; ++i) y[i] = from_f<T>(to_f(w[i]) * (to_f(x[i]) * r));
}

// r += d, rounded to T
template <typename T>
inline void add_row(T* r, const T* d, int64_t H) {
  int64_t i = 0;
#ifdef KVPLAN_AVX512
  for (; i + 16 <= H; i += 16) kvplan::store16(r + i, _mm512_add_ps(kvplan::load16(r + i), kvplan::load16(d + i)));
#endif
  for (; i < H; ++i) r[i] = from_f<T>(to_f(r[i]) + to_f(d[i]));
}

// f(float{}) or f(bf16{}): the body once per compute dtype
template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  if (t == torch::kFloat) f(float{});
  else f(bf16{});
}

bool compute_dtype(at::ScalarType t) { return t == torch::kFloat || t == torch::kBFloat16; }

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && compute_dtype(x.scalar_type()),
              name, " must be contiguous fp32 or bf16 [N, H]");
}

void check_like(const torch::Tensor& t, const torch::Tensor& x, int64_t n, const char* what) {
  TORCH_CHECK(t.numel() == n && t.is_contiguous() && t.scalar_type() == x.scalar_type(), what);
}

}  // namespace

// x [N, H] fp32 or bf16, w [H] in x's dtype -> y [N, H]: x / sqrt(mean(x^2) + eps) * w (LlamaRMSNorm)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  check_like(w, x, x.size(1), "w must be [H] contiguous, in x's dtype");
  const int64_t N = x.size(0), H = x.size(1);
  auto y = torch::empty_like(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) norm_row(xp + n * H, wp, yp + n * H, H, (float)eps);
    });
  });
  return y;
}

// residual [N, H] += delta [N, H] in place (rounded to its dtype), then -> y = rms_norm(residual) * w
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w, double eps) {
  check_rows(residual, "residual");
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.is_contiguous() && delta.scalar_type() == residual.scalar_type(),
              "delta must be contiguous, like residual");
  check_like(w, residual, residual.size(1), "w must be [H] contiguous, in residual's dtype");
  const int64_t N = residual.size(0), H = residual.size(1);
  auto y = torch::empty_like(residual);
  dispatch(residual.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t *dp = delta.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        add_row(rp + n * H, dp + n * H, H);
        norm_row(rp + n * H, wp, yp + n * H, H, (float)eps);
      }
    });
  });
  return y;
}

namespace {

// one head's row r [D] in place: r * c + rotate_half(r) * s
template <typename T, typename C>
inline void rope_row(T* r, const C* c, const C* s, int64_t half) {
  int64_t i = 0;
#ifdef KVPLAN_AVX512
  for (; i + 16 <= half; i += 16) {
    const __m512 a = kvplan::load16(r + i), bb = kvplan::load16(r + i + half);
    kvplan::store16(r + i, _mm512_fmsub_ps(a, kvplan::load16(c + i), _mm512_mul_ps(bb, kvplan::load16(s + i))));
    kvplan::store16(r + i + half, _mm512_fmadd_ps(bb, kvplan::load16(c + i + half), _mm512_mul_ps(a, kvplan::load16(s + i + half))));
  }
#endif
  for (; i < half; ++i) {
    const float a = to_f(r[i]), bb = to_f(r[i + half]);
    r[i] = from_f<T>(a * to_f(c[i]) - bb * to_f(s[i]));
    r[i + half] = from_f<T>(bb * to_f(c[i + half]) + a * to_f(s[i + half]));
  }
}

template <typename T, typename C>
void rope_rows(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t N = x.size(0), Hh = x.size(1), D = x.size(2), half = D / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  const C *cp = cos.data_ptr<C>(), *sp = sin.data_ptr<C>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n)
      for (int64_t h = 0; h < Hh; ++h) rope_row(xp + n * s0 + h * s1, cp + n * D, sp + n * D, half);
  });
}

}  // namespace

// x [N, heads, D] fp32 or bf16 (rows contiguous within a head) in place: x * cos + rotate_half(x) * sin;
// cos, sin [N, D] fp32 or x's dtype (HF's: the two halves alike)
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const auto t = x.scalar_type(), c = cos.scalar_type();
  TORCH_CHECK(x.dim() == 3 && (t == torch::kFloat || t == torch::kBFloat16) && x.stride(2) == 1,
              "x must be fp32 or bf16 [N, heads, D] with contiguous rows");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
              cos.is_contiguous() && sin.is_contiguous() && sin.scalar_type() == c && (c == torch::kFloat || c == t),
              "cos, sin must be contiguous [N, D], fp32 or x's dtype");
  TORCH_CHECK(x.size(2) % 2 == 0, "x's head dim must be even");
  if (t == torch::kFloat) rope_rows<float, float>(x, cos, sin);
  else if (c == torch::kFloat) rope_rows<bf16, float>(x, cos, sin);
  else rope_rows<bf16, bf16>(x, cos, sin);
}

// gate, up [N, F] fp32 or bf16 -> silu(gate) * up
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.is_contiguous() && up.is_contiguous() &&
              up.scalar_type() == gate.scalar_type() && compute_dtype(gate.scalar_type()),
              "gate, up must be contiguous fp32 or bf16 alike");
  auto out = torch::empty_like(gate);
  const int64_t n = gate.numel();
  dispatch(gate.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *g = gate.data_ptr<scalar_t>(), *u = up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) {
      int64_t i = b;
#ifdef KVPLAN_AVX512
      for (; i + 16 <= e; i += 16) {            // silu(x) = x / (1 + e^-x), e^-x as e^-|x| (x >= 0) or its inverse
        const __m512 x = kvplan::load16(g + i);
        const __m512 en = kvplan::exp_neg16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));    // e^-|x|
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 one = _mm512_set1_ps(1.f);
        const __m512 den = _mm512_mask_div_ps(_mm512_add_ps(one, en), neg, _mm512_add_ps(one, en), en);  // 1 + e^-x
        kvplan::store16(o + i, _mm512_mul_ps(_mm512_div_ps(x, den), kvplan::load16(u + i)));
      }
#endif
      for (; i < e; ++i) {
        const float x = to_f(g[i]);
        o[i] = from_f<scalar_t>(x / (1.f + std::exp(-x)) * to_f(u[i]));
      }
    });
  });
  return out;
}

// A step's new K/V rows into the pool (`kernels/kv_write.py`): rows [n, D] fp16 (the arena's rows
// view), at [M] int64 the K row of each of k, v's M rows ([M, D] fp32 or bf16, rows contiguous):
// rows[at[i]] := k[i] and rows[at[i] + R] := v[i], rounded to fp16 (to nearest even, as Tensor.to(float16))
void write_kv(torch::Tensor rows, torch::Tensor at, torch::Tensor k, torch::Tensor v, int64_t R) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kHalf && rows.is_contiguous(), "rows must be fp16 [n, D]");
  const int64_t D = rows.size(1), M = at.numel();
  TORCH_CHECK(at.scalar_type() == torch::kLong && at.is_contiguous(), "at must be contiguous int64");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && compute_dtype(k.scalar_type()),
              "k, v must be fp32 or bf16 alike");
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == M && t->size(1) == D && t->stride(1) == 1,
                "k, v must be [M, D] with contiguous rows");
  auto* rp = rows.data_ptr<at::Half>();
  const int64_t* ap = at.data_ptr<int64_t>();
  const int64_t n = rows.size(0);
  for (int64_t i = 0; i < M; ++i) TORCH_CHECK(ap[i] >= 0 && ap[i] + R < n, "row ", ap[i], " outside the arena");
  const int64_t ks = k.stride(0), vs = v.stride(0);
  dispatch(k.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        at::Half* kr = rp + ap[i] * D;
        at::Half* vr = rp + (ap[i] + R) * D;
        const scalar_t *ki = kp + i * ks, *vi = vp + i * vs;
        int64_t d = 0;
#ifdef KVPLAN_AVX512
        for (; d + 16 <= D; d += 16) {
          kvplan::store16(kr + d, kvplan::load16(ki + d));
          kvplan::store16(vr + d, kvplan::load16(vi + d));
        }
#endif
        for (; d < D; ++d) {
          kr[d] = at::Half(to_f(ki[d]));
          vr[d] = at::Half(to_f(vi[d]));
        }
      }
    });
  });
}
