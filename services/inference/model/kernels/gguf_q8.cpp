// Keel's CPU matmul over ggml weight blocks with 8-bit activations:  y ~= x @ dequant(w).T
//
//   x [M, K] float32 contiguous
//   w [G, K/32 * 16 * B] uint8: the file's blocks of N <= 16 G weight rows, interleaved by groups of 16
//       rows ("x16", the same bytes; blocks.pack_x16). Group g, block b is one 16 * B byte unit for
//       rows 16g..16g+15 (r = row - 16g): the 16 rows' d (fp16), for Q4_1 / Q5_1 their m, then 64-byte
//       chunks each holding 4 bytes of every row at 4r..4r+3:
//       Q4_0 (type 2, B = 18), Q4_1 (3, 20): chunks c = 0..3 of row r's qs[4c..4c+3] (low nibbles:
//            elements 4c..4c+3, high: 16+4c..16+4c+3)
//       Q5_0 (type 6, B = 22), Q5_1 (7, 24): one chunk of row r's qh (bit e: the fifth bit of element
//            e), then the qs chunks as Q4_0
//       Q8_0 (type 8, B = 34): chunks c = 0..7 of row r's int8 qs[4c..4c+3] (elements 4c..4c+3)
//   y [M, n] float32
//
// Activations: qx, dx, sx per row and 32-element block, as ggml's block_q8_0 / block_q8_1 (q8act.h,
// Scale::ggml: dx and sx are fp16 values).
// Summation order per output element (m, n), fixed by K alone: acc = +0, then for b = 0..K/32-1
//   isum = sum_j (qw_j - o) * qx_j         (exact in int32; o = 8 for Q4_0, 16 for Q5_0, else 0)
//   acc  = fma(dw * dx, float(isum), acc)  (dw * dx rounded once; float(isum) is exact, |isum| < 2^24)
//   acc  = fma(mw, sx, acc)                (Q4_1, Q5_1)
// and y = acc: w = dw * (qw - o) (+ mw), so the block's dot product is dw dx isum (+ mw sx).
// Every path computes these same integers and fp32 operations, so all give the same bits. Threads
// split (M tile, group tile) as common.h's parallel_tiles: no output depends on the batch or the thread
// count. keel::gguf_q8_mm_many multiplies one x by several weights (a layer's q, k, v) with one
// quantization of x and one parallel region over all their tiles, each tile as in a call of its own.
// The integer dot products: AVX-512 VNNI vpdpbusd (u8 x s8, 4 products per int32 lane; Q8_0 weights
// are signed, so the activations go in as qx + 128 and 128 * sum(w) is subtracted); AVX2 vpmaddubsw
// + vpmaddwd (Q8_0 by |w| x sign(qx, w), since maddubs saturates its int16 pairs). The offset o is
// applied as o * (the block's sum of qx), computed once per activation row.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>

#include "common.h"
#include "ops.h"
#include "q8act.h"

