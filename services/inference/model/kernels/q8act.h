// What Keel's two integer kernels (gguf_q8.cpp: Q4_0..Q8_0; gguf_q8k.cpp: the K-quants) share: their
// isa codes, and the activations quantized per row and 32-element block, in one of two scales:
//   Scale::ggml (gguf_q8.cpp), ggml's quantize_row_q8_0 / q8_1 (ggml-cpu/arch/x86/quants.c, the x86
//     paths llama.cpp runs):  a = max_j |x_j|,  d = a / 127 (fp32),  qx_j = round-half-even(x_j * id)
//     with id = 127 / a,  dx = h(d),  sx = h(d * sum_j qx_j) (the fp32 d), h(v) = fp16(v) where fp16
//     holds it (|v| < 65520), else v: the scales the dot products use are the fp16 ones ggml stores
//     in its block_q8_0 / block_q8_1 (read back as fp32), except that one fp16 cannot hold stays fp32
//     where ggml's turns inf. id = 0 (so qx = 0) where dx is 0 (a < 127 * 2^-25): those blocks add
//     0 either way.
//   Scale::fp32 (gguf_q8k.cpp; ggml's Q8_K keeps an fp32 d too, over 256-element blocks):
//     a = max_j |x_j|,  dx = a / 127,  id = dx != 0 ? 1 / dx : 0,  qx_j = round-half-even(x_j * id),
//     sx = dx * sum_j qx_j.
// Every operation is one fp32 rounding, fp16() rounds to nearest even (subnormals included); qx is
// clamped to [-127, 127]. A block holding NaN or inf gets dx = NaN and qx = 0, so the outputs it
// reaches are NaN. Each path quantizes with its own SIMD (the same bits as the portable loop); the
// per-block scalars (d, id, dx, sx) are computed by the same scalar code on every path.
#pragma once

#include <immintrin.h>

#include <cmath>

#include "common.h"

namespace keel::q8 {

constexpr int AVX2 = 1, VNNI = 2;  // the ops' isa codes (0: portable)
inline const char* const kIsaNames[] = {"portable", "avx2", "avx512_vnni"};

#define KEEL_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KEEL_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))

inline bool cpu_has(int isa) {
  if (isa == VNNI)
    return cpu_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  if (isa == AVX2) return cpu_avx2_fma_f16c();
  return isa == PORTABLE;
}

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

enum class Scale { fp32, ggml };

// v rounded to fp16 (nearest even, as ggml's GGML_FP32_TO_FP16) and back; v itself when fp16 would
// overflow (or v is NaN).
inline float fp16_round(float v) {
  if (!(std::fabs(v) < 65520.f)) return v;
  return c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(v));
}

// A block's scalars from its max |x| `a` (the header's formulas): the factor id and the stored dx.
struct BlockScale {
  float d, id, dx;
  bool half;
  BlockScale(float a, bool finite, Scale scale) : half(scale == Scale::ggml) {
    d = finite ? a / 127.f : NAN;
    if (half) {
      dx = fp16_round(d);
      id = finite && dx != 0.f ? 127.f / a : 0.f;
    } else {
      dx = d;
      id = finite && d != 0.f ? 1.f / d : 0.f;
    }
  }
  float sx(int sum) const { return half ? fp16_round(d * float(sum)) : d * float(sum); }
};

// One row's activation blocks (the order above; scalar, M * K work against the matmul's n * K).
inline void quantize_row(const float* x, int64_t nb, int8_t* qx, uint8_t* ux, float* dx, float* sx, Scale scale) {
  for (int64_t b = 0; b < nb; ++b, x += QK, qx += QK, ux += QK) {
    float a = 0.f;
    bool finite = true;
    for (int j = 0; j < QK; ++j) {
      finite &= std::isfinite(x[j]);
      a = std::max(a, std::fabs(x[j]));
    }
    const BlockScale bs(a, finite, scale);
    int s = 0;
    for (int j = 0; j < QK; ++j) {
      const int q = int(std::clamp(std::nearbyint(x[j] * bs.id), -127.f, 127.f));
      qx[j] = int8_t(q);
      ux[j] = uint8_t(q + 128);
      s += q;
    }
    dx[b] = bs.dx;
    sx[b] = bs.sx(s);
  }
}

// ---------------------------------------------------------------- activations, SIMD
// The same operations as quantize_row, 32 lanes at a time: max |x| and the integer sum are exact in
// any order, and x * id, its rounding to nearest even and the clamp are per element; a block holding
// NaN or inf gets dx = NaN and qx = 0 as there (cvtps of NaN is 0x80000000, whose low byte is 0).

KEEL_AVX2 inline void quantize_row_avx2(const float* x, int64_t nb, int8_t* qx, uint8_t* ux, float* dx, float* sx,
                                       Scale scale) {
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
    const BlockScale bs(a, finite == 0xFF, scale);
    const __m256 vid = _mm256_set1_ps(bs.id);
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
    dx[b] = bs.dx;
    sx[b] = bs.sx(_mm_cvtsi128_si32(s4));
  }
}

KEEL_VNNI inline void quantize_row_avx512(const float* x, int64_t nb, int8_t* qx, uint8_t* ux, float* dx, float* sx,
                                         Scale scale) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512 inf = _mm512_set1_ps(INFINITY), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t b = 0; b < nb; ++b, x += QK, qx += QK, ux += QK) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), abs_mask));
    const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), abs_mask));
    const bool ok = (_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) == 0xFFFF;
    const float a = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const BlockScale bs(a, ok, scale);
    const __m512 vid = _mm512_set1_ps(bs.id);
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
    dx[b] = bs.dx;
    sx[b] = bs.sx(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// x [M, K] quantized on `path`'s code; on the calling thread: a parallel region of its own would
// add a barrier per call, which stalls when another process holds a core, for work the SIMD
// versions do in microseconds.
struct Activations {
  std::vector<int8_t> qx;   // [M, K]
  std::vector<uint8_t> ux;  // [M, K] qx + 128 (as unsigned bytes)
  std::vector<float> dx;    // [M, K/32] scales
  std::vector<float> sx;    // [M, K/32] d * sum qx (Scale::ggml: rounded to fp16)

  Activations(const at::Tensor& x, int path, Scale scale) {
    const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
    qx.resize(M * K), ux.resize(M * K), dx.resize(M * nb), sx.resize(M * nb);
    const float* xp = x.data_ptr<float>();
    const auto quantize = path == VNNI ? quantize_row_avx512 : path == AVX2 ? quantize_row_avx2 : quantize_row;
    for (int64_t m = 0; m < M; ++m)
      quantize(xp + m * K, nb, qx.data() + m * K, ux.data() + m * K, dx.data() + m * nb, sx.data() + m * nb, scale);
  }

  // The integer sums of qx over each run of `width` elements, in order (exact in int32): what a
  // kernel subtracts for weights stored with an offset (Q4_0's 8, Q5_0's 16, Q6_K's 32).
  std::vector<int32_t> sums(int width) const {
    std::vector<int32_t> out(qx.size() / width);
    for (size_t e = 0; e < out.size(); ++e) {
      int32_t s = 0;
      for (int j = 0; j < width; ++j) s += qx[width * e + j];
      out[e] = s;
    }
    return out;
  }
};

}  // namespace keel::q8
