// The two attention passes of the statistics a plan is made from (kvcore/statistics.py), gathered
// inside the executor's prefill at the context's last chunk of every layer; launchers and torch
// references in kernels/window_stats.py.
//
// window_stats: the last w queries of every query head against the whole context, causal inside the
//   window -> the window's attention summed over its w rows (the window scores) and the last e rows'
//   probabilities (the loss queries'), never the [w, T] probabilities of a head in memory past the
//   task that makes them. K is transposed once per call into 16-key columns ([D, T] fp32), so a
//   block of 4 query rows against 64 keys is 4 × 4 vector accumulators fed by one broadcast per
//   channel (no horizontal sums).
// segment_sums: the loss queries' attention over disjoint sets of context rows at once -> per set,
//   the sum of p·v and of p: one pass over the rows, each row's p·v added to its set's accumulators
//   (`kvcore.statistics.layer_losses`' nested kept sets are prefix sums of these).
//
// nested_errors: from those sums, each kept share's output (the sets up to its own, p·v over p) against
//   the exact one (every set's p·v), the squared error summed and relative: one pass, no [G, S, Q, D]
//   prefix tensors (their ~10 small torch ops were a tenth of a layer's statistics).
//
// copy_span: the copy span's causal max filter (kvcore.scoring.spread), a row's window at a time.
//
// rank_sets: each context row's kept set from its ranking score: rows ordered by score, highest
//   first (ties: the earlier row first), cut at the given ranks; each cut found by nth_element over
//   what the cuts before it left (no full sort: a 4k row's sets in a tenth of torch's argsort).
//
// mean_angle: the mean angular distance arccos(cos)/π between the same rows of two tensors (a
//   token's keys in two layers), norms and dot products in one pass over both.
//
// fp32 math throughout (q, k, v may be fp32 or bf16: they are widened as read). AVX-512 where the
// compiler targets it; other hosts take the torch references (`stats_kernels()` says which), except
// segment_sums, which has an 8-lane AVX2 path too (`segment_kernel()`): its torch reference masks the
// probabilities once per set, S times the work, and was half an AVX2 host's statistics.
//
// Shapes: G KV heads; gq query heads a KV head; w window rows, e <= w loss rows; T context rows; D
// head dim; Q query rows a KV head (segment_sums); S sets.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace {

using kvplan::to_f;

#ifdef KVPLAN_AVX512
constexpr int64_t KB = 64;          // keys a block: 4 vectors of 16

// kb [D, KB] a block of keys transposed -> L rows (stride Tp) for ROWS query rows qs [ROWS, D] (already
// scaled), keys t0 .. t0 + 16·nv
template <int ROWS>
inline void block_scores(const float* qs, int64_t D, const float* kb, int64_t Tp, int64_t t0, int nv, float* L) {
  __m512 acc[ROWS][4];
  for (int x = 0; x < ROWS; ++x)
    for (int v = 0; v < 4; ++v) acc[x][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[4];
    for (int v = 0; v < 4; ++v) k[v] = kvplan::in_register(_mm512_loadu_ps(kb + d * KB + 16 * v));
    for (int x = 0; x < ROWS; ++x) {
      const __m512 b = _mm512_set1_ps(qs[x * D + d]);
      for (int v = 0; v < 4; ++v) acc[x][v] = _mm512_fmadd_ps(b, k[v], acc[x][v]);
    }
  }
  for (int x = 0; x < ROWS; ++x)
    for (int v = 0; v < nv; ++v) _mm512_storeu_ps(L + x * Tp + t0 + 16 * v, acc[x][v]);
}

// kT [Tp / KB rounded up, D, KB] the keys in transposed blocks -> L rows (stride Tp) for ROWS query rows
template <int ROWS>
inline void rows_scores(const float* qs, int64_t D, const float* kT, int64_t Tp, float* L) {
  for (int64_t t0 = 0; t0 < Tp; t0 += KB)
    block_scores<ROWS>(qs, D, kT + t0 * D, Tp, t0, (int)std::min<int64_t>(4, (Tp - t0) / 16), L);
}

