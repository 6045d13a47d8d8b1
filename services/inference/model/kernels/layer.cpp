// A block-format decoder layer in two calls instead of a score of dispatches (forward.py runs them
// for every step without LoRA terms): each is the chain of Keel's ops and aten ops the step makes
// op by op, in the same order on the same tensors, so it gives the same bits (tested).
//
//   layer_attention(x [N', E], norm [E], eps, qkv [P] blocks, qkv_types [P], qkv_bias [0 or P],
//                   sizes [3] = (H*D, KV*D, KV*D), q8, n, cos [n, D], sin [n, D], slots [n], keys, values [KV, S, D],
//                   out [N', H*D], rows [B], table [B, W], lengths [B], block_tokens, scale) -> q' [n, H*D]
//       h = rms_norm(x); P = 1: q | k | v = (h @ qkv[0].T + qkv_bias[0])[:n] split by columns into sizes;
//       P = 3 (q, k, v of different block types): q = (h @ qkv[0].T + qkv_bias[0])[:n], and so on;
//       q' = rope_store(q, k, v, cos, sin, slots, keys, values)   (k', v into the pool);
//       B > 0: decode_attention_(out, rows, q', keys, values, table, lengths, block_tokens, scale)
//   layer_mlp(x [N', E], attn [N', H*D], o, o_type, o_n, norm [E], eps, gate_up, gate_up_type, gate_up_n,
//             down, down_type, down_n, q8) -> x'' [N', E]
//       x' = x + attn @ o.T;  g | u = rms_norm(x') @ gate_up.T split in halves;  x'' = x' + (silu(g) * u) @ down.T
//
// A weight is its BlockLinear's blocks and ggml type with its output width. `q8` is the format (gguf:
// true, gguf_f32: false); each weight then runs where blocks.layout puts its type: with q8, Q4_0..Q8_0
// (x16 blocks) on keel::gguf_q8_mm and Q4_K..Q6_K (x16k) on keel::gguf_q8k_mm; every other case (the
// float types, or gguf_f32) in the file's order on keel::gguf_mm. Separate q, k, v all of x16 types run
// in one keel::gguf_q8_mm_many call (the same tiles, so the bits of three gguf_q8_mm calls).

#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops.h"

namespace {

bool x16(int64_t type) { return type == 2 || type == 3 || type == 6 || type == 7 || type == 8; }  // Q4_0..Q8_0

// One of the layer's linear layers: y [M, n] = x [M, K] @ w.T over its blocks.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t n, bool q8) {
  const bool x16k = type == 12 || type == 13 || type == 14;  // Q4_K, Q5_K, Q6_K
  if (q8 && x16(type)) return keel::gguf_q8_mm(x, w, type, n, -1);
  if (q8 && x16k) return keel::gguf_q8k_mm(x, w, type, n, -1);
  return keel::gguf_mm(x, w, type, n, -1);
}

// The q, k, v products of h: where all three run on gguf_q8_mm, one call for the three (one quantized
// h, one parallel region: a decode step's k and v are too small to pay for a region of their own).
std::vector<at::Tensor> qkv_linears(const at::Tensor& h, at::TensorList qkv, at::IntArrayRef types,
                                    const std::vector<int64_t>& widths, bool q8) {
  if (q8 && std::all_of(types.begin(), types.end(), x16)) return keel::gguf_q8_mm_many(h, qkv, types, widths, -1);
  std::vector<at::Tensor> y;
  for (size_t p = 0; p < qkv.size(); ++p) y.push_back(linear(h, qkv[p], types[p], widths[p], q8));
  return y;
}

at::Tensor layer_attention(const at::Tensor& x, const at::Tensor& norm, double eps, at::TensorList qkv,
                           at::IntArrayRef qkv_types, at::TensorList qkv_bias, at::IntArrayRef sizes, bool q8, int64_t n,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& keys,
                           const at::Tensor& values, const at::Tensor& out, const at::Tensor& rows,
                           const at::Tensor& table, const at::Tensor& lengths, int64_t block_tokens, double scale) {
  constexpr const char* op = "keel::layer_attention";
  TORCH_CHECK(sizes.size() == 3, op, ": sizes must be the widths of q, k and v");
  TORCH_CHECK((qkv.size() == 1 || qkv.size() == 3) && qkv_types.size() == qkv.size(), op,
              ": qkv must be one fused weight or three, each with its type");
  TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == qkv.size(), op, ": qkv_bias must be empty or one per weight");
  TORCH_CHECK(n >= 0 && n <= x.size(0), op, ": n = ", n, " tokens outside the ", x.size(0), " rows of x");
  const at::Tensor h = keel::rms_norm(x, norm, eps);
  const std::vector<int64_t> widths = qkv.size() == 1 ? std::vector<int64_t>{sizes[0] + sizes[1] + sizes[2]}
                                                       : std::vector<int64_t>(sizes.begin(), sizes.end());
  std::vector<at::Tensor> y = qkv_linears(h, qkv, qkv_types, widths, q8);  // q, k, v: [n, width] views
  for (size_t p = 0; p < y.size(); ++p) {
    if (!qkv_bias.empty()) y[p] = at::add(y[p], qkv_bias[p]);
    y[p] = y[p].narrow(0, 0, n);
  }
  if (y.size() == 1) y = {y[0].narrow(1, 0, sizes[0]), y[0].narrow(1, sizes[0], sizes[1]),
                          y[0].narrow(1, sizes[0] + sizes[1], sizes[2])};
  const at::Tensor q = keel::rope_store(y[0], y[1], y[2], cos, sin, slots, keys, values);
  if (rows.numel() > 0) keel::decode_attention_(out, rows, q, keys, values, table, lengths, block_tokens, scale, -1);
  return q;
}

at::Tensor layer_mlp(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& o, int64_t o_type, int64_t o_n,
                     const at::Tensor& norm, double eps, const at::Tensor& gate_up, int64_t gate_up_type,
                     int64_t gate_up_n, const at::Tensor& down, int64_t down_type, int64_t down_n, bool q8) {
  TORCH_CHECK(gate_up_n % 2 == 0, "keel::layer_mlp: gate_up has an odd width ", gate_up_n);
  const at::Tensor x1 = at::add(x, linear(attn, o, o_type, o_n, q8));
  const at::Tensor gu = linear(keel::rms_norm(x1, norm, eps), gate_up, gate_up_type, gate_up_n, q8);
  const int64_t f = gate_up_n / 2;
  const at::Tensor m = at::mul(at::silu(gu.narrow(1, 0, f)), gu.narrow(1, f, f));
  return at::add(x1, linear(m, down, down_type, down_n, q8));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("layer_attention(Tensor x, Tensor norm, float eps, Tensor[] qkv, int[] qkv_types, Tensor[] qkv_bias, "
        "int[] sizes, bool q8, int n, "
        "Tensor cos, Tensor sin, Tensor slots, Tensor(a!) keys, Tensor(b!) values, Tensor(c!) out, Tensor rows, "
        "Tensor table, Tensor lengths, int block_tokens, float scale) -> Tensor", &layer_attention);
  m.def("layer_mlp(Tensor x, Tensor attn, Tensor o, int o_type, int o_n, Tensor norm, float eps, Tensor gate_up, "
        "int gate_up_type, int gate_up_n, Tensor down, int down_type, int down_n, bool q8) -> Tensor", &layer_mlp);
}
