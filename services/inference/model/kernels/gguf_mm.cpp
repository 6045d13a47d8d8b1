// Keel's CPU matmul over ggml-quantized weight blocks:  y = x @ dequant(w).T
//
//   x [M, K] float32 contiguous
//   w [N, K/32*bytes] uint8: N rows of K/32 ggml blocks, little-endian, no alignment assumed
//       Q4_1 (ggml type 3), 20 bytes: fp16 d, fp16 m, uint8 qs[16]; element j = qs[j] & 15,
//            element j+16 = qs[j] >> 4; w = d*q + m
//       Q8_0 (ggml type 8), 34 bytes: fp16 d, int8 qs[32]; w = d*q
//   y [M, N] float32
//
// Summation order, fixed by K alone and shared by every code path:
//   each output element owns 16 fp32 lanes, all starting at +0.0. For block b = 0, 1, ..., K/32-1:
//       acc[l] = fma(x[32b + l],      w[32b + l],      acc[l])      l = 0..15
//       acc[l] = fma(x[32b + l + 16], w[32b + l + 16], acc[l])
//   where w is the dequantized fp32 weight (d*q is exact in fp32, so d*q + m rounds once and equals
//   ggml's reference dequantization bit for bit). Then a fixed tree over the lanes:
//       s8[l] = a[l] + a[l+8];  s4[l] = s8[l] + s8[l+4];  s2[l] = s4[l] + s4[l+2];  y = s2[0] + s2[1]
//   AVX-512 keeps the 16 lanes in one zmm, AVX2 in two ymm (lanes 0-7 and 8-15), the portable path
//   in 16 floats using std::fma. fma and + are correctly rounded IEEE operations on every path, so
//   all paths give the same bits. The build uses -ffp-contract=off so the compiler cannot fuse the
//   tree's adds (or anything else) into different operations.
//   FMA rather than mul+add: measured on AVX-512 (3072x576 Q4_1, one thread) it is 1.3-1.8x faster
//   at M = 4..64 (M = 4: 252 vs 330 us, M = 64: 3162 vs 5550 us) and no slower at M = 1, and it
//   stays emulable: float64 holds the product exactly, and rounding product + acc to odd in float64
//   before the final rounding to fp32 reproduces the fp32 fma bit for bit.
//
// Threads split the (M tile, N tile) grid (common.h's parallel_tiles), never K: every output element is
// computed by one tile in the order above, so its bits do not depend on M, N, the row's position in
// the batch, the tile shape or the thread count. A tile holds MR activation rows x NR weight rows of
// accumulators in registers; each weight block is dequantized once per tile and applied to all MR
// rows (a GEMM, not M GEMVs).

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>

#include "common.h"
#include "ops.h"