namespace {

using namespace keel;
using namespace keel::q8;

constexpr int R = 16;              // weight rows per group

constexpr int unit_bytes(int64_t type) { return R * block_bytes(type); }
constexpr bool has_min(int t) { return t == Q4_1 || t == Q5_1; }
constexpr bool fifth_bit(int t) { return t == Q5_0 || t == Q5_1; }
constexpr int offset(int t) { return t == Q4_0 ? 8 : t == Q5_0 ? 16 : 0; }
constexpr int qh_offset(int t) { return (has_min(t) ? 4 : 2) * R; }                  // after d (and m)
constexpr int quant_offset(int t) { return qh_offset(t) + (fifth_bit(t) ? 64 : 0); }  // after qh
constexpr int chunks(int t) { return t == Q8_0 ? 8 : 4; }

struct Problem {
  const int8_t* qx;   // [M, K] quantized activations
  const uint8_t* ux;  // [M, K] qx + 128 (as unsigned bytes)
  const float* dx;    // [M, nb] scales
  const float* sx;    // [M, nb] fp16(d * sum qx)
  const int32_t* sq;  // [M, nb] sum qx (Q4_0, Q5_0)
  const uint8_t* w;   // [G, nb * unit]
  float* y;           // [M, n]
  int64_t M, n, K, nb, G;
};

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
          uint32_t qh = 0;
          if constexpr (fifth_bit(T)) std::memcpy(&qh, u + qh_offset(T) + 4 * r, 4);
          for (int c = 0; c < chunks(T); ++c)
            for (int t = 0; t < 4; ++t) {
              const uint8_t q = u[Q + 64 * c + 4 * r + t];
              if constexpr (T == Q8_0) {
                s += int(int8_t(q)) * x[4 * c + t];
              } else {
                const int e = 4 * c + t;  // and e + 16
                const int lo = (q & 15) | (qh >> e & 1) << 4, hi = (q >> 4) | (qh >> (e + 16) & 1) << 4;
                s += lo * x[e] + hi * x[e + 16];
              }
            }
          if constexpr (offset(T) != 0) s -= offset(T) * p.sq[(m0 + i) * p.nb + b];
          float& a = acc[i][j][r];
          a = std::fma(half(u + 2 * r) * dx, float(s), a);
          if constexpr (has_min(T)) a = std::fma(half(u + 2 * R + 2 * r), sx, a);
        }
      }
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j)
      for (int r = 0; r < R && (g0 + j) * R + r < p.n; ++r) p.y[(m0 + i) * p.n + (g0 + j) * R + r] = acc[i][j][r];
}

// ---------------------------------------------------------------- AVX2: a group is two ymm of 8 rows

// 16 in each byte of a row's lane whose element's fifth bit is set: byte t of row r's 4 bytes is
// element e + t, whose bit is bit e + t of the row's qh (one int32 lane per row).
KEEL_AVX2 inline __m256i fifth_avx2(__m256i qh, int e) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                          0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
  const __m256i bits = _mm256_set1_epi32(0x08040201);
  const __m256i t = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(e)), spread), bits);
  return _mm256_and_si256(_mm256_cmpeq_epi8(t, bits), _mm256_set1_epi8(16));
}

// The bytes of a row's lane whose element's fifth bit is set, as a mask: byte t of row r's 4 bytes
// is element e + t (e = 4c: low nibbles, 16 + 4c: high), whose bit is bit (e + t) % 8 of byte e / 8
// of the row's qh. `spread` (one shuffle per byte of qh, shared by two chunks) puts that byte in all
// four of the row's bytes; a test against bit t (+4 for odd c) of each picks the element's bit.
KEEL_VNNI inline __m512i spread_vnni(__m512i qh, int k) {  // byte k of each row's qh in all 4 of its bytes
  const int b = 0x01010101 * k;
  return _mm512_shuffle_epi8(qh, _mm512_broadcast_i32x4(_mm_setr_epi32(b, 0x04040404 + b, 0x08080808 + b,
                                                                       0x0C0C0C0C + b)));
}

