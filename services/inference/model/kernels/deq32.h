// deq32: elements 32b .. 32b+31 of a GGUF weight row dequantized to float32, every block type the
// kernels compute, bit for bit ggml's reference dequantization (the block layouts: gguf_mm.cpp's
// header). Shared by keel::gguf_mm (a tile's weights) and keel::gguf_rows (the embedding's rows).
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace keel {

struct TypeInfo {
  const char* name;
  int elems, bytes;  // per block; 0 bytes: a type this kernel does not compute
};

constexpr TypeInfo type_info(int64_t t) {
  switch (t) {
    case F32: return {"F32", 1, 4};
    case F16: return {"F16", 1, 2};
    case BF16: return {"BF16", 1, 2};
    case Q4_0: return {"Q4_0", 32, 18};
    case Q4_1: return {"Q4_1", 32, 20};
    case Q5_0: return {"Q5_0", 32, 22};
    case Q5_1: return {"Q5_1", 32, 24};
    case Q8_0: return {"Q8_0", 32, 34};
    case Q4_K: return {"Q4_K", 256, 144};
    case Q5_K: return {"Q5_K", 256, 176};
    case Q6_K: return {"Q6_K", 256, 210};
    default: return {"", 0, 0};
  }
}

// 6-bit scale and min of sub-block s of a Q4_K / Q5_K super-block's 12 scale bytes (ggml's
// get_scale_min_k4).
inline void scale_min_k4(const uint8_t* sc, int s, int& scale, int& min) {
  if (s < 4) {
    scale = sc[s] & 63;
    min = sc[s + 4] & 63;
  } else {
    scale = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
    min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
  }
}

// Elements 32b .. 32b+31 of a weight row -> w[32], every type, plain C++. Always inlined, so each
// path compiles it for its own instruction set; -ffp-contract=off keeps its multiplies and adds
// as written, so every path gets these bits.
template <int T>
__attribute__((always_inline)) inline void deq32(const uint8_t* row, int64_t b, float* w) {
  if constexpr (T == F32) {
    std::memcpy(w, row + b * 128, 128);
  } else if constexpr (T == F16) {
    for (int j = 0; j < 32; ++j) w[j] = half(row + b * 64 + 2 * j);
  } else if constexpr (T == BF16) {
    for (int j = 0; j < 32; ++j) {
      const uint32_t u = uint32_t(load_u16(row + b * 64 + 2 * j)) << 16;
      std::memcpy(w + j, &u, 4);
    }
  } else if constexpr (T == Q4_0) {
    const uint8_t* p = row + b * 18;
    const float d = half(p);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * float(int(p[2 + j] & 15) - 8);
      w[j + 16] = d * float(int(p[2 + j] >> 4) - 8);
    }
  } else if constexpr (T == Q4_1) {
    const uint8_t* p = row + b * 20;
    const float d = half(p), m = half(p + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * float(p[4 + j] & 15) + m;
      w[j + 16] = d * float(p[4 + j] >> 4) + m;
    }
  } else if constexpr (T == Q5_0 || T == Q5_1) {
    constexpr int hb = T == Q5_0 ? 2 : 4;  // qh after d (and m)
    const uint8_t* p = row + b * (T == Q5_0 ? 22 : 24);
    const float d = half(p);
    uint32_t qh;
    std::memcpy(&qh, p + hb, 4);
    for (int j = 0; j < 16; ++j) {
      const int q0 = (p[hb + 4 + j] & 15) | ((qh >> j) & 1) << 4;
      const int q1 = (p[hb + 4 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
      if constexpr (T == Q5_0) {
        w[j] = d * float(q0 - 16);
        w[j + 16] = d * float(q1 - 16);
      } else {
        const float m = half(p + 2);
        w[j] = d * float(q0) + m;
        w[j + 16] = d * float(q1) + m;
      }
    }
  } else if constexpr (T == Q8_0) {
    const uint8_t* p = row + b * 34;
    const float d = half(p);
    for (int j = 0; j < 32; ++j) w[j] = d * float(int8_t(p[2 + j]));
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const uint8_t* sb = row + b / 8 * (T == Q4_K ? 144 : 176);
    const int s = int(b % 8);
    int sc, mn;
    scale_min_k4(sb + 4, s, sc, mn);
    const float d = half(sb) * float(sc), m = half(sb + 2) * float(mn);
    const uint8_t* qs = sb + (T == Q4_K ? 16 : 48) + 32 * (s / 2);
    const int shift = 4 * (s & 1);
    for (int j = 0; j < 32; ++j) {
      int q = (qs[j] >> shift) & 15;
      if constexpr (T == Q5_K) q |= ((sb[16 + j] >> s) & 1) << 4;
      w[j] = d * float(q) - m;
    }
  } else {
    static_assert(T == Q6_K);
    const uint8_t* sb = row + b / 8 * 210;
    const int s = int(b % 8), h = s / 4, r = s % 4;
    const float d = half(sb + 208);
    const float d0 = d * float(int8_t(sb[192 + 2 * s])), d1 = d * float(int8_t(sb[192 + 2 * s + 1]));
    const uint8_t* ql = sb + 64 * h + 32 * (r % 2);
    const uint8_t* qh = sb + 128 + 32 * h;
    for (int j = 0; j < 32; ++j) {
      const int q = (((ql[j] >> (4 * (r / 2))) & 15) | ((qh[j] >> (2 * r)) & 3) << 4) - 32;
      w[j] = (j < 16 ? d0 : d1) * float(q);
    }
  }
}

}  // namespace keel