// one row's n valid logits l [Tp] -> probabilities (zero from n on), added to s [T]; written to
// last [T] too where given. Each exponential is made once: l holds them after the sum's pass.
inline void row_probs(float* l, int64_t n, int64_t T, float* s, float* last) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, l + t));
  }
  const __m512 mb = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
    const __m512 ex = _mm512_maskz_mov_ps(m, kvplan::exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, l + t), mb)));
    _mm512_mask_storeu_ps(l + t, m, ex);
    sum = _mm512_add_ps(sum, ex);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
    const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, l + t), inv);
    _mm512_mask_storeu_ps(s + t, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, s + t), p));
    if (last) _mm512_mask_storeu_ps(last + t, m, p);
  }
  if (last) std::fill(last + n, last + T, 0.f);
}
#endif

void check(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim && t.is_contiguous() && !t.is_cuda(), name, " must be a contiguous CPU ", dim, "-d tensor");
}

// a thread's scratch buffer `which`, at least n floats: kept between calls (a fresh one each call
// was page faults on every call, ~1 ms of a layer's 4)
std::vector<float>& scratch(int which, int64_t n) {
  thread_local std::vector<float> bufs[3];
  if ((int64_t)bufs[which].size() < n) bufs[which].resize(n);
  return bufs[which];
}

}  // namespace

bool segment_kernel() {
#if defined(KVPLAN_AVX512) || defined(KVPLAN_AVX2)
  return true;
#else
  return false;
#endif
}

bool stats_kernels() {
#ifdef KVPLAN_AVX512
  return true;
#else
  return false;
#endif
}

// num [G, S, Q, D], den [G, S, Q] fp32 per-set sums (segment_sums) and upto [F] set indices -> [F] fp32:
// share f's output o_f = (num over sets 0..upto[f]) / (den over them), against e = num over every set:
// sum (o_f - e)^2 / sum e^2 over G, Q, D (prefix sums in set order, fp32; the squares summed in fp64).
// Any host.
torch::Tensor nested_errors(torch::Tensor num, torch::Tensor den, std::vector<int64_t> upto) {
  TORCH_CHECK(num.dim() == 4 && den.dim() == 3 && num.is_contiguous() && den.is_contiguous() && !num.is_cuda() &&
                  !den.is_cuda() && num.scalar_type() == torch::kFloat && den.scalar_type() == torch::kFloat,
              "num, den must be contiguous CPU fp32 [G, S, Q, D] and [G, S, Q]");
  const int64_t G = num.size(0), S = num.size(1), Q = num.size(2), D = num.size(3), F = upto.size();
  TORCH_CHECK(den.size(0) == G && den.size(1) == S && den.size(2) == Q, "den must be num's [G, S, Q]");
  for (const int64_t u : upto) TORCH_CHECK(u >= 0 && u < S, "upto must be set indices in 0..", S - 1);
  std::vector<double> err(F, 0.0);
  double norm = 0.0;
  const float *np = num.data_ptr<float>(), *dp = den.data_ptr<float>();
  std::vector<float> pre(S * D), pden(S), exact(D);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t q = 0; q < Q; ++q) {
      for (int64_t s = 0; s < S; ++s) {                        // prefix sums over the sets, in order
        const float* row = np + ((g * S + s) * Q + q) * D;
        for (int64_t d = 0; d < D; ++d) pre[s * D + d] = (s ? pre[(s - 1) * D + d] : 0.f) + row[d];
        pden[s] = (s ? pden[s - 1] : 0.f) + dp[(g * S + s) * Q + q];
      }
      for (int64_t d = 0; d < D; ++d) {
        exact[d] = pre[(S - 1) * D + d];
        norm += (double)exact[d] * exact[d];
      }
      for (int64_t f = 0; f < F; ++f) {
        const float dn = std::max(pden[upto[f]], 1e-30f);
        double e = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          const float diff = pre[upto[f] * D + d] / dn - exact[d];
          e += (double)diff * diff;
        }
        err[f] += e;
      }
    }
  auto out = torch::empty({F}, num.options());
  float* op = out.data_ptr<float>();
  for (int64_t f = 0; f < F; ++f) op[f] = (float)(err[f] / std::max(norm, 1e-30));
  return out;
}

