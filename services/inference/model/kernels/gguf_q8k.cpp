// Keel's CPU matmul over ggml K-quant super-blocks with 8-bit activations:  y ~= x @ dequant(w).T
//
//   x [M, K] float32 contiguous, K % 256 == 0
//   w [G, K/256 * U] uint8: the file's super-blocks of N <= 16 G weight rows, regrouped by 16 rows
//       ("x16k", the same values; superblocks.pack_x16k). Group g, super-block B is one U-byte unit for
//       rows 16g..16g+15 (r = row - 16g). A "chunk" is 64 bytes holding 4 bytes of each row at 4r..4r+3.
//       Q4_K (type 12, U = 2368): d[16] fp16, dmin[16] fp16, sc[8][16] u8, m[8][16] u8 (the 6-bit scales
//            and mins of sub-blocks s = 0..7, unpacked), then for p = 0..3 chunks c = 0..7 of row r's
//            qs[32p + 4c..+3] (low nibbles: elements 4c..4c+3 of sub-block 2p; high: of sub-block 2p+1)
//       Q5_K (type 13, U = 2880): as Q4_K with, before the qs chunks, chunks c = 0..7 of row r's
//            qh[4c..4c+3] (bit s: the fifth bit of that element of sub-block s)
//       Q6_K (type 14, U = 3360): d[16] fp16, scales[16][16] int8 (scale t of 16 elements, row r), then for
//            h, r' = 0..1 chunks c = 0..7 of row r's ql[64h + 32r' + 4c..+3] (low nibbles: sub-block
//            4h + r', high: 4h + r' + 2), then for h = 0..1 chunks c = 0..7 of row r's qh[32h + 4c..+3]
//            (bits 2r..2r+1: the top two bits of sub-block 4h + r); q - 32 is the signed quant
//   y [M, n] float32
//
// Activations: qx, dx, sx per row and 32-element block (q8act.h, Scale::fp32); block b = 8B + s is sub-block s of
// super-block B. Summation order per output element (m, n), fixed by K alone: acc = +0, then for
// b = 0..K/32-1 in order:
//   Q4_K, Q5_K: isum = sum_j q_j qx_j (exact in int32);  acc = fma((d * sc_s) * dx, float(isum), acc)
//               acc = fma(-(dmin * m_s), sx, acc)
//   Q6_K, for k = 0, 1 (elements 16k..16k+15): isum = sum_j (q_j - 32) qx_j;
//               acc = fma((d * scales_{2s+k}) * dx, float(isum), acc)
// d * sc, dmin * m and d * scales are exact in fp32; (.) * dx rounds once; float(isum) is exact
// (|isum| < 2^18). Every path computes these same integers and fp32 operations, so all give the same
// bits; threads split (M tile, group) (common.h's parallel_tiles), so no output depends on the batch
// or the thread count. Integer dot products: AVX-512 VNNI vpdpbusd (u8 weights x s8 activations), AVX2
// vpmaddubsw + vpmaddwd (pair sums below 2 * 63 * 127: no saturation); Q6_K's -32 is applied as
// 32 * (the sum of qx over the 16 elements), computed once per activation row.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common.h"
#include "ops.h"
#include "q8act.h"