namespace {

using namespace keel;

constexpr int AVX2 = FLOAT_AVX2, AVX512 = FLOAT_AVX512;  // the op's isa codes (0: portable)

struct Problem {
  const float* x;    // [M, K]
  const uint8_t* w;  // [N, row_bytes]
  float* y;          // [M, N]
  int64_t M, N, K, nb, row_bytes;  // nb = K / 32 blocks per weight row
};

// Weight row n0 + j of a tile; past the end of N a tile recomputes row N-1 and does not store it.
inline const uint8_t* weight_row(const Problem& p, int64_t n) {
  return p.w + std::min(n, p.N - 1) * p.row_bytes;
}

// At M = 1 the kernel streams weight blocks from memory. While a tile works through its K steps it
// prefetches the tile kPrefetchTiles N-tiles ahead (NR whole rows: one contiguous span), a step's
// share at a time. On the 49152x576 Q8_0 head at M = 1 (AVX-512, one thread, a busy host) this
// reads 8-13 GB/s against 2-4.5 GB/s without; one tile ahead gave 7-12, four 9-12; in-cache
// shapes are unchanged.
constexpr int kPrefetchTiles = 2;

inline void prefetch_step(const uint8_t* ahead, int64_t step_bytes, int64_t b) {
  for (int64_t o = b * step_bytes; o < (b + 1) * step_bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
}

// ---------------------------------------------------------------- portable (baseline x86-64, any CPU)

template <int T>
void deq_portable(const uint8_t* b, float* w) {  // b: one block -> w[32]
  const float d = half(b);
  if constexpr (T == Q4_1) {
    const float m = half(b + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * float(b[4 + j] & 15) + m;
      w[j + 16] = d * float(b[4 + j] >> 4) + m;
    }
  } else {
    for (int j = 0; j < 32; ++j) w[j] = d * float(int8_t(b[2 + j]));
  }
}

float hsum_portable(const float* a) {  // the fixed 16-lane tree
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

template <int T, int MR, int NR>
void tile_portable(const Problem& p, int64_t m0, int64_t n0) {
  constexpr int BB = block_bytes(T);
  float acc[MR][NR][16] = {};
  float w[NR][32];
  for (int64_t b = 0; b < p.nb; ++b) {
    for (int j = 0; j < NR; ++j) deq_portable<T>(weight_row(p, n0 + j) + b * BB, w[j]);
    for (int i = 0; i < MR; ++i) {
      const float* x = p.x + (m0 + i) * p.K + b * QK;
      for (int j = 0; j < NR; ++j)
        for (int l = 0; l < 16; ++l) {
          acc[i][j][l] = std::fma(x[l], w[j][l], acc[i][j][l]);
          acc[i][j][l] = std::fma(x[l + 16], w[j][l + 16], acc[i][j][l]);
        }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR && n0 + j < p.N; ++j) p.y[(m0 + i) * p.N + n0 + j] = hsum_portable(acc[i][j]);
}

// ---------------------------------------------------------------- AVX2 + FMA + F16C: 16 lanes = 2 ymm

#define KEEL_AVX2 __attribute__((target("avx2,fma,f16c")))

KEEL_AVX2 inline float hsum8(__m256 s8) {  // s8 = lanes l + l+8; finish the tree
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// A whole block as 4 ymm: elements 0-7, 8-15, 16-23, 24-31. Lanes 0-7 live in the accumulator for
// q[0] and q[2], lanes 8-15 in the one for q[1] and q[3].
template <int T>
KEEL_AVX2 inline void deq_avx2(const uint8_t* b, __m256* w) {
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(b)));
  if constexpr (T == Q4_1) {
    const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(b + 2)));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m256i q0 = _mm256_cvtepu8_epi32(q), q1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q));
    const __m256i nib = _mm256_set1_epi32(15);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q0, nib)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q1, nib)), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), m);
  } else {
    for (int k = 0; k < 4; ++k) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * k));
      w[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  }
}

template <int T, int MR, int NR>
KEEL_AVX2 void tile_avx2(const Problem& p, int64_t m0, int64_t n0) {
  constexpr int BB = block_bytes(T);
  const uint8_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = weight_row(p, n0 + j);
  __m256 lo[MR][NR], hi[MR][NR];  // lanes 0-7 and 8-15
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
  const uint8_t* ahead = p.w + (n0 + kPrefetchTiles * NR) * p.row_bytes;
  for (int64_t b = 0; b < p.nb; ++b) {
    prefetch_step(ahead, NR * BB, b);
    __m256 wv[NR][4];
    for (int j = 0; j < NR; ++j) deq_avx2<T>(w[j] + b * BB, wv[j]);
    for (int i = 0; i < MR; ++i) {
      const float* x = p.x + (m0 + i) * p.K + b * QK;
      for (int j = 0; j < NR; ++j) {  // lane l: element l, then element l + 16
        lo[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x), wv[j][0], lo[i][j]);
        hi[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), wv[j][1], hi[i][j]);
        lo[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), wv[j][2], lo[i][j]);
        hi[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), wv[j][3], hi[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR && n0 + j < p.N; ++j)
      p.y[(m0 + i) * p.N + n0 + j] = hsum8(_mm256_add_ps(lo[i][j], hi[i][j]));
}

// ---------------------------------------------------------------- AVX-512F: 16 lanes = 1 zmm

#define KEEL_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

KEEL_AVX512 inline float hsum16(__m512 a) {
  const __m256 top = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), top));
}

// A whole block: elements 0-15 (lo) and 16-31 (hi).
template <int T>
KEEL_AVX512 inline void deq_avx512(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
  if constexpr (T == Q4_1) {
    const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_u16(b + 2)));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
    lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), m);
    hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m);
  } else {
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  }
}

