// A decode step's decoder layers in one call (`decode_layers`; launcher and torch reference:
// kernels/decode_layers.py): per layer the fused q/k/v product, RoPE on q and k, the new K/V rows
// into the pool, decode attention over every stream whatever its storage form, the output
// projection, the residual and post-attention RMSNorm, the fused gate/up product, SiLU·up, the
// down projection and the next layer's RMSNorm — the same ops the engine's Python loop calls
// (kernels/cpu_decoder_ops.cpp, kernels/cpu_decode.cpp's paged_decode_mixed, oneDNN's packed
// linear through the dispatcher), in the same order on the same operands, so the rows it returns
// are the loop's bit for bit. At a decode step the rows are few (one per sequence) and the loop's
// Python between those ops — ~25 calls a layer, ~0.5 ms a layer — was a third of the step
// (docs/benchmarks.md, "Figures behind the code"). The GIL is released for the call.
//
// Shapes: N rows (one per decoding sequence, in the step's order), hidden = H·D, H query heads,
// H_kv KV heads, h_n = H / H_kv, D head dim, F the MLP's width, L layers; G = N·H_kv decode
// streams (sequence-major, then KV head).
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <tuple>
#include <vector>

// kernels/cpu_decoder_ops.cpp
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w, double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
void write_kv(torch::Tensor rows, torch::Tensor at, torch::Tensor k, torch::Tensor v, int64_t R);
// kernels/cpu_decode.cpp
std::tuple<torch::Tensor, torch::Tensor> paged_decode_mixed(
    torch::Tensor q, torch::Tensor arena, torch::Tensor dtable, torch::Tensor dstart, torch::Tensor dend,
    torch::Tensor qtable, torch::Tensor qn, torch::Tensor qform, torch::Tensor ctable, torch::Tensor cn,
    torch::Tensor ektable, torch::Tensor evtable, torch::Tensor xpage, torch::Tensor forms, torch::Tensor cos,
    torch::Tensor sin, int64_t page_bytes, int64_t R, int64_t coded_rows, int64_t entry_rows, int64_t group_heads,
    double scaling, int64_t task_rows);

namespace {

// x [N, in] · W packed by oneDNN (`kvcore.packed_linear`: torch.ops.mkldnn._reorder_linear_weight)
// -> [N, out], the op `PackedLinear.forward` calls (no bias: the launcher checks)
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& w) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack st;
  st.reserve(6);
  st.emplace_back(x);
  st.emplace_back(w);
  st.emplace_back(c10::IValue());                                  // bias: none
  st.emplace_back(std::string("none"));                            // attr
  st.emplace_back(c10::List<std::optional<at::Scalar>>());         // scalars
  st.emplace_back(std::string(""));                                // algorithm
  op.callBoxed(&st);
  return st[0].toTensor();
}

}  // namespace

// x [N, hidden] the residual (updated in place), y [N, hidden] = RMSNorm of x by layer 0's input
// norm; cos, sin [N, D] the rows' RoPE (fp32 or x's dtype); per layer [L]: qkv [(H + 2 H_kv)·D,
// hidden], o [hidden, H·D], gate_up [2F, hidden], down [hidden, F] packed, ln_in, ln_post [hidden];
// rows: the arena as fp16 rows [n, D], write_at [L, N, H_kv] int64 each new row's K row (V: R after);
// arena and the decode tables [L, G, …] (`kernels.paged_decode.NAMES` order), forms, rope_cos,
// rope_sin and the layout numbers as `paged_decode_mixed` takes them -> x after the last layer
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor y, torch::Tensor cos, torch::Tensor sin,
                            std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> o,
                            std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                            std::vector<torch::Tensor> ln_in, std::vector<torch::Tensor> ln_post, double eps,
                            int64_t H, int64_t Hk, torch::Tensor rows, torch::Tensor write_at, int64_t R,
                            torch::Tensor arena, std::vector<torch::Tensor> tables, torch::Tensor forms,
                            torch::Tensor rope_cos, torch::Tensor rope_sin, int64_t page_bytes, int64_t coded_rows,
                            int64_t entry_rows, double scaling, int64_t task_rows) {
  const int64_t L = (int64_t)qkv.size();
  TORCH_CHECK(L > 0 && (int64_t)o.size() == L && (int64_t)gate_up.size() == L && (int64_t)down.size() == L &&
                  (int64_t)ln_in.size() == L && (int64_t)ln_post.size() == L,
              "one qkv, o, gate_up, down, ln_in and ln_post per layer");
  TORCH_CHECK(tables.size() == 11, "the 11 decode tables");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.sizes() == x.sizes(), "x, y must be [N, hidden], x contiguous");
  TORCH_CHECK(H > 0 && Hk > 0 && H % Hk == 0, "H must be a multiple of H_kv");
  const int64_t N = x.size(0), D = rows.size(1), hn = H / Hk;
  TORCH_CHECK(write_at.dim() == 3 && write_at.size(0) == L && write_at.size(1) == N && write_at.size(2) == Hk &&
                  write_at.scalar_type() == torch::kLong,
              "write_at must be int64 [L, N, H_kv]");
  for (const auto& t : tables) TORCH_CHECK(t.size(0) == L && t.size(1) == N * Hk, "tables must be [L, N·H_kv, …]");
  const auto dtype = x.scalar_type();
  for (int64_t i = 0; i < L; ++i) {
    auto qkv_i = packed_linear(y, qkv[i]).view({N, H + 2 * Hk, D});                 // [N, H + 2 H_kv, D]
    auto q = qkv_i.narrow(1, 0, H), k = qkv_i.narrow(1, H, Hk);
    rope_(q, cos, sin);
    rope_(k, cos, sin);
    write_kv(rows, write_at[i].reshape({-1}), k.reshape({N * Hk, D}), qkv_i.narrow(1, H + Hk, Hk).reshape({N * Hk, D}), R);
    std::vector<torch::Tensor> tb;
    tb.reserve(11);
    for (const auto& t : tables) tb.push_back(t[i]);
    auto attn = std::get<0>(paged_decode_mixed(q.to(torch::kFloat).reshape({N * Hk, hn, D}), arena, tb[0], tb[1],
                                               tb[2], tb[3], tb[4], tb[5], tb[6], tb[7], tb[8], tb[9], tb[10], forms,
                                               rope_cos, rope_sin, page_bytes, R, coded_rows, entry_rows, hn,
                                               scaling, task_rows));             // [G, h_n, D] fp32
    auto a = packed_linear(attn.view({N, H * D}).to(dtype), o[i]);                    // [N, hidden]
    y = add_rms_norm(x, a, ln_post[i], eps);
    auto gu = packed_linear(y, gate_up[i]);                                          // [N, 2F]
    const int64_t F = gu.size(1) / 2;
    auto m = packed_linear(silu_mul(gu.narrow(1, 0, F).contiguous(), gu.narrow(1, F, F).contiguous()), down[i]);
    if (i + 1 < L)
      y = add_rms_norm(x, m, ln_in[i + 1], eps);
    else
      x.add_(m);
  }
  return x;
}