namespace {

using namespace keel;
using namespace keel::q8;

constexpr int R = 16;  // weight rows per group

constexpr int unit_bytes(int64_t t) { return t == Q4_K ? 2368 : t == Q5_K ? 2880 : t == Q6_K ? 3360 : 0; }
constexpr int QH5 = 320;                                      // Q5_K's qh chunks
constexpr int qs_offset(int t) { return t == Q4_K ? 320 : 832; }  // Q4_K / Q5_K's qs chunks
constexpr int QL6 = 288, QH6 = 2336;                          // Q6_K's ql and qh chunks

struct Problem {
  const int8_t* qx;    // [M, K] quantized activations
  const float* dx;     // [M, K/32]
  const float* sx;     // [M, K/32]
  const int32_t* s16;  // [M, K/16] sums of qx over 16 elements (Q6_K)
  const uint8_t* w;    // [G, K/256 * U]
  float* y;            // [M, n]
  int64_t M, n, K, nb, ns, G;  // nb = K/32 blocks, ns = K/256 super-blocks
};

// At M = 1 a tile streams its group's units from memory. Sub-block s of a unit prefetches the s-th
// eighth of the same unit two groups ahead: issued as one burst per unit, its 37-53 lines overflow
// the core's miss buffers and are dropped, and the step waits on memory.
inline void prefetch_eighth(const uint8_t* unit, int U, int s) {
  for (int o = s * U / 8 / 64 * 64; o < (s + 1) * U / 8; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(unit + o), _MM_HINT_T0);
}

// The unsigned quant of element j of sub-block s, row r, in unit u (the layout above).
template <int T>
int quant(const uint8_t* u, int s, int r, int j) {
  const int at = 64 * (j / 4) + 4 * r + j % 4;  // chunk j/4, row r's byte j%4
  if constexpr (T == Q6_K) {
    const int h = s / 4, rr = s % 4;
    const int lo = u[QL6 + 512 * (2 * h + rr % 2) + at] >> (4 * (rr / 2)) & 15;
    return lo | (u[QH6 + 512 * h + at] >> (2 * rr) & 3) << 4;
  } else {
    int q = u[qs_offset(T) + 512 * (s / 2) + at] >> (4 * (s % 2)) & 15;
    if constexpr (T == Q5_K) q |= (u[QH5 + at] >> s & 1) << 4;
    return q;
  }
}

// ---------------------------------------------------------------- portable

template <int T, int MR>
void tile_portable(const Problem& p, int64_t m0, int64_t g) {
  constexpr int U = unit_bytes(T);
  float acc[MR][R] = {};
  for (int64_t B = 0; B < p.ns; ++B) {
    const uint8_t* u = p.w + (g * p.ns + B) * U;
    for (int i = 0; i < MR; ++i)
      for (int s = 0; s < 8; ++s) {
        const int64_t m = m0 + i, b = 8 * B + s;
        const int8_t* x = p.qx + m * p.K + 32 * b;
        const float dx = p.dx[m * p.nb + b];
        for (int r = 0; r < R; ++r) {
          float& a = acc[i][r];
          if constexpr (T == Q6_K) {
            for (int k = 0; k < 2; ++k) {
              int32_t is = 0;
              for (int j = 16 * k; j < 16 * k + 16; ++j) is += (quant<T>(u, s, r, j) - 32) * x[j];
              a = std::fma(half(u + 2 * r) * float(int8_t(u[32 + 16 * (2 * s + k) + r])) * dx, float(is), a);
            }
          } else {
            int32_t is = 0;
            for (int j = 0; j < 32; ++j) is += quant<T>(u, s, r, j) * x[j];
            a = std::fma(half(u + 2 * r) * float(u[64 + 16 * s + r]) * dx, float(is), a);
            a = std::fma(-(half(u + 32 + 2 * r) * float(u[192 + 16 * s + r])), p.sx[m * p.nb + b], a);
          }
        }
      }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R && g * R + r < p.n; ++r) p.y[(m0 + i) * p.n + g * R + r] = acc[i][r];
}

// ---------------------------------------------------------------- AVX-512 VNNI: a group is one zmm

// The 64-byte chunk c of sub-block s's quants (one byte per row and element), unsigned.
template <int T>
KEEL_VNNI inline __m512i chunk_vnni(const uint8_t* u, int s, int c) {
  const __m512i nib = _mm512_set1_epi8(15);
  const int at = 64 * c;
  if constexpr (T == Q6_K) {
    const int h = s / 4, rr = s % 4;
    const __m512i l = _mm512_loadu_si512(u + QL6 + 512 * (2 * h + rr % 2) + at);
    const __m512i t = _mm512_loadu_si512(u + QH6 + 512 * h + at);
    const __m512i lo = _mm512_and_si512(_mm512_srl_epi16(l, _mm_cvtsi32_si128(4 * (rr / 2))), nib);
    const __m512i hi = _mm512_and_si512(_mm512_srl_epi16(t, _mm_cvtsi32_si128(2 * rr)), _mm512_set1_epi8(3));
    return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
  } else {
    const __m512i v = _mm512_loadu_si512(u + qs_offset(T) + 512 * (s / 2) + at);
    __m512i q = _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(4 * (s % 2))), nib);
    if constexpr (T == Q5_K) {
      const __m512i h = _mm512_loadu_si512(u + QH5 + at);
      const __m512i bit = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(s)), _mm512_set1_epi8(1));
      q = _mm512_or_si512(q, _mm512_slli_epi16(bit, 4));
    }
    return q;
  }
}

