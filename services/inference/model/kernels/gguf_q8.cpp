// Keel's CPU matmul over ggml weight blocks with 8-bit activations:  y ~= x @ dequant(w).T
//
//   x [M, K] float32 contiguous
//   w [G, K/32 * 16 * B] uint8: the file's blocks of N <= 16 G weight rows, interleaved by groups of 16
//       rows ("x16", the same bytes; blocks.pack_x16). Group g, block b is one 16 * B byte unit for
//       rows 16g..16g+15 (r = row - 16g):
//       Q4_1 (ggml type 3, B = 20): d[16] fp16, m[16] fp16, then chunks c = 0..3 of 64 bytes: at
//            4r..4r+3 row r's qs[4c..4c+3] (low nibbles: elements 4c..4c+3, high: 16+4c..16+4c+3)
//       Q8_0 (ggml type 8, B = 34): d[16] fp16, then chunks c = 0..7 of 64 bytes: at 4r..4r+3 row r's
//            qs[4c..4c+3] (elements 4c..4c+3)
//   y [M, n] float32
//
// Activations are quantized per row and 32-element block, as ggml's Q8_1 but with fp32 scales:
//   a = max_j |x_j|,  dx = a / 127,  id = dx != 0 ? 1 / dx : 0,  qx_j = round-half-even(x_j * id),
//   sx = dx * sum_j qx_j     (every operation one fp32 rounding; a block holding NaN or inf gets
//                            dx = NaN and qx = 0, so the outputs it reaches are NaN); each path
//                            quantizes with its own SIMD (the same bits as the portable loop)
// Summation order per output element (m, n), fixed by K alone: acc = +0, then for b = 0..K/32-1
//   isum = sum_j qw_j * qx_j               (exact in int32)
//   acc  = fma(dw * dx, float(isum), acc)  (dw * dx rounded once; float(isum) is exact, |isum| < 2^24)
//   acc  = fma(mw, sx, acc)                (Q4_1 only)
// and y = acc. Q4_1's w = dw * qw + mw, so the block's dot product is dw dx isum + mw sx.
// Every path computes these same integers and fp32 operations, so all give the same bits. Threads
// split (M tile, group tile) (common.h's parallel_tiles): no output depends on the batch or the thread count.
// The integer dot products: AVX-512 VNNI vpdpbusd (u8 x s8, 4 products per int32 lane; Q8_0 weights
// are signed, so the activations go in as qx + 128 and 128 * sum(w) is subtracted); AVX2 vpmaddubsw
// + vpmaddwd (Q8_0 by |w| x sign(qx, w), since maddubs saturates its int16 pairs).

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>

#include "common.h"
#include "ops.h"

namespace {

using namespace keel;

constexpr int R = 16;              // weight rows per group
constexpr int AVX2 = 1, VNNI = 2;  // the op's isa codes (0: portable)
const char* const kIsaNames[] = {"portable", "avx2", "avx512_vnni"};

constexpr int unit_bytes(int64_t type) { return R * block_bytes(type); }
constexpr int quant_offset(int type) { return type == Q4_1 ? 4 * R : 2 * R; }  // after d (and m)
constexpr int chunks(int type) { return type == Q4_1 ? 4 : 8; }

bool cpu_has(int isa) {
  if (isa == VNNI)
    return cpu_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  if (isa == AVX2) return cpu_avx2_fma_f16c();
  return isa == PORTABLE;
}

struct Problem {
  const int8_t* qx;   // [M, K] quantized activations
  const uint8_t* ux;  // [M, K] qx + 128 (as unsigned bytes)
  const float* dx;    // [M, nb] scales
  const float* sx;    // [M, nb] dx * sum qx
  const uint8_t* w;   // [G, nb * unit]
  float* y;           // [M, n]
  int64_t M, n, K, nb, G;
};

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One row's activation blocks (the order above; scalar, M * K work against the matmul's n * K).
void quantize_row(const float* x, int64_t nb, int8_t* qx, uint8_t* ux, float* dx, float* sx) {
  for (int64_t b = 0; b < nb; ++b, x += QK, qx += QK, ux += QK) {
    float a = 0.f;
    bool finite = true;
    for (int j = 0; j < QK; ++j) {
      finite &= std::isfinite(x[j]);
      a = std::max(a, std::fabs(x[j]));
    }
    const float d = finite ? a / 127.f : NAN, id = finite && d != 0.f ? 1.f / d : 0.f;
    int s = 0;
    for (int j = 0; j < QK; ++j) {
      const int q = int(std::clamp(std::nearbyint(x[j] * id), -127.f, 127.f));
      qx[j] = int8_t(q);
      ux[j] = uint8_t(q + 128);
      s += q;
    }
    dx[b] = d;
    sx[b] = d * float(s);
  }
}