// scores [H, T] fp32 -> [H, T]: each token's peak, the highest of itself and the span tokens before it, the
// first such token's distance behind subtracted as behind · 2^-20 · |peak| (kvcore.scoring.spread, bit for
// bit: the product and the difference rounded apart, never fused). Any host.
__attribute__((optimize("fp-contract=off"))) torch::Tensor copy_span(torch::Tensor scores, int64_t span) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous() && !scores.is_cuda() && scores.scalar_type() == torch::kFloat,
              "scores must be a contiguous CPU fp32 [H, T] tensor");
  TORCH_CHECK(span >= 0, "span must be >= 0");
  const int64_t H = scores.size(0), T = scores.size(1);
  auto out = torch::empty_like(scores);
  const float* x = scores.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float step = std::ldexp(1.f, -20);
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      const float* r = x + h * T;
      for (int64_t t = 0; t < T; ++t) {
        int64_t at = std::max<int64_t>(0, t - span);
        for (int64_t j = at + 1; j <= t; ++j)
          if (r[j] > r[at]) at = j;                             // the first of equal peaks
        const float peak = r[at], behind = (float)(t - at) * step;
        o[h * T + t] = std::isfinite(peak) ? peak - behind * std::fabs(peak) : peak;
      }
    }
  });
  return out;
}

// ranked [G, n] fp32 (finite) and cuts (ascending, within 0..n) -> [G, n] int32: 1 + how many cuts are
// <= the row's rank (rank 0: the highest score; equal scores: the lower index first), i.e. set 1 for
// ranks below cuts[0], set 2 up to cuts[1], ..., set C + 1 from cuts[C - 1] on. Any host.
torch::Tensor rank_sets(torch::Tensor ranked, std::vector<int64_t> cuts) {
  TORCH_CHECK(ranked.dim() == 2 && ranked.is_contiguous() && !ranked.is_cuda() && ranked.scalar_type() == torch::kFloat,
              "ranked must be a contiguous CPU fp32 [G, n] tensor");
  const int64_t G = ranked.size(0), n = ranked.size(1);
  for (size_t i = 0; i < cuts.size(); ++i)
    TORCH_CHECK(cuts[i] >= 0 && cuts[i] <= n && (i == 0 || cuts[i] >= cuts[i - 1]),
                "cuts must be ascending within 0..", n);
  auto out = torch::empty({G, n}, ranked.options().dtype(torch::kInt));
  const float* rp = ranked.data_ptr<float>();
  int32_t* op = out.data_ptr<int32_t>();
  at::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> idx(n);
    for (int64_t g = begin; g < end; ++g) {
      const float* x = rp + g * n;
      int32_t* o = op + g * n;
      for (int64_t i = 0; i < n; ++i) idx[i] = (int32_t)i;
      const auto before = [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
      int64_t lo = 0;
      for (size_t c = 0; c <= cuts.size(); ++c) {         // set c + 1: ranks lo .. cut
        const int64_t hi = c < cuts.size() ? cuts[c] : n;
        if (hi > lo && hi < n) std::nth_element(idx.begin() + lo, idx.begin() + hi, idx.end(), before);
        for (int64_t i = lo; i < hi; ++i) o[idx[i]] = (int32_t)(c + 1);
        lo = std::max(lo, hi);
      }
    }
  });
  return out;
}

// q [G, gq·w, D] the window's queries (query head j of KV head g: rows j·w .. j·w + w - 1, the last at
// position T - 1), k [G, T, D] (fp32 or bf16, alike) -> s [G, gq, T] the probabilities each head's w
// rows pay each key, summed; last [G, gq·e, T] the last e rows' probabilities (head-major), fp32
std::tuple<torch::Tensor, torch::Tensor> window_stats(torch::Tensor q, torch::Tensor k, int64_t w, int64_t e,
                                                      double scaling) {
  TORCH_CHECK(stats_kernels(), "window_stats: built without AVX-512 (use the torch reference)");
  check(q, "q", 3);
  check(k, "k", 3);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() &&
                  (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16),
              "q, k must be fp32 or bf16 alike");
  const int64_t G = k.size(0), T = k.size(1), D = k.size(2), R = q.size(1);
  TORCH_CHECK(q.size(0) == G && q.size(2) == D, "q must be [G, gq*w, D] like k's G and D");
  TORCH_CHECK(w >= 1 && w <= T && R % w == 0 && e >= 0 && e <= w, "w in 1..T dividing q's rows, e in 0..w");
  const int64_t gq = R / w, Tp = (T + 15) / 16 * 16;
  auto s = torch::zeros({G, gq, T}, q.options().dtype(torch::kFloat));
  auto last = torch::empty({G, gq * e, T}, s.options());
