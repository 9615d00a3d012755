// Prefill attention over the engine's paged pool on the CPU (`paged_prefill`; launcher and torch
// reference: kernels/paged_prefill.py): a step's query rows of S segments, each attending causally
// to its own streams' dense fp16 rows, read in place from their pages — the context is never
// gathered into a new tensor, and no [n, kv_len] score matrix exists.
//
// Flash-style: a task is (segment, KV head, tile of BQ query positions) with the h_n query heads
// that read that KV head, M = BQ·h_n rows sharing every key block they load; key blocks of KB rows
// (any page size: each row is found through the table) are converted once per task and block —
// K transposed to [D, KB], V to [KB, Dp] — then scores (4 rows × KB keys in registers), an online
// softmax (running max and sum per row, fp32), and P·V into fp32 accumulators (2 rows at a time). Rows past
// a query row's position weigh 0; slots past a stream's last row are never read. Tasks go to
// threads by cost (causal: a late tile sees more keys), longest first, each to the least loaded
// thread, so the split does not depend on where tiles fall in the range; at::parallel_for runs one
// range per thread (torch's thread pool: no second team competes with it). A row's result does not
// depend on the thread count or on the other segments of the call.
//
// Queries fp32, bf16 or fp16, out in q's dtype. fp32 and fp16 queries: fp32 products (queries
// converted once per task). bf16 queries on a CPU with AVX512-BF16: bf16 products summed in fp32 by
// VDPBF16PS (twice the multiply-adds of an fp32 FMA per instruction; see `load_block_bf16`), or where
// the CPU has AMX on its tiles (see `run_task_tiles`: 32 rows × 128 keys a step; 9 heads on 3, D 64:
// 772 GFLOP/s at 512 rows after 1536 stored, 759 at 2000 rows, where oneDNN brgemm calls per 64-key
// block made 328 and 318 and VDPBF16PS 150, on the Xeon with AMX, 2 cores). AVX-512
// where the compiler targets it (kernels/cpu_vec.h), 8-lane AVX2 where that is the widest (the fp32
// core of kernels/cpu_flash.h), a scalar loop of the fp32 math elsewhere.
//
// Shapes: N packed query rows, H query heads, H_kv KV heads, h_n = H / H_kv, D head dim (Dp: D
// rounded up to 16), R rows a page holds, S segments, MB table width.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <sys/syscall.h>
#include <unistd.h>
#include <type_traits>
#include <vector>

#include "cpu_flash.h"
#include "cpu_vec.h"