// At M = 1 a tile streams its groups' blocks from memory; it prefetches the tile kPrefetchTiles
// tiles ahead (the next groups: one contiguous span), a block step's share at a time.
constexpr int kPrefetchTiles = 2;

inline void prefetch_span(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

// ---------------------------------------------------------------- portable

template <int T, int MR, int NG>
void tile_portable(const Problem& p, int64_t m0, int64_t g0) {
  constexpr int U = unit_bytes(T), Q = quant_offset(T);
  float acc[MR][NG][R] = {};
  for (int64_t b = 0; b < p.nb; ++b)
    for (int j = 0; j < NG; ++j) {
      const uint8_t* u = p.w + std::min(g0 + j, p.G - 1) * p.nb * U + b * U;
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = p.qx + (m0 + i) * p.K + b * QK;
        const float dx = p.dx[(m0 + i) * p.nb + b], sx = p.sx[(m0 + i) * p.nb + b];
        for (int r = 0; r < R; ++r) {
          int32_t s = 0;
          for (int c = 0; c < chunks(T); ++c)
            for (int t = 0; t < 4; ++t) {
              const uint8_t q = u[Q + 64 * c + 4 * r + t];
              if constexpr (T == Q4_1)
                s += int(q & 15) * x[4 * c + t] + int(q >> 4) * x[16 + 4 * c + t];
              else
                s += int(int8_t(q)) * x[4 * c + t];
            }
          float& a = acc[i][j][r];
          a = std::fma(half(u + 2 * r) * dx, float(s), a);
          if constexpr (T == Q4_1) a = std::fma(half(u + 2 * R + 2 * r), sx, a);
        }
      }
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j)
      for (int r = 0; r < R && (g0 + j) * R + r < p.n; ++r) p.y[(m0 + i) * p.n + (g0 + j) * R + r] = acc[i][j][r];
}

// ---------------------------------------------------------------- AVX2: a group is two ymm of 8 rows

#define KEEL_AVX2 __attribute__((target("avx2,fma,f16c")))

template <int T, int MR, int NG>
KEEL_AVX2 void tile_avx2(const Problem& p, int64_t m0, int64_t g0) {
  constexpr int U = unit_bytes(T), Q = quant_offset(T);
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NG][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const uint8_t* ahead = p.w + std::min(g0 + kPrefetchTiles * NG, p.G - 1) * p.nb * U;
  for (int64_t b = 0; b < p.nb; ++b)
    for (int j = 0; j < NG; ++j) {
      prefetch_span(ahead + (j * p.nb + b) * U, U);
      const uint8_t* u = p.w + std::min(g0 + j, p.G - 1) * p.nb * U + b * U;
      for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7
        __m256i is[MR];
        if constexpr (T == Q4_1) {
          // int16 pair sums stay below 8 * 2 * 15 * 127 = 30480 over the whole block
          __m256i s16[MR];
          for (int i = 0; i < MR; ++i) s16[i] = _mm256_setzero_si256();
          for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + Q + 64 * c + 32 * h));
            const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            for (int i = 0; i < MR; ++i) {
              const int8_t* x = p.qx + (m0 + i) * p.K + b * QK;
              s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(x + 4 * c))));
              s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(x + 16 + 4 * c))));
            }
          }
          for (int i = 0; i < MR; ++i) is[i] = _mm256_madd_epi16(s16[i], ones);
        } else {
          for (int i = 0; i < MR; ++i) is[i] = _mm256_setzero_si256();
          for (int c = 0; c < 8; ++c) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + Q + 64 * c + 32 * h));
            const __m256i av = _mm256_abs_epi8(v);
            for (int i = 0; i < MR; ++i) {
              const int8_t* x = p.qx + (m0 + i) * p.K + b * QK;
              const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(x + 4 * c)), v);
              is[i] = _mm256_add_epi32(is[i], _mm256_madd_epi16(_mm256_maddubs_epi16(av, sx), ones));
            }
          }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16 * h)));
        for (int i = 0; i < MR; ++i) {
          const int64_t s = (m0 + i) * p.nb + b;
          __m256& a = acc[i][j][h];
          a = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(p.dx[s])), _mm256_cvtepi32_ps(is[i]), a);
          if constexpr (T == Q4_1) {
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 2 * R + 16 * h)));
            a = _mm256_fmadd_ps(mw, _mm256_set1_ps(p.sx[s]), a);
          }
        }
      }
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j)
      for (int h = 0; h < 2; ++h) {
        const int64_t n0 = (g0 + j) * R + 8 * h;
        float* y = p.y + (m0 + i) * p.n + n0;
        if (n0 + 8 <= p.n) {
          _mm256_storeu_ps(y, acc[i][j][h]);
        } else if (n0 < p.n) {
          float tmp[8];
          _mm256_storeu_ps(tmp, acc[i][j][h]);
          std::memcpy(y, tmp, sizeof(float) * (p.n - n0));
        }
      }
}

