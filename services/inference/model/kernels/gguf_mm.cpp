// Keel's CPU matmul over ggml-quantized weight blocks:  y = x @ dequant(w).T
//
//   x [M, K] float32 contiguous
//   w [N, K/E*bytes] uint8: N rows of K/E ggml blocks of E elements, little-endian, no alignment assumed
//   y [M, N] float32
//
// Block types (ggml type id, E elements, bytes), element j of a block; d, m, dmin fp16; q unsigned
// unless said; "j < 16" and "j >= 16" take the low and high nibble of the same byte qs[j % 16]:
//   F32  (0, 1, 4), F16 (1, 1, 2), BF16 (30, 1, 2): the value itself
//   Q4_0 (2, 32, 18):  d, qs[16];                w = d * (q - 8)
//   Q4_1 (3, 32, 20):  d, m, qs[16];             w = d * q + m
//   Q5_0 (6, 32, 22):  d, qh[4], qs[16];         q |= bit j of qh << 4;  w = d * (q - 16)
//   Q5_1 (7, 32, 24):  d, m, qh[4], qs[16];      q |= bit j of qh << 4;  w = d * q + m
//   Q8_0 (8, 32, 34):  d, int8 qs[32];           w = d * q
//   Q4_K (12, 256, 144): d, dmin, scales[12] (8 pairs of 6-bit scale sc_s and min m_s), qs[128];
//        sub-block s = 0..7 of 32: q = nibble (s odd: high) of qs[32 (s/2) + j];
//        w = (d * sc_s) * q - dmin * m_s
//   Q5_K (13, 256, 176): as Q4_K with qh[32] before qs: q |= bit s of qh[j] << 4
//   Q6_K (14, 256, 210): ql[128], qh[64], int8 scales[16], d; element e = 128 h + 32 r + j:
//        q = (nibble r/2 of ql[64 h + 32 (r%2) + j]) | (bits 2r, 2r+1 of qh[32 h + j]) << 4, signed
//        q - 32; w = (d * scales[e / 16]) * q
// Every w is the float32 of ggml's reference dequantization bit for bit: the products shown are
// exact in float32 (at most 24 significant bits), so the one add or subtract rounds once, as there.
// The K-quant types need K % 256 == 0; the kernel walks them 32 elements (one sub-block) at a time.
//
// Summation order, fixed by K alone and shared by every code path:
//   each output element owns 16 fp32 lanes, all starting at +0.0. For block b = 0, 1, ..., K/32-1:
//       acc[l] = fma(x[32b + l],      w[32b + l],      acc[l])      l = 0..15
//       acc[l] = fma(x[32b + l + 16], w[32b + l + 16], acc[l])
//   where w is the dequantized fp32 weight above. Then a fixed tree over the lanes:
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
#include "deq32.h"
#include "ops.h"

namespace {

using namespace keel;

constexpr int AVX2 = FLOAT_AVX2, AVX512 = FLOAT_AVX512;  // the op's isa codes (0: portable)

struct Problem {
  const float* x;    // [M, K]
  const uint8_t* w;  // [N, row_bytes]
  float* y;          // [M, N]
  int64_t M, N, K, nb, row_bytes;  // nb = K / 32 steps (32 elements each) per weight row
};

// Weight row n0 + j of a tile; past the end of N a tile recomputes row N-1 and does not store it.
inline const uint8_t* weight_row(const Problem& p, int64_t n) {
  return p.w + std::min(n, p.N - 1) * p.row_bytes;
}

// At M = 1 the kernel streams weight blocks from memory. While a tile works through its K steps it
// prefetches the tile kPrefetchTiles N-tiles ahead (NR whole rows: one contiguous span of `span`
// bytes), a step's share at a time. On the 49152x576 Q8_0 head at M = 1 (AVX-512, one thread, a
// busy host) this read 8-13 GB/s against 2-4.5 GB/s without; one tile ahead gave 7-12, four 9-12;
// in-cache shapes are unchanged.
constexpr int kPrefetchTiles = 2;

inline void prefetch_step(const uint8_t* ahead, int64_t span, int64_t nb, int64_t b) {
  for (int64_t o = b * span / nb & ~int64_t(63); o < (b + 1) * span / nb; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
}

// ---------------------------------------------------------------- portable (baseline x86-64, any CPU)

float hsum_portable(const float* a) {  // the fixed 16-lane tree
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

template <int T, int MR, int NR>
void tile_portable(const Problem& p, int64_t m0, int64_t n0) {
  float acc[MR][NR][16] = {};
  float w[NR][32];
  for (int64_t b = 0; b < p.nb; ++b) {
    for (int j = 0; j < NR; ++j) deq32<T>(weight_row(p, n0 + j), b, w[j]);
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

// Step b of a row as 4 ymm: elements 0-7, 8-15, 16-23, 24-31. Lanes 0-7 live in the accumulator for
// w[0] and w[2], lanes 8-15 in the one for w[1] and w[3]. Q4_1, Q8_0, F32, F16 and BF16 in
// intrinsics (the same operations as deq32); the other types through deq32 and a buffer.
template <int T>
KEEL_AVX2 inline void deq_avx2(const uint8_t* row, int64_t b, __m256* w) {
  if constexpr (T == Q4_1) {
    const uint8_t* p = row + b * 20;
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(p)));
    const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(p + 2)));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
    const __m256i q0 = _mm256_cvtepu8_epi32(q), q1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q));
    const __m256i nib = _mm256_set1_epi32(15);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q0, nib)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q1, nib)), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), m);
  } else if constexpr (T == Q8_0) {
    const uint8_t* p = row + b * 34;
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(p)));
    for (int k = 0; k < 4; ++k) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + 8 * k));
      w[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else if constexpr (T == F32) {
    for (int k = 0; k < 4; ++k) w[k] = _mm256_loadu_ps(reinterpret_cast<const float*>(row + b * 128) + 8 * k);
  } else if constexpr (T == F16 || T == BF16) {
    for (int k = 0; k < 4; ++k) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 64 + 16 * k));
      w[k] = T == F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  } else {
    alignas(32) float buf[32];
    deq32<T>(row, b, buf);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_load_ps(buf + 8 * k);
  }
}