namespace {

namespace flash = kvplan::flash;

using flash::KB;
using flash::NV;
using flash::accumulate;
using flash::scores;
using flash::softmax_block;
constexpr int64_t BQ = 64;    // query positions a task takes (times h_n query heads)
constexpr int64_t KT2 = 128;  // keys of a block on the tile path: KT2 / KB blocks of `convert_blocks`

struct Task {
  int64_t s, g, j0, nj;       // segment, KV head, first query position (of the segment's n_s), positions
  double cost;                // keys seen, summed over its rows
};

struct Scratch {              // one thread's buffers, sized once per call
  std::vector<float> q, acc, p, kt, vb, m, l;
  std::vector<uint32_t> q2;            // the bf16 path: pairs of bf16 in a 32-bit word (what VDPBF16PS reads)
  std::vector<uint16_t> p2;
  std::vector<uint32_t> tq;             // the tile path (64-byte aligned through `align64`; Mp: M rounded
                                        // up to 32, D2p: D / 2 up to 16): queries [Mp, D2p] bf16 pairs
  std::vector<float> tacc, ts;          // accumulators [Mp, Dp], 32 rows' scores [32, KT2]
  std::vector<uint16_t> tp;             // their probabilities [32, KT2]
  Scratch(int64_t M, int64_t D, int64_t Dp, bool tile)
      : q(M * Dp), acc(M * Dp), p(M * KB), kt(D * KB), vb(KB * Dp), m(M), l(M),
        q2(M * ((D + 1) / 2)), p2(M * KB) {
    if (!tile) return;
    const int64_t Mp = (M + 31) / 32 * 32, D2p = (D + 31) / 32 * 16;
    tq.resize(Mp * D2p + 16);
    tacc.resize(Mp * Dp + 16);
    ts.resize(32 * KT2 + 16);
    tp.resize(32 * KT2 + 32);
  }
};

struct Problem {
  int64_t H, D, Dp, hn, R, MB;
  float scaling;
  const int32_t* table;       // [S, H_kv, MB]
  const at::Half* rows;       // the arena as fp16 rows of D: page p holds rows [2Rp, 2Rp + 2R)
  const int32_t* kv_len;
  const int32_t* q_start;
};

// key rows [k0, k0 + nk) of one stream into sc.kt [D, KB] (K transposed) and sc.vb [KB, Dp] (V), fp32;
// what nk leaves zero (rows past it are never read from the arena)
void load_block(const Problem& pr, const int32_t* trow, int64_t k0, int64_t nk, Scratch& sc) {
  const int64_t D = pr.D, Dp = pr.Dp, R = pr.R;
  std::fill(sc.vb.begin() + nk * Dp, sc.vb.end(), 0.f);
  if (nk < KB) std::fill(sc.kt.begin(), sc.kt.end(), 0.f);
  for (int64_t r = 0; r < nk; ++r) {
    const int64_t row = k0 + r;
    const at::Half* k = pr.rows + ((int64_t)trow[row / R] * 2 * R + row % R) * D;
    const at::Half* v = k + R * D;
    float* vr = sc.vb.data() + r * Dp;
    int64_t d = 0;
#ifdef KVPLAN_AVX512
    for (; d + 16 <= D; d += 16) {
      _mm512_storeu_ps(vr + d, kvplan::load16(v + d));
      alignas(64) float kk[16];
      _mm512_store_ps(kk, kvplan::load16(k + d));
      for (int64_t i = 0; i < 16; ++i) sc.kt[(d + i) * KB + r] = kk[i];
    }
#elif defined(KVPLAN_AVX2)
    for (; d + 8 <= D; d += 8) {
      _mm256_storeu_ps(vr + d, kvplan::load8(v + d));
      alignas(32) float kk[8];
      _mm256_store_ps(kk, kvplan::load8(k + d));
      for (int64_t i = 0; i < 8; ++i) sc.kt[(d + i) * KB + r] = kk[i];
    }
#endif
    for (; d < D; ++d) {
      vr[d] = static_cast<float>(v[d]);
      sc.kt[d * KB + r] = static_cast<float>(k[d]);
    }
    std::fill(vr + D, vr + Dp, 0.f);
  }
}

// Every stream's key blocks in bf16 pairs, converted once per call (a stream's blocks are read by
// each of its query tiles): stream (s, g)'s block b at data + off + (first[s·H_kv + g] + b)·(KT + VB),
// its kt2 [D2p, KB] (rows past D2 zero: whole tiles of 16 pair rows) then its vb2 [KB / 2, Dp] words
// (`load_block_bf16`; empty where there is no bf16 path); a stream's blocks follow one another.
struct Blocks {
  int64_t KT, VB;
  std::vector<int64_t> first;   // [S·H_kv + 1] a stream's first block
  std::vector<uint32_t> data;
  int64_t off = 0;              // data + off: 64-byte aligned
  const uint32_t* kt2(int64_t stream, int64_t b) const { return data.data() + off + (first[stream] + b) * (KT + VB); }
  const uint32_t* vb2(int64_t stream, int64_t b) const { return kt2(stream, b) + KT; }
};

#if defined(KVPLAN_AVX512) && defined(__AVX512BF16__)
#define KVPLAN_DPBF16 1
// The bf16 path (bf16 queries on a CPU with AVX512-BF16): products of bf16 pairs summed into fp32 by
// VDPBF16PS, two multiply-adds a lane per instruction. Keys and values are converted from their fp16
// storage to bf16 (exact for rows a bf16 model wrote: its values have bf16's 8 bits), the block's
// probabilities rounded to bf16 before P·V, as a bf16 flash attention does; sums and softmax in fp32.
inline __m512bh bh(__m512i x) { return (__m512bh)x; }

// 16 fp16 values -> 16 bf16 bits in the low halves of 16 32-bit lanes
inline __m512i bf16_lanes(const at::Half* p) { return _mm512_cvtepu16_epi32(kvplan::bf16_bits(kvplan::load16(p))); }

// key rows [k0, k0 + nk) into kt2 [D2, KB] (word (d', r): K[r][2d'], K[r][2d' + 1]) and vb2 [KB / 2, Dp]
// (word (r', c): V[2r'][c], V[2r' + 1][c]); what nk leaves zero (rows past nk are never read)
void load_block_bf16(const Problem& pr, const int32_t* trow, int64_t k0, int64_t nk, uint32_t* kt2, uint32_t* vb2) {
  const int64_t D = pr.D, Dp = pr.Dp, R = pr.R, D2 = (D + 1) / 2;
  std::fill(vb2, vb2 + KB / 2 * Dp, 0u);
  if (nk < KB || D % 2) std::fill(kt2, kt2 + D2 * KB, 0u);
  auto* v16 = reinterpret_cast<uint16_t*>(vb2);
  for (int64_t r = 0; r < nk; ++r) {
    const int64_t row = k0 + r;
    const at::Half* k = pr.rows + ((int64_t)trow[row / R] * 2 * R + row % R) * D;
    const at::Half* v = k + R * D;
    alignas(64) uint16_t kb[16];
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(kb), kvplan::bf16_bits(kvplan::load16(k + d)));
      const uint32_t* w = reinterpret_cast<const uint32_t*>(kb);
      for (int64_t i = 0; i < 8; ++i) kt2[(d / 2 + i) * KB + r] = w[i];
      const __m512i vv = bf16_lanes(v + d);                                 // into the pair's half r % 2
      uint32_t* dst = vb2 + (r / 2) * Dp + d;
      _mm512_storeu_si512(dst, _mm512_or_si512(_mm512_loadu_si512(dst), r % 2 ? _mm512_slli_epi32(vv, 16) : vv));
    }
    for (; d < D; ++d) {
      auto* k16 = reinterpret_cast<uint16_t*>(kt2 + (d / 2) * KB + r);
      k16[d % 2] = kvplan::bf16(static_cast<float>(k[d])).x;
      v16[((r / 2) * Dp + d) * 2 + r % 2] = kvplan::bf16(static_cast<float>(v[d])).x;
    }
  }
}