template <int T, int MR>
KEEL_VNNI void tile_vnni(const Problem& p, int64_t m0, int64_t g) {
  constexpr int U = unit_bytes(T);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* ahead = p.w + std::min(g + 2, p.G - 1) * p.ns * U;  // two groups ahead (M = 1 streams)
  for (int64_t B = 0; B < p.ns; ++B) {
    const uint8_t* u = p.w + (g * p.ns + B) * U;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
    for (int s = 0; s < 8; ++s) {
      const int64_t b = 8 * B + s;
      prefetch_eighth(ahead + B * U, U, s);
      __m512i is[MR][2];  // Q6_K: elements 0-15 and 16-31; else one sum in [0]
      for (int i = 0; i < MR; ++i) is[i][0] = is[i][1] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i q = chunk_vnni<T>(u, s, c);
        const int k = T == Q6_K ? c / 4 : 0;
        for (int i = 0; i < MR; ++i) {
          const __m512i xv = _mm512_set1_epi32(load_i32(p.qx + (m0 + i) * p.K + 32 * b + 4 * c));
          is[i][k] = _mm512_dpbusd_epi32(is[i][k], q, xv);
        }
      }
      if constexpr (T == Q6_K) {
        for (int k = 0; k < 2; ++k) {
          const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 32 + 16 * (2 * s + k)));
          const __m512 dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
          for (int i = 0; i < MR; ++i) {
            const int64_t m = m0 + i;
            const __m512i t = _mm512_sub_epi32(is[i][k], _mm512_set1_epi32(32 * p.s16[m * (p.K / 16) + 2 * b + k]));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(p.dx[m * p.nb + b])), _mm512_cvtepi32_ps(t),
                                     acc[i]);
          }
        }
      } else {
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32)));
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 64 + 16 * s));
        const __m128i mn = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 192 + 16 * s));
        const __m512 dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
        const __m512 mw = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
        for (int i = 0; i < MR; ++i) {
          const int64_t m = m0 + i;
          acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(p.dx[m * p.nb + b])), _mm512_cvtepi32_ps(is[i][0]),
                                   acc[i]);
          acc[i] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(p.sx[m * p.nb + b]), acc[i]);
        }
      }
    }
  }
  const int64_t n0 = g * R;
  const __mmask16 keep = p.n - n0 >= R ? __mmask16(0xFFFF) : __mmask16((1u << (p.n - n0)) - 1);
  for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(p.y + (m0 + i) * p.n + n0, keep, acc[i]);
}

// ---------------------------------------------------------------- AVX2: a group is two ymm of 8 rows

KEEL_AVX2 inline __m256i load(const uint8_t* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); }

// Rows 8h..8h+7 of chunk_vnni's chunk: 32 bytes.
template <int T>
KEEL_AVX2 inline __m256i chunk_avx2(const uint8_t* u, int s, int c, int h8) {
  const __m256i nib = _mm256_set1_epi8(15);
  const int at = 64 * c + 32 * h8;
  if constexpr (T == Q6_K) {
    const int h = s / 4, rr = s % 4;
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(load(u + QL6 + 512 * (2 * h + rr % 2) + at),
                                                         _mm_cvtsi32_si128(4 * (rr / 2))), nib);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(load(u + QH6 + 512 * h + at), _mm_cvtsi32_si128(2 * rr)),
                                        _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  } else {
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(load(u + qs_offset(T) + 512 * (s / 2) + at),
                                                  _mm_cvtsi32_si128(4 * (s % 2))), nib);
    if constexpr (T == Q5_K) {
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(load(u + QH5 + at), _mm_cvtsi32_si128(s)),
                                           _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
  }
}