// ---------------------------------------------------------------- AVX-512 VNNI: a group is one zmm

#define KEEL_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))

template <int T, int MR, int NG>
KEEL_VNNI void tile_vnni(const Problem& p, int64_t m0, int64_t g0) {
  constexpr int U = unit_bytes(T), Q = quant_offset(T);
  const __m512i nib = _mm512_set1_epi8(15), bias = _mm512_set1_epi8(char(0x80));
  __m512 acc[MR][NG];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* w[NG];
  for (int j = 0; j < NG; ++j) w[j] = p.w + std::min(g0 + j, p.G - 1) * p.nb * U;
  const uint8_t* ahead = p.w + std::min(g0 + kPrefetchTiles * NG, p.G - 1) * p.nb * U;
  for (int64_t b = 0; b < p.nb; ++b) {
    for (int j = 0; j < NG; ++j) prefetch_span(ahead + (j * p.nb + b) * U, U);
    __m512i is[MR][NG];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NG; ++j) is[i][j] = _mm512_setzero_si512();
    if constexpr (T == Q4_1) {
      for (int c = 0; c < 4; ++c) {
        __m512i xl[MR], xh[MR];
        for (int i = 0; i < MR; ++i) {
          const int8_t* x = p.qx + (m0 + i) * p.K + b * QK;
          xl[i] = _mm512_set1_epi32(load_i32(x + 4 * c));
          xh[i] = _mm512_set1_epi32(load_i32(x + 16 + 4 * c));
        }
        for (int j = 0; j < NG; ++j) {
          const __m512i v = _mm512_loadu_si512(w[j] + b * U + Q + 64 * c);
          const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          for (int i = 0; i < MR; ++i) {
            is[i][j] = _mm512_dpbusd_epi32(is[i][j], lo, xl[i]);
            is[i][j] = _mm512_dpbusd_epi32(is[i][j], hi, xh[i]);
          }
        }
      }
    } else {
      __m512i corr[NG];
      for (int j = 0; j < NG; ++j) corr[j] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        __m512i xu[MR];
        for (int i = 0; i < MR; ++i) xu[i] = _mm512_set1_epi32(load_i32(p.ux + (m0 + i) * p.K + b * QK + 4 * c));
        for (int j = 0; j < NG; ++j) {
          const __m512i v = _mm512_loadu_si512(w[j] + b * U + Q + 64 * c);
          corr[j] = _mm512_dpbusd_epi32(corr[j], bias, v);
          for (int i = 0; i < MR; ++i) is[i][j] = _mm512_dpbusd_epi32(is[i][j], xu[i], v);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NG; ++j) is[i][j] = _mm512_sub_epi32(is[i][j], corr[j]);
    }
    for (int j = 0; j < NG; ++j) {
      const uint8_t* u = w[j] + b * U;
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
      for (int i = 0; i < MR; ++i) {
        const int64_t s = (m0 + i) * p.nb + b;
        acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(p.dx[s])), _mm512_cvtepi32_ps(is[i][j]), acc[i][j]);
        if constexpr (T == Q4_1) {
          const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 2 * R)));
          acc[i][j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(p.sx[s]), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) {
      const int64_t n0 = (g0 + j) * R;
      if (n0 >= p.n) continue;
      const __mmask16 keep = p.n - n0 >= R ? __mmask16(0xFFFF) : __mmask16((1u << (p.n - n0)) - 1);
      _mm512_mask_storeu_ps(p.y + (m0 + i) * p.n + n0, keep, acc[i][j]);
    }
}

// ---------------------------------------------------------------- activations, SIMD
// The same operations as quantize_row, 32 lanes at a time: max |x| and the integer sum are exact in
// any order, and x * id, its rounding to nearest even and the clamp are per element; a block holding
// NaN or inf gets dx = NaN and qx = 0 as there (cvtps of NaN is 0x80000000, whose low byte is 0).

KEEL_AVX2 void quantize_row_avx2(const float* x, int64_t nb, int8_t* qx, uint8_t* ux, float* dx, float* sx) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b, x += QK, qx += QK, ux += QK) {
    __m256 v[4], m = _mm256_setzero_ps();
    int finite = 0xFF;
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      const __m256 a = _mm256_and_ps(v[i], abs_mask);
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));
      m = _mm256_max_ps(m, a);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const bool ok = finite == 0xFF;
    const float d = ok ? a / 127.f : NAN, id = ok && d != 0.f ? 1.f / d : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
      sum = _mm256_add_epi32(sum, q[i]);
    }
    const __m256i q8 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx), q8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ux), _mm256_xor_si256(q8, _mm256_set1_epi8(char(0x80))));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    dx[b] = d;
    sx[b] = d * float(_mm_cvtsi128_si32(s4));
  }
}