// scores of ROWS rows of q2 (row stride qs words) against kt2 [D2, KB], times `scaling` -> out [ROWS, KB]
template <int ROWS>
inline void scores_bf16(const uint32_t* q2, int64_t qs, const uint32_t* kt2, int64_t D2, float scaling, float* out) {
  __m512 s[ROWS][NV];
  for (int x = 0; x < ROWS; ++x)
    for (int v = 0; v < NV; ++v) s[x][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D2; ++d) {
    __m512bh k[NV];
    for (int v = 0; v < NV; ++v) k[v] = bh(_mm512_loadu_si512(kt2 + d * KB + 16 * v));
    for (int x = 0; x < ROWS; ++x) {
      const __m512bh b = bh(_mm512_set1_epi32(q2[x * qs + d]));
      for (int v = 0; v < NV; ++v) s[x][v] = _mm512_dpbf16_ps(s[x][v], b, k[v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scaling);
  for (int x = 0; x < ROWS; ++x)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + x * KB + 16 * v, _mm512_mul_ps(s[x][v], sc));
}

// acc rows (ROWS, stride Dp) = acc * alpha + p2 · vb2 (p2 [ROWS, KB] bf16, zero past each row's keys)
template <int ROWS>
inline void accumulate_bf16(float* acc, int64_t Dp, const uint16_t* p2, const float* alpha, const uint32_t* vb2,
                            int64_t nk) {
  const int64_t pairs = (nk + 1) / 2;
  for (int64_t c = 0; c < Dp; c += 64) {
    const int nc = (int)std::min<int64_t>(4, (Dp - c) / 16);
    __m512 a[ROWS][4];
    for (int x = 0; x < ROWS; ++x)
      for (int v = 0; v < 4; ++v)
        if (v < nc) a[x][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + x * Dp + c + 16 * v), _mm512_set1_ps(alpha[x]));
    for (int64_t r = 0; r < pairs; ++r) {
      const uint32_t* vr = vb2 + r * Dp + c;
      __m512bh vv[4];
      for (int v = 0; v < 4; ++v)
        if (v < nc) vv[v] = bh(_mm512_loadu_si512(vr + 16 * v));
      for (int x = 0; x < ROWS; ++x) {
        const __m512bh pr = bh(_mm512_set1_epi32(reinterpret_cast<const uint32_t*>(p2 + x * KB)[r]));
        for (int v = 0; v < 4; ++v)
          if (v < nc) a[x][v] = _mm512_dpbf16_ps(a[x][v], pr, vv[v]);
      }
    }
    for (int x = 0; x < ROWS; ++x)
      for (int v = 0; v < 4; ++v)
        if (v < nc) _mm512_storeu_ps(acc + x * Dp + c + 16 * v, a[x][v]);
  }
}
Blocks convert_blocks(const Problem& pr, int64_t S, int64_t Hk) {
  Blocks bl{(pr.D + 31) / 32 * 16 * KB, KB / 2 * pr.Dp, std::vector<int64_t>(S * Hk + 1, 0), {}};
  for (int64_t s = 0; s < S; ++s)
    for (int64_t g = 0; g < Hk; ++g) bl.first[s * Hk + g + 1] = bl.first[s * Hk + g] + (pr.kv_len[s] + KB - 1) / KB;
  const int64_t total = bl.first.back();
  bl.data.resize(total * (bl.KT + bl.VB) + 16);
  bl.off = (64 - reinterpret_cast<uintptr_t>(bl.data.data()) % 64) % 64 / 4;
  at::parallel_for(0, total, 16, [&](int64_t b0, int64_t b1) {
    int64_t stream = std::upper_bound(bl.first.begin(), bl.first.end(), b0) - bl.first.begin() - 1;
    for (int64_t b = b0; b < b1; ++b) {
      while (bl.first[stream + 1] <= b) ++stream;
      const int64_t k0 = (b - bl.first[stream]) * KB, len = pr.kv_len[stream / Hk];
      uint32_t* kt2 = bl.data.data() + bl.off + b * (bl.KT + bl.VB);
      load_block_bf16(pr, pr.table + stream * pr.MB, k0, std::min(KB, len - k0), kt2, kt2 + bl.KT);
    }
  });
  return bl;
}

// The tile path (bf16 queries on a CPU with AMX, where the compiler targets it): both products on
// AMX tiles through the intrinsics (TDPBF16PS: bf16 products, fp32 sums), over the operands the
// VDPBF16PS path builds — kt2 and vb2 are already the pair-interleaved ("VNNI") B layout the tiles
// read, the queries and probabilities plain bf16 rows. One tile shape serves every operand (16 rows
// of 64 bytes: C 16 rows × 16 fp32, A 16 rows × 32 bf16, B 16 pair rows × 16 columns), configured
// once per thread and call: tiles 0-3 C (2 × 2: 32 rows × 32 columns), 4-5 A, 6-7 B. A task's rows
// (padded to a multiple of 32, the queries to D2p words, with zeros) go 32 at a time through key
// blocks of KT2 = 128 keys (two KB blocks of `convert_blocks`, consecutive in memory, so no layout
// change; only the KB blocks the 32 rows can see): S = Q·Kᵀ [32, ≤ 128] fp32 (L1), then one register
// pass per row — max; 2^(s·scaling·log2 e − m), the scaling folded into the subtraction's FMA and m
// the running max in log2 units; sum; bf16 probabilities stored — masking only rows whose keys end
// inside the block, zeros for rows that see none of it; then O += P·V with the 32 rows' fp32
// accumulators loaded into C tiles and stored back; a row's accumulators are rescaled only when its
// max rises. (Moving the max only when passed by more than 2^8, probabilities then up to 256, measured
// 10% faster but rounds the largest probability to bf16 where it is otherwise exactly 1: larger errors
// against the fp32 reference, so not here.) Only for scaling > 0 (the raw scores' max is then the
// scaled ones'); the VDPBF16PS path otherwise. On the Xeon with AMX (2 cores) the two
// products take about as long as the softmax and the two do not overlap (issuing the next rows'
// Q·Kᵀ between a softmax's rows measured the same). `tiles()` decides once per process (torch's
// probe: whether a bf16 brgemm packs to VNNI, i.e. runs on AMX; then the kernel's permission for the
// tile data); the result differs from the VDPBF16PS path's in summation order and exp's polynomial.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVPLAN_AMX 1
#endif
int tiles_mode = -1;          // -1: AMX where the CPU has it; 0: never (`prefill_tiles`, for the tests)

bool tiles() {
#ifdef KVPLAN_AMX
  static const bool amx = at::native::cpublas::could_pack(at::kBFloat16) &&
                          syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return amx && tiles_mode != 0;
#else
  return false;
#endif
}

#ifdef KVPLAN_AMX

struct TileConfig {                   // AMX palette 1: every tile 16 rows × 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void tiles_begin() {
  at::native::cpublas::brgemm_release();   // torch's brgemm reconfigures on its next call
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// 2^x, a degree-5 polynomial of the fraction (x - round(x) in [-0.5, 0.5]) scaled by 2^round(x)
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022651f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// S [32, 64·nb] (row stride KT2) = the queries q (32 rows, stride D2p words) · nb KB blocks of keys
// from kt2 (block stride bs words); 2 × 2 C tiles (16 rows × 16 keys), each A and B tile read twice
inline void tile_scores(const uint32_t* q, int64_t D2p, const uint32_t* kt2, int64_t bs, int nb, float* S) {
  for (int b = 0; b < nb; ++b)
    for (int h = 0; h < 2; ++h) {                          // 32 keys
      const uint32_t* kt = kt2 + b * bs + 32 * h;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t d = 0; d < D2p; d += 16) {
        _tile_loadd(4, q + d, D2p * 4);
        _tile_loadd(6, kt + d * KB, KB * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, kt + d * KB + 16, KB * 4);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, q + 16 * D2p + d, D2p * 4);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* o = S + b * KB + 32 * h;
      _tile_stored(0, o, KT2 * 4);
      _tile_stored(1, o + 16, KT2 * 4);
      _tile_stored(2, o + 16 * KT2, KT2 * 4);
      _tile_stored(3, o + 16 * KT2 + 16, KT2 * 4);
    }
}

// acc (32 rows, stride Dp) columns [0, 16·NC) += P [32, 64·nb] (bf16, row stride KT2) · V of nb KB
// blocks from vb2 (block stride bs words, columns from the same offset as acc's)
template <int NC>
inline void tile_pv(const uint16_t* P, const uint32_t* vb2, int64_t bs, int nb, int64_t Dp, float* acc) {
  _tile_loadd(0, acc, Dp * 4);
  _tile_loadd(2, acc + 16 * Dp, Dp * 4);
  if (NC > 1) _tile_loadd(1, acc + 16, Dp * 4);
  if (NC > 1) _tile_loadd(3, acc + 16 * Dp + 16, Dp * 4);
  for (int b = 0; b < nb; ++b)
    for (int h = 0; h < 2; ++h) {                          // 32 keys: 16 pair rows of vb2
      const uint32_t* v = vb2 + b * bs + 16 * h * Dp;
      const uint16_t* p = P + b * KB + 32 * h;
      _tile_loadd(4, p, KT2 * 2);
      _tile_loadd(6, v, Dp * 4);
      _tile_dpbf16ps(0, 4, 6);
      if (NC > 1) _tile_loadd(7, v + 16, Dp * 4);
      if (NC > 1) _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, p + 16 * KT2, KT2 * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (NC > 1) _tile_dpbf16ps(3, 5, 7);
    }
  _tile_stored(0, acc, Dp * 4);
  _tile_stored(2, acc + 16 * Dp, Dp * 4);
  if (NC > 1) _tile_stored(1, acc + 16, Dp * 4);
  if (NC > 1) _tile_stored(3, acc + 16 * Dp + 16, Dp * 4);
}

// one row's scores s [16·V] with `seen` keys visible (1 .. 16·V) -> bf16 probabilities p2 (0 past
// seen), its running max m (log2 units) and sum l updated, its accumulator row rescaled when m rises
template <int V>
inline void tile_softmax_row(const float* s, int64_t seen, float c, float& m, float& l, float* acc, int64_t Dp,
                             uint16_t* p2) {
  __m512 x[V];
  __mmask16 keep[V];
  const bool masked = seen < 16 * V;
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int v = 0; v < V; ++v) {
    if (masked) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, seen - 16 * v));
      keep[v] = (__mmask16)((1u << n) - 1u);
      x[v] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), keep[v], s + 16 * v);
    } else {
      x[v] = _mm512_loadu_ps(s + 16 * v);
    }
    mx = _mm512_max_ps(mx, x[v]);
  }
  const float bm = _mm512_reduce_max_ps(mx) * c;
  if (bm > m) {                                           // a new max: rescale (not at the first block: acc and l 0)
    if (m != -INFINITY) {
      const float alpha = std::exp2(m - bm);
      l *= alpha;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int64_t d = 0; d < Dp; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), av));
    }
    m = bm;
  }
  const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < V; ++v) {
    __m512 e = exp2_16(_mm512_fmsub_ps(x[v], cv, mv));
    if (masked) e = _mm512_maskz_mov_ps(keep[v], e);
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p2 + 16 * v), (__m256i)_mm512_cvtneps_pbh(e));
  }
  l += _mm512_reduce_add_ps(sum);
}