template <int T, int MR, int NR>
KEEL_AVX512 void tile_avx512(const Problem& p, int64_t m0, int64_t n0) {
  constexpr int BB = block_bytes(T);
  const uint8_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = weight_row(p, n0 + j);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* ahead = p.w + (n0 + kPrefetchTiles * NR) * p.row_bytes;
  for (int64_t b = 0; b < p.nb; ++b) {
    prefetch_step(ahead, NR * BB, b);
    __m512 wl[NR], wh[NR];
    for (int j = 0; j < NR; ++j) deq_avx512<T>(w[j] + b * BB, wl[j], wh[j]);
    for (int i = 0; i < MR; ++i) {
      const float* x = p.x + (m0 + i) * p.K + b * QK;
      const __m512 xl = _mm512_loadu_ps(x), xh = _mm512_loadu_ps(x + 16);
      for (int j = 0; j < NR; ++j) {
        acc[i][j] = _mm512_fmadd_ps(xl, wl[j], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(xh, wh[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR && n0 + j < p.N; ++j) p.y[(m0 + i) * p.N + n0 + j] = hsum16(acc[i][j]);
}

// ---------------------------------------------------------------- driver

using TileFn = void (*)(const Problem&, int64_t m0, int64_t n0);

// A path's tiling: up to mr rows x nr weight rows per tile; tile[r - 1] handles a tile of r rows.
struct Tiling {
  int mr, nr;
  TileFn tile[4];
};

// The tile shape changes speed only, never bits (each output element's order is the same in all).
template <int T>
Tiling tiling(int isa, int64_t M) {
  // AVX-512, 32 zmm: 16 accumulators + 8 weight vectors + 2 x. AVX2, 16 ymm: 4 activation rows
  // share each dequantized block of one weight row (8 accumulators + 4 weight vectors); a single
  // row instead runs 2 weight rows at once, so that 4 independent fma chains hide fma latency.
  if (isa == AVX512)
    return {4, 4, {tile_avx512<T, 1, 4>, tile_avx512<T, 2, 4>, tile_avx512<T, 3, 4>, tile_avx512<T, 4, 4>}};
  if (isa == AVX2 && M == 1) return {1, 2, {tile_avx2<T, 1, 2>}};
  if (isa == AVX2) return {4, 1, {tile_avx2<T, 1, 1>, tile_avx2<T, 2, 1>, tile_avx2<T, 3, 1>, tile_avx2<T, 4, 1>}};
  return {4, 4, {tile_portable<T, 1, 4>, tile_portable<T, 2, 4>, tile_portable<T, 3, 4>, tile_portable<T, 4, 4>}};
}

void run(const Problem& p, const Tiling& t) {
  parallel_tiles(p.M, p.N, t.mr, t.nr, p.row_bytes, [&](int64_t m0, int64_t n0) {
    t.tile[std::min<int64_t>(t.mr, p.M - m0) - 1](p, m0, n0);
  });
}

}  // namespace

namespace keel {

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, int64_t n, int64_t isa) {
  constexpr const char* op = "keel::gguf_mm";
  check_inputs(op, x, w, ggml_type);
  const int bb = block_bytes(ggml_type);
  const char* type_name = ggml_type == Q4_1 ? "Q4_1" : "Q8_0";
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kByte, "keel::gguf_mm: w must be uint8 ggml blocks, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "keel::gguf_mm: w must be a contiguous [N, K/32*bytes] matrix, got sizes ",
              w.sizes(), w.is_contiguous() ? "" : " (not contiguous)");
  const int64_t row_bytes = K / QK * bb;
  TORCH_CHECK(n >= 0 && w.size(0) == n && w.size(1) == row_bytes, "keel::gguf_mm: for ", type_name, " with K = ", K,
              " and n = ", n, " w must be [", n, ", ", row_bytes, "] (", bb, " bytes per block), got ", w.sizes());
  static const int best = resolve_isa(op, -1, kFloatIsas, cpu_has_float_isa);
  const int path = isa < 0 ? best : resolve_isa(op, isa, kFloatIsas, cpu_has_float_isa);

  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const Problem p{x.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, n, K, K / QK, row_bytes};
  run(p, ggml_type == Q4_1 ? tiling<Q4_1>(path, M) : tiling<Q8_0>(path, M));
  return y;
}

}  // namespace keel

namespace {

std::vector<std::string> gguf_isas() { return keel::isas(keel::kFloatIsas, keel::cpu_has_float_isa); }

}  // namespace

TORCH_LIBRARY(keel, m) {
  m.def("gguf_mm(Tensor x, Tensor w, int ggml_type, int n, int isa) -> Tensor", &keel::gguf_mm);
  m.def("gguf_isas() -> str[]", &gguf_isas);
}
