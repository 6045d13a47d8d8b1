// The ops of Keel's kernel library that other ops of it call directly (layer.cpp composes a decoder
// layer of them): the same functions the torch.ops.keel schemas register, so a composed call gives
// the bits of the separate ones. Shapes and orders: at each definition.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace keel {

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, int64_t n, int64_t isa);     // gguf_mm.cpp
at::Tensor gguf_q8_mm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, int64_t n, int64_t isa);  // gguf_q8.cpp
std::vector<at::Tensor> gguf_q8_mm_many(const at::Tensor& x, at::TensorList w, at::IntArrayRef ggml_types,
                                        at::IntArrayRef n, int64_t isa);                             // gguf_q8.cpp
at::Tensor gguf_q8k_mm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, int64_t n, int64_t isa); // gguf_q8k.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);                                   // layer_ops.cpp
at::Tensor rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& keys, const at::Tensor& values);
void decode_attention_(const at::Tensor& out, const at::Tensor& rows, const at::Tensor& q, const at::Tensor& keys,
                       const at::Tensor& values, const at::Tensor& table, const at::Tensor& lengths,
                       int64_t block_tokens, double scale, int64_t isa);

}  // namespace keel