template <typename T>
T* align64(std::vector<T>& v) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

// one task on the tiles: rows (position j, head hh) as row i = j·h_n + hh, 32 at a time
void run_task_tiles(const Problem& pr, const Task& t, const Blocks& bl, const kvplan::bf16* q, kvplan::bf16* out,
                    Scratch& sc) {
  const int64_t D = pr.D, Dp = pr.Dp, hn = pr.hn, H = pr.H, D2p = (D + 31) / 32 * 16;
  const int64_t q0 = pr.q_start[t.s], n = pr.q_start[t.s + 1] - q0, len = pr.kv_len[t.s];
  const int64_t M = t.nj * hn, pairs = (M + 31) / 32, first = len - n + t.j0;
  const int64_t stream = t.s * (H / hn) + t.g, bs = bl.KT + bl.VB;
  uint32_t* q2 = align64(sc.tq);
  float *acc = align64(sc.tacc), *S = align64(sc.ts);
  uint16_t* P = align64(sc.tp);
  auto* q16 = reinterpret_cast<uint16_t*>(q2);
  std::fill(q16, q16 + pairs * 32 * 2 * D2p, uint16_t(0));
  for (int64_t j = 0; j < t.nj; ++j)                            // its h_n heads, contiguous
    for (int64_t hh = 0; hh < hn; ++hh)
      std::memcpy(q16 + (j * hn + hh) * 2 * D2p, q + ((q0 + t.j0 + j) * H + t.g * hn + hh) * D, D * sizeof(uint16_t));
  std::fill(acc, acc + pairs * 32 * Dp, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + M, -INFINITY);
  std::fill(sc.l.begin(), sc.l.begin() + M, 0.f);
  const float c = pr.scaling * 1.4426950408889634f;
  const int64_t last = first + t.nj - 1;                        // keys [0, last] are seen by some row
  for (int64_t k0 = 0; k0 <= last; k0 += KT2) {
    const int64_t nk = std::min(KT2, last + 1 - k0);
    const uint32_t* kt2 = bl.kt2(stream, k0 / KB);
    const uint32_t* vb2 = kt2 + bl.KT;
    for (int64_t st = 0; st < pairs; ++st) {                    // rows [32·st, 32·st + 32)
      const int64_t top = first + std::min(st * 32 + 31, M - 1) / hn;
      const int nb = (int)((std::min(nk, top - k0 + 1) + KB - 1) / KB);   // KB blocks its rows see
      if (nb <= 0) continue;
      tile_scores(q2 + st * 32 * D2p, D2p, kt2, bs, nb, S);
      for (int64_t r = 0; r < 32; ++r) {
        const int64_t i = st * 32 + r;
        uint16_t* p2 = P + r * KT2;
        const int64_t seen = i < M ? std::min(nk, first + i / hn - k0 + 1) : 0;
        if (seen <= 0) {
          std::fill(p2, p2 + nb * KB, uint16_t(0));
          continue;
        }
        const float* s = S + r * KT2;
        float* a = acc + i * Dp;
        static_assert(KT2 == 2 * KB, "one or two KB blocks");
        if (nb == 1) tile_softmax_row<4>(s, seen, c, sc.m[i], sc.l[i], a, Dp, p2);
        else tile_softmax_row<8>(s, seen, c, sc.m[i], sc.l[i], a, Dp, p2);
      }
      float* as = acc + st * 32 * Dp;
      int64_t c0 = 0;
      for (; c0 + 32 <= Dp; c0 += 32) tile_pv<2>(P, vb2 + c0, bs, nb, Dp, as + c0);
      if (c0 < Dp) tile_pv<1>(P, vb2 + c0, bs, nb, Dp, as + c0);
    }
  }
  for (int64_t j = 0; j < t.nj; ++j) {
    kvplan::bf16* dst = out + ((q0 + t.j0 + j) * H + t.g * hn) * D;
    for (int64_t hh = 0; hh < hn; ++hh) {
      const int64_t i = j * hn + hh;
      const float inv = 1.f / sc.l[i];
      const __m512 iv = _mm512_set1_ps(inv);
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) kvplan::store16(dst + hh * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + i * Dp + d), iv));
      for (; d < D; ++d) dst[hh * D + d] = kvplan::from_f<kvplan::bf16>(acc[i * Dp + d] * inv);
    }
  }
}
#endif
#endif