KEEL_VNNI void quantize_row_avx512(const float* x, int64_t nb, int8_t* qx, uint8_t* ux, float* dx, float* sx) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512 inf = _mm512_set1_ps(INFINITY), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t b = 0; b < nb; ++b, x += QK, qx += QK, ux += QK) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), abs_mask));
    const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), abs_mask));
    const bool ok = (_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) == 0xFFFF;
    const float a = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const float d = ok ? a / 127.f : NAN, id = ok && d != 0.f ? 1.f / d : 0.f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(v1, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi));
    const __m128i b0 = _mm512_cvtepi32_epi8(q0), b1 = _mm512_cvtepi32_epi8(q1);
    const __m128i flip = _mm_set1_epi8(char(0x80));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx), b0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + 16), b1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ux), _mm_xor_si128(b0, flip));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ux + 16), _mm_xor_si128(b1, flip));
    dx[b] = d;
    sx[b] = d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// ---------------------------------------------------------------- driver

using TileFn = void (*)(const Problem&, int64_t m0, int64_t g0);

struct Tiling {
  int mr, ng;
  TileFn tile[4];  // tile[r - 1]: a tile of r activation rows
};

template <int T>
Tiling tiling(int isa) {
  if (isa == VNNI) return {4, 2, {tile_vnni<T, 1, 2>, tile_vnni<T, 2, 2>, tile_vnni<T, 3, 2>, tile_vnni<T, 4, 2>}};
  if (isa == AVX2) return {4, 1, {tile_avx2<T, 1, 1>, tile_avx2<T, 2, 1>, tile_avx2<T, 3, 1>, tile_avx2<T, 4, 1>}};
  return {4, 1, {tile_portable<T, 1, 1>, tile_portable<T, 2, 1>, tile_portable<T, 3, 1>, tile_portable<T, 4, 1>}};
}

void run(const Problem& p, const Tiling& t, int type) {
  parallel_tiles(p.M, p.G, t.mr, t.ng, p.nb * unit_bytes(type), [&](int64_t m0, int64_t g0) {
    t.tile[std::min<int64_t>(t.mr, p.M - m0) - 1](p, m0, g0);
  });
}

}  // namespace

namespace keel {

at::Tensor gguf_q8_mm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, int64_t n, int64_t isa) {
  constexpr const char* op = "keel::gguf_q8_mm";
  TORCH_CHECK(block_bytes(ggml_type), op, ": unsupported ggml_type ", ggml_type, " (supported: 3 = Q4_1, 8 = Q8_0)");
  check_inputs(op, x, w);
  const int u = unit_bytes(ggml_type);
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "keel::gguf_q8_mm: w must be a contiguous uint8 [G, K/32 * 16 * bytes] matrix");
  const int64_t G = (n + R - 1) / R;
  TORCH_CHECK(n >= 0 && w.size(0) == G && w.size(1) == nb * u, "keel::gguf_q8_mm: for n = ", n, " and K = ", K,
              " w must be [", G, ", ", nb * u, "], got ", w.sizes());
  static const int best = resolve_isa(op, -1, kIsaNames, cpu_has);
  const int path = isa < 0 ? best : resolve_isa(op, isa, kIsaNames, cpu_has);

  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  std::vector<int8_t> qx(M * K);
  std::vector<uint8_t> ux(M * K);
  std::vector<float> dx(M * nb), sx(M * nb);
  const float* xp = x.data_ptr<float>();
  // On the calling thread: a parallel region of its own would add a barrier per call, which stalls
  // when another process holds a core, for work the SIMD versions do in microseconds.
  const auto quantize = path == VNNI ? quantize_row_avx512 : path == AVX2 ? quantize_row_avx2 : quantize_row;
  for (int64_t m = 0; m < M; ++m)
    quantize(xp + m * K, nb, qx.data() + m * K, ux.data() + m * K, dx.data() + m * nb, sx.data() + m * nb);
  const Problem p{qx.data(), ux.data(), dx.data(), sx.data(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, n, K, nb, G};
  if (ggml_type == Q4_1)
    run(p, tiling<Q4_1>(path), Q4_1);
  else
    run(p, tiling<Q8_0>(path), Q8_0);
  return y;
}

}  // namespace keel

namespace {

std::vector<std::string> gguf_q8_isas() { return keel::isas(kIsaNames, cpu_has); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("gguf_q8_mm(Tensor x, Tensor w, int ggml_type, int n, int isa) -> Tensor", &keel::gguf_q8_mm);
  m.def("gguf_q8_isas() -> str[]", &gguf_q8_isas);
}