template <int T, int MR, int NR>
KEEL_AVX2 void tile_avx2(const Problem& p, int64_t m0, int64_t n0) {
  const uint8_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = weight_row(p, n0 + j);
  __m256 lo[MR][NR], hi[MR][NR];  // lanes 0-7 and 8-15
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
  const uint8_t* ahead = p.w + (n0 + kPrefetchTiles * NR) * p.row_bytes;
  for (int64_t b = 0; b < p.nb; ++b) {
    prefetch_step(ahead, NR * p.row_bytes, p.nb, b);
    __m256 wv[NR][4];
    for (int j = 0; j < NR; ++j) deq_avx2<T>(w[j], b, wv[j]);
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

// Step b of a row: elements 0-15 (lo) and 16-31 (hi); as deq_avx2.
template <int T>
KEEL_AVX512 inline void deq_avx512(const uint8_t* row, int64_t b, __m512& lo, __m512& hi) {
  if constexpr (T == Q4_1) {
    const uint8_t* p = row + b * 20;
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(p)));
    const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_u16(p + 2)));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)));
    lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), m);
    hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m);
  } else if constexpr (T == Q8_0) {
    const uint8_t* p = row + b * 34;
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(p)));
    const __m128i* q = reinterpret_cast<const __m128i*>(p + 2);
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else if constexpr (T == F32) {
    lo = _mm512_loadu_ps(reinterpret_cast<const float*>(row + b * 128));
    hi = _mm512_loadu_ps(reinterpret_cast<const float*>(row + b * 128) + 16);
  } else if constexpr (T == F16 || T == BF16) {
    const __m256i* h = reinterpret_cast<const __m256i*>(row + b * 64);
    const __m256i h0 = _mm256_loadu_si256(h), h1 = _mm256_loadu_si256(h + 1);
    if constexpr (T == F16) {
      lo = _mm512_cvtph_ps(h0);
      hi = _mm512_cvtph_ps(h1);
    } else {
      lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16));
      hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16));
    }
  } else {
    alignas(64) float buf[32];
    deq32<T>(row, b, buf);
    lo = _mm512_load_ps(buf);
    hi = _mm512_load_ps(buf + 16);
  }
}

template <int T, int MR, int NR>
KEEL_AVX512 void tile_avx512(const Problem& p, int64_t m0, int64_t n0) {
  const uint8_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = weight_row(p, n0 + j);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* ahead = p.w + (n0 + kPrefetchTiles * NR) * p.row_bytes;
  for (int64_t b = 0; b < p.nb; ++b) {
    prefetch_step(ahead, NR * p.row_bytes, p.nb, b);
    __m512 wl[NR], wh[NR];
    for (int j = 0; j < NR; ++j) deq_avx512<T>(w[j], b, wl[j], wh[j]);
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
  const TypeInfo t = type_info(ggml_type);
  TORCH_CHECK(t.bytes, op, ": unsupported ggml_type ", ggml_type, " (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, "
              "Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  check_inputs(op, x, w);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % t.elems == 0, op, ": K = ", K, " is not a multiple of ", t.name, "'s block of ", t.elems);
  TORCH_CHECK(w.scalar_type() == at::kByte, op, ": w must be uint8 ggml blocks, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), op, ": w must be a contiguous [N, K/E*bytes] matrix, got sizes ",
              w.sizes(), w.is_contiguous() ? "" : " (not contiguous)");
  const int64_t row_bytes = K / t.elems * t.bytes;
  TORCH_CHECK(n >= 0 && w.size(0) == n && w.size(1) == row_bytes, op, ": for ", t.name, " with K = ", K, " and n = ", n,
              " w must be [", n, ", ", row_bytes, "] (", t.bytes, " bytes per ", t.elems, "), got ", w.sizes());
  static const int best = resolve_isa(op, -1, kFloatIsas, cpu_has_float_isa);
  const int path = isa < 0 ? best : resolve_isa(op, isa, kFloatIsas, cpu_has_float_isa);

  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const Problem p{x.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, n, K, K / QK, row_bytes};
  switch (ggml_type) {
    case F32: run(p, tiling<F32>(path, M)); break;
    case F16: run(p, tiling<F16>(path, M)); break;
    case BF16: run(p, tiling<BF16>(path, M)); break;
    case Q4_0: run(p, tiling<Q4_0>(path, M)); break;
    case Q4_1: run(p, tiling<Q4_1>(path, M)); break;
    case Q5_0: run(p, tiling<Q5_0>(path, M)); break;
    case Q5_1: run(p, tiling<Q5_1>(path, M)); break;
    case Q8_0: run(p, tiling<Q8_0>(path, M)); break;
    case Q4_K: run(p, tiling<Q4_K>(path, M)); break;
    case Q5_K: run(p, tiling<Q5_K>(path, M)); break;
    default: run(p, tiling<Q6_K>(path, M)); break;
  }
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