// one task: rows (position j, head hh) as row i = j·h_n + hh of the tile
template <typename T>
void run_task(const Problem& pr, const Task& t, const Blocks& bl, const T* q, T* out, Scratch& sc) {
#ifdef KVPLAN_AMX
  if constexpr (std::is_same<T, kvplan::bf16>::value)
    if (tiles() && pr.scaling > 0) return run_task_tiles(pr, t, bl, q, out, sc);   // ... or AMX tiles
#endif
  const int64_t D = pr.D, Dp = pr.Dp, hn = pr.hn, H = pr.H, D2 = (D + 1) / 2;
  const int64_t q0 = pr.q_start[t.s], n = pr.q_start[t.s + 1] - q0, len = pr.kv_len[t.s];
  const int64_t M = t.nj * hn, first = len - n + t.j0;          // the tile's first position
  const int32_t* trow = pr.table + (t.s * (H / hn) + t.g) * pr.MB;
#ifdef KVPLAN_DPBF16
  constexpr bool pairs = std::is_same<T, kvplan::bf16>::value;  // bf16 queries: the VDPBF16PS path
#else
  constexpr bool pairs = false;
#endif
  for (int64_t j = 0; j < t.nj; ++j) {
    const T* src = q + ((q0 + t.j0 + j) * H + t.g * hn) * D;     // its h_n heads, contiguous
    for (int64_t hh = 0; hh < hn; ++hh) {
      const int64_t i = j * hn + hh;
      if (pairs) {
        auto* dst = reinterpret_cast<uint16_t*>(sc.q2.data() + i * D2);
        std::memcpy(dst, src + hh * D, D * sizeof(uint16_t));
        if (D % 2) dst[D] = 0;
      } else {
        float* dst = sc.q.data() + i * Dp;
        for (int64_t d = 0; d < D; ++d) dst[d] = kvplan::to_f(src[hh * D + d]) * pr.scaling;
        std::fill(dst + D, dst + Dp, 0.f);
      }
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + M * Dp, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + M, -INFINITY);
  std::fill(sc.l.begin(), sc.l.begin() + M, 0.f);
  float alpha[2];
  const int64_t last = first + t.nj - 1;                         // keys [0, last] are seen by some row
  for (int64_t k0 = 0; k0 <= last; k0 += KB) {
    const int64_t nk = std::min(KB, last + 1 - k0);
    float* p = sc.p.data();
#ifdef KVPLAN_DPBF16
    const int64_t stream = t.s * (H / hn) + t.g;
    const uint32_t *kt2 = pairs ? bl.kt2(stream, k0 / KB) : nullptr, *vb2 = pairs ? bl.vb2(stream, k0 / KB) : nullptr;
    if (pairs) {
      int64_t i = 0;
      for (; i + 4 <= M; i += 4) scores_bf16<4>(sc.q2.data() + i * D2, D2, kt2, D2, pr.scaling, p + i * KB);
      for (; i < M; ++i) scores_bf16<1>(sc.q2.data() + i * D2, D2, kt2, D2, pr.scaling, p + i * KB);
    }
#endif
    if (!pairs) {
      load_block(pr, trow, k0, nk, sc);
      int64_t i = 0;
      for (; i + 4 <= M; i += 4) scores<4>(sc.q.data() + i * Dp, Dp, sc.kt.data(), D, p + i * KB);
      for (; i < M; ++i) scores<1>(sc.q.data() + i * Dp, Dp, sc.kt.data(), D, p + i * KB);
    }
    for (int64_t i = 0; i < M; i += 2) {                         // two rows at a time through P·V
      const int64_t rows = std::min<int64_t>(2, M - i);
      int64_t upto = 0;
      for (int64_t x = 0; x < rows; ++x) {
        const int64_t seen = std::min(nk, first + (i + x) / hn - k0 + 1);   // keys at or before its position
        alpha[x] = softmax_block(p + (i + x) * KB, seen, sc.m[i + x], sc.l[i + x]);
        upto = std::max(upto, seen);
      }
      if (upto <= 0) continue;
      float* acc = sc.acc.data() + i * Dp;
#ifdef KVPLAN_DPBF16
      if (pairs) {
        uint16_t* p2 = sc.p2.data() + i * KB;
        for (int64_t x = 0; x < rows; ++x)
          for (int v = 0; v < NV; ++v)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p2 + x * KB + 16 * v),
                                kvplan::bf16_bits(_mm512_loadu_ps(p + (i + x) * KB + 16 * v)));
        if (rows == 2) accumulate_bf16<2>(acc, Dp, p2, alpha, vb2, upto);
        else accumulate_bf16<1>(acc, Dp, p2, alpha, vb2, upto);
        continue;
      }
#endif
      if (rows == 2) accumulate<2>(acc, Dp, p + i * KB, alpha, sc.vb.data(), upto);
      else accumulate<1>(acc, Dp, p + i * KB, alpha, sc.vb.data(), upto);
    }
  }
  for (int64_t j = 0; j < t.nj; ++j) {
    T* dst = out + ((q0 + t.j0 + j) * H + t.g * hn) * D;
    for (int64_t hh = 0; hh < hn; ++hh) {
      const int64_t i = j * hn + hh;
      const float inv = 1.f / sc.l[i];
      for (int64_t d = 0; d < D; ++d) dst[hh * D + d] = kvplan::from_f<T>(sc.acc[i * Dp + d] * inv);
    }
  }
}

