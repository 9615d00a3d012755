// The decoder's small per-row ops on the CPU (and the step's K/V rows written into the pool), each
// one pass over its rows instead of the six to
// eight torch ops (and as many full-size temporaries) each composes to: RMSNorm (optionally
// adding a residual first, in place), RoPE on queries and keys in place, SiLU(gate) * up. At a
// decode step these rows are few (one per sequence) and the ops' dispatch, not their arithmetic,
// was the cost: ~60 torch ops a layer. fp32 rows, contiguous; launchers and torch references:
// kernels/decoder_ops.py. Compiled into the same extension as cpu_decode.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <cmath>

namespace {

inline void norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / (float)H + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
}

}  // namespace

// x [N, H] fp32, w [H] fp32 -> y [N, H]: x / sqrt(mean(x^2) + eps) * w (LlamaRMSNorm in fp32)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "x must be contiguous fp32 [N, H]");
  TORCH_CHECK(w.numel() == x.size(1) && w.is_contiguous() && w.scalar_type() == torch::kFloat, "w must be fp32 [H]");
  const int64_t N = x.size(0), H = x.size(1);
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) norm_row(xp + n * H, wp, yp + n * H, H, (float)eps);
  });
  return y;
}

// residual [N, H] += delta [N, H] in place, then -> y = rms_norm(residual) * w
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == torch::kFloat,
              "residual must be contiguous fp32 [N, H]");
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.is_contiguous() && delta.scalar_type() == torch::kFloat,
              "delta must be contiguous fp32 like residual");
  TORCH_CHECK(w.numel() == residual.size(1) && w.scalar_type() == torch::kFloat && w.is_contiguous(), "w must be fp32 [H]");
  const int64_t N = residual.size(0), H = residual.size(1);
  auto y = torch::empty_like(residual);
  float* rp = residual.data_ptr<float>();
  const float *dp = delta.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      float* r = rp + n * H;
      const float* d = dp + n * H;
      for (int64_t i = 0; i < H; ++i) r[i] += d[i];
      norm_row(r, wp, yp + n * H, H, (float)eps);
    }
  });
  return y;
}

// x [N, heads, D] fp32 (rows contiguous within a head) in place: x * cos + rotate_half(x) * sin,
// cos, sin [N, D] fp32 (HF's: the two halves alike)
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1, "x must be fp32 [N, heads, D]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
              cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat, "cos, sin must be fp32 [N, D]");
  const int64_t N = x.size(0), Hh = x.size(1), D = x.size(2), half = D / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n)
      for (int64_t h = 0; h < Hh; ++h) {
        float* r = xp + n * s0 + h * s1;
        const float *c = cp + n * D, *s = sp + n * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = r[i], bb = r[i + half];
          r[i] = a * c[i] - bb * s[i];
          r[i + half] = bb * c[i + half] + a * s[i + half];
        }
      }
  });
}

// gate, up [N, F] fp32 -> silu(gate) * up
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.is_contiguous() && up.is_contiguous() &&
              gate.scalar_type() == torch::kFloat && up.scalar_type() == torch::kFloat, "gate, up must be contiguous fp32 alike");
  using Vec = at::vec::Vectorized<float>;
  auto out = torch::empty_like(gate);
  const int64_t n = gate.numel();
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + Vec::size() <= e; i += Vec::size()) {      // SLEEF's vectorized exp (torch's own)
      const Vec x = Vec::loadu(g + i);
      (x / (Vec(1.f) + x.neg().exp()) * Vec::loadu(u + i)).store(o + i);
    }
    for (; i < e; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  });
  return out;
}

// A step's new K/V rows into the pool (`kernels/kv_write.py`): rows [n, D] fp16 (the arena's rows
// view), at [M] int64 the K row of each of k, v's M rows ([M, D] fp32, rows contiguous): rows[at[i]]
// := k[i] and rows[at[i] + R] := v[i], rounded to fp16 (to nearest even, as Tensor.to(float16))
void write_kv(torch::Tensor rows, torch::Tensor at, torch::Tensor k, torch::Tensor v, int64_t R) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kHalf && rows.is_contiguous(), "rows must be fp16 [n, D]");
  const int64_t D = rows.size(1), M = at.numel();
  TORCH_CHECK(at.scalar_type() == torch::kLong && at.is_contiguous(), "at must be contiguous int64");
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->dim() == 2 && t->size(0) == M && t->size(1) == D &&
                t->stride(1) == 1, "k, v must be fp32 [M, D] with contiguous rows");
  uint16_t* rp = reinterpret_cast<uint16_t*>(rows.data_ptr<at::Half>());
  const int64_t* ap = at.data_ptr<int64_t>();
  const int64_t n = rows.size(0);
  for (int64_t i = 0; i < M; ++i) TORCH_CHECK(ap[i] >= 0 && ap[i] + R < n, "row ", ap[i], " outside the arena");
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      uint16_t* kr = rp + ap[i] * D;
      uint16_t* vr = rp + (ap[i] + R) * D;
      for (int64_t d = 0; d < D; ++d) {
        kr[d] = _cvtss_sh(kp[i * ks + d], _MM_FROUND_TO_NEAREST_INT);
        vr[d] = _cvtss_sh(vp[i * vs + d], _MM_FROUND_TO_NEAREST_INT);
      }
    }
  });
}