#ifdef KVPLAN_AVX512
  const int64_t nb = (T + KB - 1) / KB;
  std::vector<float>& kT = scratch(0, G * nb * D * KB);          // [G, nb, D, KB] blocks of keys transposed, zero past T
  const bool bf = k.scalar_type() == torch::kBFloat16;
  const void* kp = k.data_ptr();
  at::parallel_for(0, G * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / nb, t0 = task % nb * KB, n = std::min<int64_t>(KB, T - t0);
      float* dst = kT.data() + task * D * KB;
      if (n < KB) std::fill(dst, dst + D * KB, 0.f);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t at = (g * T + t0 + r) * D;
        for (int64_t d = 0; d < D; ++d)
          dst[d * KB + r] = bf ? to_f(static_cast<const kvplan::bf16*>(kp)[at + d]) : static_cast<const float*>(kp)[at + d];
      }
    }
  });
  const void* qp = q.data_ptr();
  float *sp = s.data_ptr<float>(), *lp = last.data_ptr<float>();
  // a task: one query head's half of the window rows (G·gq heads were 9 tasks for 2 threads: one took 5),
  // each half's sum in its own rows (the second half's in `part`), added after
  const int64_t hw = (w + 1) / 2;
  std::vector<float> part(G * gq * T, 0.f);
  at::parallel_for(0, G * gq * 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float>& L = scratch(1, hw * Tp);
    std::vector<float>& qs = scratch(2, hw * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / 2, g = head / gq, j = head % gq, r0 = task % 2 * hw, nr = std::min(hw, w - r0);
      const int64_t q0 = (g * R + j * w + r0) * D;
      for (int64_t i = 0; i < nr * D; ++i)
        qs[i] = (bf ? to_f(static_cast<const kvplan::bf16*>(qp)[q0 + i]) : static_cast<const float*>(qp)[q0 + i]) *
                (float)scaling;
      const float* kg = kT.data() + g * nb * D * KB;
      int64_t x = 0;
      for (; x + 4 <= nr; x += 4) rows_scores<4>(qs.data() + x * D, D, kg, Tp, L.data() + x * Tp);
      for (; x < nr; ++x) rows_scores<1>(qs.data() + x * D, D, kg, Tp, L.data() + x * Tp);
      float* srow = (r0 ? part.data() : sp) + head * T;
      for (int64_t x2 = 0; x2 < nr; ++x2) {
        const int64_t i = r0 + x2, n = T - w + i + 1;           // window row i sees keys up to its own position
        float* lrow = i >= w - e ? lp + (head * e + i - (w - e)) * T : nullptr;
        row_probs(L.data() + x2 * Tp, n, T, srow, lrow);
      }
    }
  });
  at::parallel_for(0, G * gq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * T; i < end * T; ++i) sp[i] += part[i];
  });
#endif
  return {s, last};
}