// tasks -> per thread the tasks it runs: longest first, each to the least loaded thread
std::vector<std::vector<int64_t>> assign(const std::vector<Task>& tasks, int64_t threads) {
  std::vector<int64_t> order(tasks.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return tasks[a].cost > tasks[b].cost; });
  std::vector<std::vector<int64_t>> out(threads);
  std::vector<double> load(threads, 0.0);
  for (int64_t i : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    out[t].push_back(i);
    load[t] += tasks[i].cost;
  }
  return out;
}

}  // namespace

// q [N, H, D] fp32/bf16/fp16 contiguous; arena [bytes] uint8; table [S, H_kv, MB], kv_len [S],
// q_start [S + 1] int32 -> out [N, H, D] in q's dtype (kernels/paged_prefill.py states the contract)
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor arena, torch::Tensor table, torch::Tensor kv_len,
                            torch::Tensor q_start, int64_t page_rows, double scaling) {
  const auto qt = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && !q.is_cuda() &&
              (qt == torch::kFloat || qt == torch::kBFloat16 || qt == torch::kHalf), "q must be a contiguous CPU fp32/bf16/fp16 [N, H, D]");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(arena.scalar_type() == torch::kUInt8 && arena.dim() == 1 && arena.is_contiguous() && arena.numel() % (2 * D) == 0,
              "arena must be uint8 [bytes] of whole fp16 rows");
  TORCH_CHECK(table.scalar_type() == torch::kInt && table.dim() == 3 && table.size(1) > 0 && H % table.size(1) == 0,
              "table must be int32 [S, H_kv, MB]");
  const int64_t S = table.size(0), Hk = table.size(1), MB = table.size(2);
  TORCH_CHECK(kv_len.scalar_type() == torch::kInt && kv_len.numel() == S, "kv_len must be int32 [S]");
  TORCH_CHECK(q_start.scalar_type() == torch::kInt && q_start.numel() == S + 1, "q_start must be int32 [S + 1]");
  TORCH_CHECK(page_rows >= 1, "page_rows must be >= 1");
  auto tab = table.contiguous();
  auto lens = kv_len.contiguous();
  auto starts = q_start.contiguous();
  const int32_t *lp = lens.data_ptr<int32_t>(), *sp = starts.data_ptr<int32_t>(), *tp = tab.data_ptr<int32_t>();
  const int64_t pages = arena.numel() / (4 * page_rows * D);
  TORCH_CHECK(sp[0] == 0 && sp[S] == N, "q_start must rise from 0 to N");
  const int64_t hn = H / Hk;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = sp[s + 1] - sp[s], len = lp[s];
    TORCH_CHECK(n >= 0 && n <= len, "segment ", s, ": ", n, " query rows but kv_len ", len);
    TORCH_CHECK((len + page_rows - 1) / page_rows <= MB, "segment ", s, ": kv_len ", len, " needs more pages than the table's ", MB);
    for (int64_t g = 0; g < Hk; ++g)
      for (int64_t b = 0; b < (len + page_rows - 1) / page_rows; ++b) {
        const int64_t page = tp[(s * Hk + g) * MB + b];
        TORCH_CHECK(page >= 0 && page < pages, "segment ", s, ", KV head ", g, ": page ", page, " outside the arena");
      }
    for (int64_t j0 = 0; j0 < n; j0 += BQ) {
      const int64_t nj = std::min(BQ, n - j0), first = len - n + j0;
      for (int64_t g = 0; g < Hk; ++g)
        tasks.push_back({s, g, j0, nj, (double)nj * hn * (first + (nj + 1) / 2.0 + KB)});
    }
  }
  auto out = torch::empty_like(q);
  if (tasks.empty()) return out;
  const Problem pr{H, D, (D + 15) / 16 * 16, hn, page_rows, MB, (float)scaling, tp,
                   reinterpret_cast<const at::Half*>(arena.data_ptr<uint8_t>()), lp, sp};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (int64_t)tasks.size());
  const auto plan = assign(tasks, threads);
  auto body = [&](auto tag) {
    using T = decltype(tag);
#ifdef KVPLAN_DPBF16
    const Blocks bl = std::is_same<T, kvplan::bf16>::value ? convert_blocks(pr, S, Hk) : Blocks{};
#else
    const Blocks bl{};
#endif
    const T* qp = reinterpret_cast<const T*>(q.data_ptr());
    T* op = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
#ifdef KVPLAN_AMX
      const bool amx = std::is_same<T, kvplan::bf16>::value && tiles() && pr.scaling > 0;
      if (amx) tiles_begin();
#else
      const bool amx = false;
#endif
      Scratch sc(BQ * hn, D, pr.Dp, amx);
      for (int64_t th = b; th < e; ++th)
        for (int64_t i : plan[th]) run_task<T>(pr, tasks[i], bl, qp, op, sc);
#ifdef KVPLAN_AMX
      if (amx) _tile_release();
#endif
    });
  };
  if (qt == torch::kFloat) body(float{});
  else if (qt == torch::kBFloat16) body(kvplan::bf16{});
  else body(kvplan::f16{});
  return out;
}

// the AMX tile path of bf16 queries: mode -1 where the CPU has AMX (the default), 0 never (the
// VDPBF16PS path) -> whether calls now take it (the tests run both paths where both exist)
bool prefill_tiles(int64_t mode) {
#ifdef KVPLAN_DPBF16
  tiles_mode = (int)mode;
  return tiles();
#else
  return false;
#endif
}