template <int T, int MR>
KEEL_AVX2 void tile_avx2(const Problem& p, int64_t m0, int64_t g) {
  constexpr int U = unit_bytes(T);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const uint8_t* ahead = p.w + std::min(g + 2, p.G - 1) * p.ns * U;
  for (int64_t B = 0; B < p.ns; ++B) {
    const uint8_t* u = p.w + (g * p.ns + B) * U;
    for (int h8 = 0; h8 < 2; ++h8) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16 * h8)));
      for (int s = 0; s < 8; ++s) {
        const int64_t b = 8 * B + s;
        if (h8 == 0) prefetch_eighth(ahead + B * U, U, s);
        __m256i is[MR][2];
        for (int i = 0; i < MR; ++i) is[i][0] = is[i][1] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i q = chunk_avx2<T>(u, s, c, h8);
          const int k = T == Q6_K ? c / 4 : 0;
          for (int i = 0; i < MR; ++i) {
            const __m256i xv = _mm256_set1_epi32(load_i32(p.qx + (m0 + i) * p.K + 32 * b + 4 * c));
            is[i][k] = _mm256_add_epi32(is[i][k], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones));
          }
        }
        if constexpr (T == Q6_K) {
          for (int k = 0; k < 2; ++k) {
            const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 32 + 16 * (2 * s + k) + 8 * h8));
            const __m256 dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            for (int i = 0; i < MR; ++i) {
              const int64_t m = m0 + i;
              const __m256i t = _mm256_sub_epi32(is[i][k], _mm256_set1_epi32(32 * p.s16[m * (p.K / 16) + 2 * b + k]));
              acc[i][h8] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(p.dx[m * p.nb + b])),
                                           _mm256_cvtepi32_ps(t), acc[i][h8]);
            }
          }
        } else {
          const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 32 + 16 * h8)));
          const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 64 + 16 * s + 8 * h8));
          const __m128i mn = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 192 + 16 * s + 8 * h8));
          const __m256 dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
          const __m256 mw = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)));
          for (int i = 0; i < MR; ++i) {
            const int64_t m = m0 + i;
            acc[i][h8] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(p.dx[m * p.nb + b])),
                                         _mm256_cvtepi32_ps(is[i][0]), acc[i][h8]);
            acc[i][h8] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(p.sx[m * p.nb + b]), acc[i][h8]);
          }
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int h8 = 0; h8 < 2; ++h8) {
      const int64_t n0 = g * R + 8 * h8;
      float tmp[8];
      _mm256_storeu_ps(tmp, acc[i][h8]);
      for (int r = 0; r < 8 && n0 + r < p.n; ++r) p.y[(m0 + i) * p.n + n0 + r] = tmp[r];
    }
}

// ---------------------------------------------------------------- driver

using TileFn = void (*)(const Problem&, int64_t m0, int64_t g);

template <int T>
void run(const Problem& p, int path) {
  static constexpr TileFn kTiles[3][4] = {
      {tile_portable<T, 1>, tile_portable<T, 2>, tile_portable<T, 3>, tile_portable<T, 4>},
      {tile_avx2<T, 1>, tile_avx2<T, 2>, tile_avx2<T, 3>, tile_avx2<T, 4>},
      {tile_vnni<T, 1>, tile_vnni<T, 2>, tile_vnni<T, 3>, tile_vnni<T, 4>}};
  const TileFn* tiles = kTiles[path];
  parallel_tiles(p.M, p.G, 4, 1, p.ns * unit_bytes(T), [&](int64_t m0, int64_t g) {
    tiles[std::min<int64_t>(4, p.M - m0) - 1](p, m0, g);
  });
}

}  // namespace

namespace keel {

at::Tensor gguf_q8k_mm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, int64_t n, int64_t isa) {
  constexpr const char* op = "keel::gguf_q8k_mm";
  TORCH_CHECK(unit_bytes(ggml_type), op, ": unsupported ggml_type ", ggml_type, " (supported: 12 = Q4_K, 13 = Q5_K, "
              "14 = Q6_K)");
  check_inputs(op, x, w);
  const int64_t M = x.size(0), K = x.size(1), ns = K / 256, G = (n + R - 1) / R;
  TORCH_CHECK(K % 256 == 0, op, ": K = ", K, " is not a multiple of the super-block of 256");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              op, ": w must be a contiguous uint8 [G, K/256 * U] matrix");
  TORCH_CHECK(n >= 0 && w.size(0) == G && w.size(1) == ns * unit_bytes(ggml_type), op, ": for n = ", n, " and K = ", K,
              " w must be [", G, ", ", ns * unit_bytes(ggml_type), "], got ", w.sizes());
  static const int best = resolve_isa(op, -1, kIsaNames, cpu_has);
  const int path = isa < 0 ? best : resolve_isa(op, isa, kIsaNames, cpu_has);

  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const Activations a(x, path, Scale::fp32);
  const std::vector<int32_t> s16 = ggml_type == Q6_K ? a.sums(16) : std::vector<int32_t>();
  const Problem p{a.qx.data(), a.dx.data(), a.sx.data(), s16.data(), w.data_ptr<uint8_t>(), y.data_ptr<float>(),
                  M, n, K, K / QK, ns, G};
  if (ggml_type == Q4_K)
    run<Q4_K>(p, path);
  else if (ggml_type == Q5_K)
    run<Q5_K>(p, path);
  else
    run<Q6_K>(p, path);
  return y;
}

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("gguf_q8k_mm(Tensor x, Tensor w, int ggml_type, int n, int isa) -> Tensor", &keel::gguf_q8k_mm);
}
