// keel::gguf_rows: the embedding's lookup, rows of a GGUF weight matrix dequantized to float32 by
// deq32 (deq32.h), from the file's row order or from blocks.pack_x16's layout in place: no dequantized
// copy of the matrix, which for a tied embedding is also the LM head's weight.
//
//   gguf_rows(w [N, K/E*bytes] or x16 [ceil(N/16), K/32 * 16 bytes] uint8, ids [R] int64, ggml_type, x16)
//     -> [R, K] float32

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "common.h"
#include "deq32.h"

namespace {

using namespace keel;

// Rebuilds block b of weight row `row` of an x16 matrix (blocks.pack_x16: per group of 16 rows and
// block, the rows' fp16 scales, then 4-byte chunks of the rest, each 16 rows deep) in file order.
void unpack_x16_block(const uint8_t* packed, int64_t row_stride, int64_t row, int64_t b, int bytes, int scales,
                      uint8_t* block) {
  const int lane = int(row % 16);
  const uint8_t* unit = packed + row / 16 * row_stride + b * 16 * bytes;
  for (int s = 0; s < scales / 2; ++s) std::memcpy(block + 2 * s, unit + 32 * s + 2 * lane, 2);
  for (int c = 0; c < (bytes - scales) / 4; ++c) std::memcpy(block + scales + 4 * c, unit + 16 * scales + 64 * c + 4 * lane, 4);
}

template <int T>
void rows_of(const uint8_t* w, int64_t row_stride, const int64_t* ids, int64_t r, int64_t k, bool x16, float* out) {
  constexpr TypeInfo t = type_info(T);
  constexpr int scales = T == Q4_1 || T == Q5_1 ? 4 : 2;
  at::parallel_for(0, r, std::max<int64_t>(1, 8192 / k), [&](int64_t a, int64_t z) {
    uint8_t block[34];
    for (int64_t i = a; i < z; ++i)
      for (int64_t b = 0; b < k / QK; ++b) {
        if constexpr (block_bytes(T) != 0) {
          if (x16) {
            unpack_x16_block(w, row_stride, ids[i], b, t.bytes, scales, block);
            deq32<T>(block, 0, out + i * k + b * QK);
            continue;
          }
        }
        deq32<T>(w + ids[i] * row_stride, b, out + i * k + b * QK);
      }
  });
}

}  // namespace

namespace keel {

// The embedding's lookup: rows ids [R] of a weight matrix w dequantized to float32 [R, K], each element
// deq32's value (ggml's reference dequantization bit for bit). w is in the file's row order [N, K/E*bytes],
// or with x16 (Q4_0..Q8_0 only) in blocks.pack_x16's layout [ceil(N/16), K/32 * 16 bytes].
at::Tensor gguf_rows(const at::Tensor& w, const at::Tensor& ids, int64_t ggml_type, bool x16) {
  constexpr const char* op = "keel::gguf_rows";
  const TypeInfo t = type_info(ggml_type);
  TORCH_CHECK(t.bytes, op, ": unsupported ggml_type ", ggml_type);
  TORCH_CHECK(!x16 || block_bytes(ggml_type), op, ": ", t.name, " has no x16 layout");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": w must be a contiguous uint8 CPU matrix, got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), op,
              ": ids must be a contiguous int64 vector, got ", ids.scalar_type(), " ", ids.sizes());
  const int64_t unit = x16 ? 16 * t.bytes : t.bytes;
  TORCH_CHECK(w.size(1) % unit == 0, op, ": a row of ", w.size(1), " bytes is not whole ", t.name, " blocks");
  const int64_t k = w.size(1) / unit * t.elems, rows = x16 ? 16 * w.size(0) : w.size(0), r = ids.size(0);
  TORCH_CHECK(k % QK == 0, op, ": K = ", k, " is not a multiple of 32");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, op, ": row ", ip[i], " outside 0..", rows - 1);
  at::Tensor y = at::empty({r, k}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  const int64_t stride = w.size(1);
  switch (ggml_type) {
    case F32: rows_of<F32>(wp, stride, ip, r, k, x16, out); break;
    case F16: rows_of<F16>(wp, stride, ip, r, k, x16, out); break;
    case BF16: rows_of<BF16>(wp, stride, ip, r, k, x16, out); break;
    case Q4_0: rows_of<Q4_0>(wp, stride, ip, r, k, x16, out); break;
    case Q4_1: rows_of<Q4_1>(wp, stride, ip, r, k, x16, out); break;
    case Q5_0: rows_of<Q5_0>(wp, stride, ip, r, k, x16, out); break;
    case Q5_1: rows_of<Q5_1>(wp, stride, ip, r, k, x16, out); break;
    case Q8_0: rows_of<Q8_0>(wp, stride, ip, r, k, x16, out); break;
    case Q4_K: rows_of<Q4_K>(wp, stride, ip, r, k, x16, out); break;
    case Q5_K: rows_of<Q5_K>(wp, stride, ip, r, k, x16, out); break;
    default: rows_of<Q6_K>(wp, stride, ip, r, k, x16, out); break;
  }
  return y;
}

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("gguf_rows(Tensor w, Tensor ids, int ggml_type, bool x16) -> Tensor", &keel::gguf_rows);
}
