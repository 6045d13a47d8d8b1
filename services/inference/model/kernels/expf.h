// Keel's exp for softmax-like sums, exp_le0(x) for x <= 0, shared by decode attention (layer_ops.cpp)
// and the sampler's row statistics (rowstats.cpp). Cephes' expf with fused multiply-adds:
//   NaN -> x;  x < -86 -> 0 (below 2^-124: nothing beside the max term's 1 can hold it);
//   n = rint(x * log2(e)),  r = fma(-n, C2, fma(-n, C1, x))  (C1 + C2 = ln 2, C1 exact in 9 bits),
//   y = fma(fma(P(r), r * r, r), 1) with P by Horner (fmas), exp = y * 2^n (n added to y's exponent).
// Each step one IEEE operation in a fixed order: the scalar and the SIMD versions give the same bits,
// within 1 ulp of the exact value over [-86, 0].
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define KEEL_AVX2 __attribute__((target("avx2,fma")))
#define KEEL_AVX512 __attribute__((target("avx512f,avx2,fma")))

namespace keel {

constexpr float kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f, kExpMin = -86.f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline __attribute__((always_inline)) float exp_le0(float x) {
  if (std::isnan(x)) return x;
  if (x < kExpMin) return 0.f;
  const float n = std::nearbyint(x * kLog2e);
  const float r = std::fma(-n, kC2, std::fma(-n, kC1, x));
  float y = kP[0];
  for (int k = 1; k < 6; ++k) y = std::fma(y, r, kP[k]);
  y = std::fma(y, r * r, r) + 1.f;
  int32_t bits;
  std::memcpy(&bits, &y, 4);
  bits += int32_t(n) * (1 << 23);
  std::memcpy(&y, &bits, 4);
  return y;
}

KEEL_AVX2 inline __m256 exp_le0_avx2(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kC2), _mm256_fmadd_ps(n, _mm256_set1_ps(-kC1), x));
  __m256 y = _mm256_set1_ps(kP[0]);
  for (int k = 1; k < 6; ++k) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP[k]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

KEEL_AVX512 inline __m512 exp_le0_avx512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kC2), _mm512_fmadd_ps(n, _mm512_set1_ps(-kC1), x));
  __m512 y = _mm512_set1_ps(kP[0]);
  for (int k = 1; k < 6; ++k) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP[k]));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

}  // namespace keel
