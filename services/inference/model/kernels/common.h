// What Keel's two GGUF-block kernels (gguf_mm.cpp, gguf_q8.cpp) share: the ggml block constants, fp16
// reads, the CPU's base SIMD flags, the checks of an op's activations and isa argument, and the
// driver that splits a (row tile, weight tile) grid over torch's threads.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace keel {

constexpr int QK = 32;  // elements per block
// ggml type ids
constexpr int F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
              BF16 = 30;
constexpr int PORTABLE = 0;        // every op's isa code 0; -1 asks for the best path

// Bytes per 32-element block of gguf_q8's types (0: not one of them).
constexpr int block_bytes(int64_t type) {
  return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : type == Q8_0 ? 34 : 0;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline float half(const uint8_t* p) { return c10::detail::fp16_ieee_to_fp32_value(load_u16(p)); }

inline bool cpu_avx2_fma_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// The float32 ops' paths (keel::gguf_mm, keel::decode_attention_): isa code i is kFloatIsas[i].
constexpr int FLOAT_AVX2 = 1, FLOAT_AVX512 = 2;
inline const char* const kFloatIsas[] = {"portable", "avx2", "avx512"};

inline bool cpu_has_float_isa(int isa) {
  if (isa == FLOAT_AVX512) return cpu_avx2_fma_f16c() && __builtin_cpu_supports("avx512f");
  if (isa == FLOAT_AVX2) return cpu_avx2_fma_f16c();
  return isa == PORTABLE;
}

// x [M, K]: a contiguous float32 CPU matrix, K whole blocks of 32; w a CPU tensor.
inline void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": x and w must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K] matrix, got sizes ", x.sizes(),
              x.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(x.size(1) % QK == 0, op, ": K = ", x.size(1), " is not a multiple of the block size 32");
}

// The path an op runs for its isa argument: -1 the best the CPU has, else that one if the CPU has it.
// names[i] names isa code i; has(i) says whether this CPU runs it.
template <int N, typename Has>
int resolve_isa(const char* op, int64_t isa, const char* const (&names)[N], Has has) {
  TORCH_CHECK(isa >= -1 && isa < N, op, ": unknown isa ", isa);
  if (isa < 0) {
    for (int i = N - 1; i > PORTABLE; --i)
      if (has(i)) return i;
    return PORTABLE;
  }
  TORCH_CHECK(has(int(isa)), op, ": this CPU cannot run the ", names[isa], " path");
  return int(isa);
}

template <int N, typename Has>
std::vector<std::string> isas(const char* const (&names)[N], Has has) {  // best first
  std::vector<std::string> out;
  for (int i = N - 1; i >= PORTABLE; --i)
    if (has(i)) out.emplace_back(names[i]);
  return out;
}

// Runs tile(m0, c0) over every tile of up to mr rows x nc weight columns (rows, groups) of an
// [M, cols] output. Tiles are numbered column-tile-major so a thread's consecutive tiles reuse the
// same weights (from L1) across the row tiles; a thread gets at least ~32 KiB of weights. Threads
// split tiles, never K: an output element's bits do not depend on the split.
template <typename Tile>
void parallel_tiles(int64_t M, int64_t cols, int mr, int nc, int64_t col_bytes, const Tile& tile) {
  const int64_t mt = (M + mr - 1) / mr, ct = (cols + nc - 1) / nc;
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, nc * col_bytes)) * mt;
  at::parallel_for(0, mt * ct, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) tile((i % mt) * mr, (i / mt) * nc);
  });
}

}  // namespace keel