KEEL_VNNI inline __mmask64 fifth_vnni(__m512i spread, int e) {
  return _mm512_test_epi8_mask(spread, _mm512_set1_epi32(int(0x08040201u << (e % 8))));
}

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
        if constexpr (T == Q4_0 || T == Q4_1) {
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
        } else if constexpr (fifth_bit(T)) {
          // 5-bit quants: int16 pair sums up to 2 * 31 * 127, widened to int32 per chunk
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + qh_offset(T) + 32 * h));
          for (int i = 0; i < MR; ++i) is[i] = _mm256_setzero_si256();
          for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + Q + 64 * c + 32 * h));
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, nib), fifth_avx2(qh, 4 * c));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), fifth_avx2(qh, 16 + 4 * c));
            for (int i = 0; i < MR; ++i) {
              const int8_t* x = p.qx + (m0 + i) * p.K + b * QK;
              is[i] = _mm256_add_epi32(is[i], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(x + 4 * c))), ones));
              is[i] = _mm256_add_epi32(is[i], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(x + 16 + 4 * c))), ones));
            }
          }
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
        if constexpr (offset(T) != 0)
          for (int i = 0; i < MR; ++i)
            is[i] = _mm256_sub_epi32(is[i], _mm256_set1_epi32(offset(T) * p.sq[(m0 + i) * p.nb + b]));
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16 * h)));
        for (int i = 0; i < MR; ++i) {
          const int64_t s = (m0 + i) * p.nb + b;
          __m256& a = acc[i][j][h];
          a = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(p.dx[s])), _mm256_cvtepi32_ps(is[i]), a);
          if constexpr (has_min(T)) {
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
    if constexpr (T != Q8_0) {
      __m512i qh[NG], spread[NG][2];  // spread[j][0]: qh byte c / 2 (low nibbles), [1]: byte 2 + c / 2
      if constexpr (fifth_bit(T))
        for (int j = 0; j < NG; ++j) qh[j] = _mm512_loadu_si512(w[j] + b * U + qh_offset(T));
      for (int c = 0; c < 4; ++c) {
        if constexpr (fifth_bit(T))
          if (c % 2 == 0)
            for (int j = 0; j < NG; ++j) {
              spread[j][0] = spread_vnni(qh[j], c / 2);
              spread[j][1] = spread_vnni(qh[j], 2 + c / 2);
            }
        __m512i xl[MR], xh[MR];
        for (int i = 0; i < MR; ++i) {
          const int8_t* x = p.qx + (m0 + i) * p.K + b * QK;
          xl[i] = _mm512_set1_epi32(load_i32(x + 4 * c));
          xh[i] = _mm512_set1_epi32(load_i32(x + 16 + 4 * c));
        }
        for (int j = 0; j < NG; ++j) {
          const __m512i v = _mm512_loadu_si512(w[j] + b * U + Q + 64 * c);
          __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          if constexpr (fifth_bit(T)) {
            const __m512i sixteen = _mm512_set1_epi8(16);
            lo = _mm512_mask_add_epi8(lo, fifth_vnni(spread[j][0], 4 * c), lo, sixteen);
            hi = _mm512_mask_add_epi8(hi, fifth_vnni(spread[j][1], 16 + 4 * c), hi, sixteen);
          }
          for (int i = 0; i < MR; ++i) {
            is[i][j] = _mm512_dpbusd_epi32(is[i][j], lo, xl[i]);
            is[i][j] = _mm512_dpbusd_epi32(is[i][j], hi, xh[i]);
          }
        }
      }
      if constexpr (offset(T) != 0)
        for (int i = 0; i < MR; ++i) {
          const __m512i o = _mm512_set1_epi32(offset(T) * p.sq[(m0 + i) * p.nb + b]);
          for (int j = 0; j < NG; ++j) is[i][j] = _mm512_sub_epi32(is[i][j], o);
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
        if constexpr (has_min(T)) {
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

Tiling tiling_of(int64_t type, int path) {
  switch (type) {
    case Q4_0: return tiling<Q4_0>(path);
    case Q4_1: return tiling<Q4_1>(path);
    case Q5_0: return tiling<Q5_0>(path);
    case Q5_1: return tiling<Q5_1>(path);
    default: return tiling<Q8_0>(path);
  }
}

// Several weights of one x in one parallel region: the tiles of weight i (parallel_tiles' numbering)
// follow those of weights before it, and threads split the whole list. Each tile is the one a call
// for that weight alone runs, so every output element has its bits from that call.
void run(const std::vector<Problem>& ps, const std::vector<Tiling>& ts, const std::vector<int64_t>& types) {
  const int64_t M = ps[0].M;
  std::vector<int64_t> first{0};  // first[i]: weight i's first tile
  int64_t grain = 1 << 30;
  for (size_t i = 0; i < ps.size(); ++i) {
    const int64_t mt = (M + ts[i].mr - 1) / ts[i].mr, bytes = ts[i].ng * ps[i].nb * unit_bytes(types[i]);
    first.push_back(first.back() + mt * ((ps[i].G + ts[i].ng - 1) / ts[i].ng));
    grain = std::min(grain, std::max<int64_t>(1, (32 << 10) / bytes) * mt);  // as parallel_tiles
  }
  at::parallel_for(0, first.back(), grain, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    for (int64_t k = begin; k < end; ++k) {
      while (k >= first[i + 1]) ++i;
      const Tiling& t = ts[i];
      const int64_t mt = (M + t.mr - 1) / t.mr, local = k - first[i], m0 = local % mt * t.mr;
      t.tile[std::min<int64_t>(t.mr, M - m0) - 1](ps[i], m0, local / mt * t.ng);
    }
  });
}

}  // namespace

namespace keel {

std::vector<at::Tensor> gguf_q8_mm_many(const at::Tensor& x, at::TensorList w, at::IntArrayRef ggml_types,
                                        at::IntArrayRef n, int64_t isa) {
  constexpr const char* op = "keel::gguf_q8_mm";
  TORCH_CHECK(!w.empty() && ggml_types.size() == w.size() && n.size() == w.size(), op,
              ": one ggml_type and one n per weight");
  static const int best = resolve_isa(op, -1, kIsaNames, cpu_has);
  const int path = isa < 0 ? best : resolve_isa(op, isa, kIsaNames, cpu_has);
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  bool offset = false;
  for (size_t i = 0; i < w.size(); ++i) {
    TORCH_CHECK(block_bytes(ggml_types[i]), op, ": unsupported ggml_type ", ggml_types[i],
                " (supported: 2 = Q4_0, 3 = Q4_1, 6 = Q5_0, 7 = Q5_1, 8 = Q8_0)");
    check_inputs(op, x, w[i]);
    TORCH_CHECK(w[i].scalar_type() == at::kByte && w[i].dim() == 2 && w[i].is_contiguous(),
                op, ": w must be a contiguous uint8 [G, K/32 * 16 * bytes] matrix");
    const int64_t G = (n[i] + R - 1) / R, u = unit_bytes(ggml_types[i]);
    TORCH_CHECK(n[i] >= 0 && w[i].size(0) == G && w[i].size(1) == nb * u, op, ": for n = ", n[i], " and K = ", K,
                " w must be [", G, ", ", nb * u, "], got ", w[i].sizes());
    offset |= ggml_types[i] == Q4_0 || ggml_types[i] == Q5_0;
  }
  std::vector<at::Tensor> ys;
  for (int64_t width : n) ys.push_back(at::empty({M, width}, x.options()));
  std::vector<Problem> ps;
  std::vector<Tiling> ts;
  std::vector<int64_t> types;
  if (M == 0) return ys;
  const Activations a(x, path, Scale::ggml);
  const std::vector<int32_t> sq = offset ? a.sums(QK) : std::vector<int32_t>();
  for (size_t i = 0; i < w.size(); ++i) {
    if (n[i] == 0) continue;
    ps.push_back({a.qx.data(), a.ux.data(), a.dx.data(), a.sx.data(), sq.data(), w[i].data_ptr<uint8_t>(),
                  ys[i].data_ptr<float>(), M, n[i], K, nb, (n[i] + R - 1) / R});
    ts.push_back(tiling_of(ggml_types[i], path));
    types.push_back(ggml_types[i]);
  }
  if (!ps.empty()) run(ps, ts, types);
  return ys;
}

at::Tensor gguf_q8_mm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, int64_t n, int64_t isa) {
  return gguf_q8_mm_many(x, {w}, {ggml_type}, {n}, isa)[0];
}

}  // namespace keel

namespace {

std::vector<std::string> gguf_q8_isas() { return keel::isas(kIsaNames, cpu_has); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("gguf_q8_mm(Tensor x, Tensor w, int ggml_type, int n, int isa) -> Tensor", &keel::gguf_q8_mm);
  m.def("gguf_q8_mm_many(Tensor x, Tensor[] w, int[] ggml_types, int[] n, int isa) -> Tensor[]",
        &keel::gguf_q8_mm_many);
  m.def("gguf_q8_isas() -> str[]", &gguf_q8_isas);
}