#if defined(KVPLAN_AVX512) || defined(KVPLAN_AVX2)
namespace {
#ifdef KVPLAN_AVX512
struct Lanes16 {                    // one AVX-512 register of floats
  using V = __m512;
  static constexpr int N = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  template <class T> static V load(const T* p) { return kvplan::load16(p); }   // fp32 or bf16 (widened)
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
};
#else
struct Lanes8 {                     // one AVX2 register of floats
  using V = __m256;
  static constexpr int N = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  template <class T> static V load(const T* p) { return kvplan::load8(p); }    // fp32 or bf16 (widened)
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
};
#endif

// segment_sums' pass: a task is QB query rows of one KV head; per set, its rows' p·v are added into
// QB × 4 registers of L::N lanes, 4·L::N channels of D at a time (AVX-512: the whole row at once; AVX2:
// half, so the 8 sums, the 4 loaded channels and the 2 broadcasts stay in the 16 registers)
template <class L, int64_t QB>
void segment_pass(const torch::Tensor& p, const torch::Tensor& v, torch::Tensor& num, torch::Tensor& den,
                  const std::vector<int64_t>& start, const std::vector<int64_t>& rows, int64_t S) {
  constexpr int64_t DH = 4 * L::N;
  const int64_t G = p.size(0), Q = p.size(1), T = p.size(2), D = v.size(2);
  const int64_t nq = (Q + QB - 1) / QB;
  const float* pp = p.data_ptr<float>();
  const bool bf = v.scalar_type() == torch::kBFloat16;
  const void* vp = v.data_ptr();
  float *np_ = num.data_ptr<float>(), *dp = den.data_ptr<float>();
  at::parallel_for(0, G * nq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / nq, x0 = task % nq * QB, nx = std::min(QB, Q - x0);
      const float* pr[QB];
      for (int64_t x = 0; x < QB; ++x) pr[x] = pp + (g * Q + x0 + std::min(x, nx - 1)) * T;   // past Q: repeats, not stored
      const int64_t* st = start.data() + g * (S + 1);
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t h = 0; h < D; h += DH) {
          typename L::V acc[QB][4];
          float z[QB] = {};
          for (int64_t x = 0; x < QB; ++x)
            for (int c = 0; c < 4; ++c) acc[x][c] = L::zero();
          for (int64_t i = st[s]; i < st[s + 1]; ++i) {
            const int64_t t = rows[g * T + i], o = (g * T + t) * D + h;
            typename L::V vr[4];
            for (int c = 0; c < 4; ++c)
              vr[c] = bf ? L::load(static_cast<const kvplan::bf16*>(vp) + o + L::N * c)
                         : L::load(static_cast<const float*>(vp) + o + L::N * c);
            for (int64_t x = 0; x < QB; ++x) {
              const float pv = pr[x][t];
              z[x] += pv;
              const typename L::V b = L::set1(pv);
              for (int c = 0; c < 4; ++c) acc[x][c] = L::fma(b, vr[c], acc[x][c]);
            }
          }
          for (int64_t x = 0; x < nx; ++x) {
            for (int c = 0; c < 4; ++c) L::store(np_ + ((g * S + s) * Q + x0 + x) * D + h + L::N * c, acc[x][c]);
            if (h == 0) dp[(g * S + s) * Q + x0 + x] = z[x];
          }
        }
      }
    }
  });
}
}  // namespace
#endif

// p [G, Q, T] fp32 probabilities, v [G, T, D] (fp32 or bf16), seg [G, T] int32 each row's set (0 ..
// S - 1; -1: none) -> num [G, S, Q, D] the sum of p·v over each set's rows, den [G, S, Q] of p, fp32.
// Each KV head's rows are listed set by set (in row order), then summed by `segment_pass`.
std::tuple<torch::Tensor, torch::Tensor> segment_sums(torch::Tensor p, torch::Tensor v, torch::Tensor seg, int64_t S) {
  TORCH_CHECK(segment_kernel(), "segment_sums: built without AVX-512 or AVX2 (use the torch reference)");
  check(p, "p", 3);
  check(v, "v", 3);
  check(seg, "seg", 2);
  TORCH_CHECK(p.scalar_type() == torch::kFloat, "p must be fp32");
  TORCH_CHECK(v.scalar_type() == torch::kFloat || v.scalar_type() == torch::kBFloat16, "v must be fp32 or bf16");
  TORCH_CHECK(seg.scalar_type() == torch::kInt, "seg must be int32");
  const int64_t G = p.size(0), Q = p.size(1), T = p.size(2), D = v.size(2);
  TORCH_CHECK(v.size(0) == G && v.size(1) == T && seg.size(0) == G && seg.size(1) == T, "v [G, T, D], seg [G, T] like p");
  TORCH_CHECK(S >= 1 && D == 64, "S >= 1, D = 64");
  const int* sg = seg.data_ptr<int>();
  std::vector<int64_t> start(G * (S + 1), 0), rows(G * T);      // each head's rows, set by set
  for (int64_t g = 0; g < G; ++g) {
    int64_t* st = start.data() + g * (S + 1);
    for (int64_t t = 0; t < T; ++t) {
      const int s = sg[g * T + t];
      TORCH_CHECK(s >= -1 && s < S, "seg: set ", s, " is not in -1 .. S - 1 = ", S - 1);
      if (s >= 0) ++st[s + 1];
    }
    for (int64_t s = 0; s < S; ++s) st[s + 1] += st[s];
    std::vector<int64_t> at(st, st + S);
    for (int64_t t = 0; t < T; ++t)
      if (sg[g * T + t] >= 0) rows[g * T + at[sg[g * T + t]]++] = t;
  }
  auto num = torch::zeros({G, S, Q, D}, p.options());
  auto den = torch::zeros({G, S, Q}, p.options());
#ifdef KVPLAN_AVX512
  segment_pass<Lanes16, 4>(p, v, num, den, start, rows, S);      // 4 query rows a task, a whole row of D
#elif defined(KVPLAN_AVX2)
  segment_pass<Lanes8, 2>(p, v, num, den, start, rows, S);       // 2 query rows a task, 32 channels at a time
#endif
  return {num, den};
}

// a, b [N, D] (fp32 or bf16, alike) -> the mean over rows of arccos(a·b / (|a| |b|)) / π, a 0-d fp32
// tensor (the cosine clamped to [-1, 1]; norms below 1e-8 in product count as 1e-8)
torch::Tensor mean_angle(torch::Tensor a, torch::Tensor b) {
  TORCH_CHECK(stats_kernels(), "mean_angle: built without AVX-512 (use the torch reference)");
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && a.is_contiguous() && b.is_contiguous() &&
                  !a.is_cuda() && (a.scalar_type() == torch::kFloat || a.scalar_type() == torch::kBFloat16) &&
                  a.dim() >= 1,
              "a, b must be contiguous CPU fp32 or bf16 tensors alike");
  const int64_t D = a.size(-1), N = D ? a.numel() / D : 0;
  TORCH_CHECK(D % 16 == 0 && D > 0, "the rows' length must be a multiple of 16");
  auto out = torch::zeros({}, a.options().dtype(torch::kFloat));
  if (N == 0) return out.fill_(NAN);
#ifdef KVPLAN_AVX512
  const bool bf = a.scalar_type() == torch::kBFloat16;
  const void *ap = a.data_ptr(), *bp = b.data_ptr();
  const int64_t chunks = (N + 255) / 256;
  std::vector<double> part(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double sum = 0.0;
      for (int64_t r = c * 256; r < std::min(N, (c + 1) * 256); ++r) {
        __m512 aa = _mm512_setzero_ps(), bb = _mm512_setzero_ps(), ab = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 x = bf ? kvplan::load16(static_cast<const kvplan::bf16*>(ap) + r * D + d)
                              : _mm512_loadu_ps(static_cast<const float*>(ap) + r * D + d);
          const __m512 y = bf ? kvplan::load16(static_cast<const kvplan::bf16*>(bp) + r * D + d)
                              : _mm512_loadu_ps(static_cast<const float*>(bp) + r * D + d);
          aa = _mm512_fmadd_ps(x, x, aa);
          bb = _mm512_fmadd_ps(y, y, bb);
          ab = _mm512_fmadd_ps(x, y, ab);
        }
        const float na = std::sqrt(_mm512_reduce_add_ps(aa)), nb = std::sqrt(_mm512_reduce_add_ps(bb));
        const float cs = std::min(1.f, std::max(-1.f, _mm512_reduce_add_ps(ab) / std::max(na * nb, 1e-8f)));
        sum += std::acos(cs);
      }
      part[c] = sum;
    }
  });
  double total = 0.0;
  for (const double x : part) total += x;                       // chunks in order: the same sum at any thread count
  out.fill_(total / (double)N / M_PI);
#endif
  return out;
}
