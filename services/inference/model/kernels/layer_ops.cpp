// Keel's CPU ops for the work between the GGUF matmuls of a block-format step (forward.py): each
// replaces a chain of a dozen aten calls on tensors of a few hundred floats, where the dispatches,
// not the arithmetic, were the cost (bench/profile_decode.py).
//
//   rms_norm(x [N, E], w [E], eps) -> y [N, E]
//       y_nj = w_j * (x_nj * r_n),  r_n = 1 / sqrt(ss_n / E + eps),  ss_n = sum_j x_nj^2
//   rope_store(q [N, H*D], k [N, KV*D], v [N, KV*D], cos [N, D], sin [N, D], slots [N],
//              keys [KV, S, D], values [KV, S, D]) -> q' [N, H*D]
//       the rotary embedding of transformers' Llama (rotate_half: the halves of D), on q and k:
//         x'_j = x_j * cos_j - x_{j+D/2} * sin_j   (j <  D/2)
//         x'_j = x_j * cos_j + x_{j-D/2} * sin_j   (j >= D/2)
//       (the torch formula's three roundings: x * cos, rotate_half(x) * sin, their sum); the rotated
//       keys and the values go to the pool at flat positions slots[n] (keys[h, slots[n]] = k'[n, h]);
//       returns the rotated queries
//   decode_attention_(out [*, H*D], rows [B], q [*, H*D], keys [KV, S, D], values [KV, S, D],
//                     table [B, W], lengths [B], block_tokens, scale, isa)
//       for each row b, query token t = rows[b], head h (KV head h / G, G = H / KV):
//         s_p = scale * (q[t, h] . k_p)  for the row's positions p < lengths[b], where position p
//               lies at flat slot table[b, p / block_tokens] * block_tokens + p % block_tokens
//         out[t, h] = sum_p softmax(s)_p * v_p
//
// float32 throughout; q, k, v, out may be row views (any row stride, contiguous columns).
// Fixed summation orders: a dot product or square sum over a length L keeps 16 partial sums
// (element j in lane j % 16, in order of j) combined by a fixed tree; softmax's sum and the value sum
// run along p in order. Softmax's exp is Keel's own (exp_le0, expf.h: the same operations on every
// path, so SIMD and scalar lanes give the same bits; within 1 ulp of the exact value over [-86, 0]). Each row (and head) is computed by one thread from its own data only, so no
// result depends on the batch, the padding of the table, the other rows or the thread count. The
// norm and rotary are compiled for AVX-512, AVX2 and baseline x86-64 (target_clones: the loader picks
// one from the CPU); attention has hand-written AVX-512 and AVX2 versions beside the portable one
// (isa: 0 portable, 1 avx2, 2 avx512, -1 the best the CPU runs). The lanes give every width the same
// bits (no contraction: -ffp-contract=off).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "common.h"
#include "expf.h"
#include "ops.h"

namespace {

using keel::PORTABLE;
constexpr int L = 16;  // partial sums of a reduction

#define KEEL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define KEEL_INLINE inline __attribute__((always_inline))  // compiled into each clone that calls it

KEEL_INLINE float tree(float (&acc)[L]) {
  for (int w = L / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

KEEL_INLINE float dot(const float* a, const float* b, int64_t n) {
  float acc[L] = {};
  int64_t j = 0;
  for (; j + L <= n; j += L)
    for (int l = 0; l < L; ++l) acc[l] += a[j + l] * b[j + l];
  for (; j < n; ++j) acc[j % L] += a[j] * b[j];
  return tree(acc);
}

// x' of one head of D (see the header) written to y.
KEEL_INLINE void rope_head(const float* x, const float* c, const float* s, float* y, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; ++j) y[j] = x[j] * c[j] + (-x[j + h]) * s[j];
  for (int64_t j = h; j < d; ++j) y[j] = x[j] * c[j] + x[j - h] * s[j];
}

// y = w * (x * r) for one row of E.
KEEL_CLONES void norm_row(const float* x, const float* w, float* y, int64_t e, float eps) {
  const float r = 1.f / std::sqrt(dot(x, x, e) / float(e) + eps);
  for (int64_t j = 0; j < e; ++j) y[j] = w[j] * (x[j] * r);
}

// One token: its h query heads rotated into qo, its kv key heads rotated into the pool at slot
// (head j at kd + (j * s + slot) * d), its value heads copied there.
KEEL_CLONES void rope_token(const float* q, const float* k, const float* v, const float* c, const float* sn,
                            float* qo, float* kd, float* vd, int64_t slot, int64_t h, int64_t kv, int64_t d,
                            int64_t s) {
  for (int64_t j = 0; j < h; ++j) rope_head(q + j * d, c, sn, qo + j * d, d);
  for (int64_t j = 0; j < kv; ++j) {
    rope_head(k + j * d, c, sn, kd + (j * s + slot) * d, d);
    std::copy(v + j * d, v + (j + 1) * d, vd + (j * s + slot) * d);
  }
}

// One row's KV head (a unit): its g query heads q [g, D] (rows D apart) over the row's len
// positions, whose flat slots are slot[0..len-1], into o [g, D]; score [g * len] is scratch.
// score[i, p] = scale * dot(q_i, k_p), then weigh_values. The versions differ in the scores only:
// the SIMD ones (D a multiple of 16) keep a dot's 16 lanes in one zmm (AVX-512) or two ymm (AVX2,
// lanes 0-7 and 8-15), added by the portable code's tree.
struct Unit {
  const float *q, *keys, *values;
  const int64_t* slot;
  int64_t len, g, d;
  float scale;
  float *score, *o;
};

// exp_le0 (expf.h): the same bits on every path.
using keel::exp_le0;

// s[p] = exp_le0(s[p] - top) for p < len, returning their sum in order of p; each version's SIMD
// width at a time, the tail by the scalar code.
using ExpRowFn = float (*)(float* s, int64_t len, float top);

KEEL_INLINE float exp_tail(float* s, int64_t p, int64_t len, float top, float sum) {
  for (; p < len; ++p) sum += (s[p] = exp_le0(s[p] - top));
  return sum;
}

float exp_row_portable(float* s, int64_t len, float top) { return exp_tail(s, 0, len, top, 0.f); }

KEEL_AVX2 float exp_row_avx2(float* s, int64_t len, float top) {
  const __m256 vtop = _mm256_set1_ps(top);
  float sum = 0.f;
  int64_t p = 0;
  for (; p + 8 <= len; p += 8) {
    const __m256 y = keel::exp_le0_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + p), vtop));
    _mm256_storeu_ps(s + p, y);
    float e[8];
    _mm256_storeu_ps(e, y);
    for (int l = 0; l < 8; ++l) sum += e[l];
  }
  return exp_tail(s, p, len, top, sum);
}

KEEL_AVX512 float exp_row_avx512(float* s, int64_t len, float top) {
  const __m512 vtop = _mm512_set1_ps(top);
  float sum = 0.f;
  int64_t p = 0;
  for (; p + 16 <= len; p += 16) {
    const __m512 y = keel::exp_le0_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + p), vtop));
    _mm512_storeu_ps(s + p, y);
    float e[16];
    _mm512_storeu_ps(e, y);
    for (int l = 0; l < 16; ++l) sum += e[l];
  }
  return exp_tail(s, p, len, top, sum);
}

// The steps after the scores, shared by every version (inlined into each, so the compiler
// vectorizes the element-wise value sum for that version's width; element-wise, the bits are
// those of any width): softmax along each of the g rows of score [g, len] (top = max,
// e_p = exp_le0(s_p - top) by the version's exp_row, their sum in order of p, then e_p / sum), then
// o_i = sum_p score[i, p] * v_p in order of p, from +0.
KEEL_INLINE void weigh_values(const Unit& u, ExpRowFn exp_row) {
  for (int64_t i = 0; i < u.g; ++i) {
    float* si = u.score + i * u.len;
    float top = -INFINITY;
    for (int64_t p = 0; p < u.len; ++p) top = std::max(top, si[p]);
    const float sum = exp_row(si, u.len, top);
    for (int64_t p = 0; p < u.len; ++p) si[p] = si[p] / sum;
  }
  std::fill(u.o, u.o + u.g * u.d, 0.f);
  for (int64_t p = 0; p < u.len; ++p) {
    const float* __restrict v = u.values + u.slot[p] * u.d;
    for (int64_t i = 0; i < u.g; ++i) {
      const float w = u.score[i * u.len + p];
      float* __restrict o = u.o + i * u.d;
      for (int64_t j = 0; j < u.d; ++j) o[j] += w * v[j];
    }
  }
}

void attend_portable(const Unit& u) {
  for (int64_t p = 0; p < u.len; ++p)
    for (int64_t i = 0; i < u.g; ++i) u.score[i * u.len + p] = u.scale * dot(u.q + i * u.d, u.keys + u.slot[p] * u.d, u.d);
  weigh_values(u, exp_row_portable);
}

// The tree's last three levels on lanes 0-7 (each already lane l + lane l + 8): l + 4, l + 2, l + 1.
KEEL_AVX2 inline float tree8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

KEEL_AVX2 void attend_avx2(const Unit& u) {  // D a multiple of 16
  for (int64_t p = 0; p < u.len; ++p) {
    const float* k = u.keys + u.slot[p] * u.d;
    for (int64_t i = 0; i < u.g; ++i) {
      const float* q = u.q + i * u.d;
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (int64_t j = 0; j < u.d; j += 16) {
        lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j)));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(k + j + 8)));
      }
      u.score[i * u.len + p] = u.scale * tree8(_mm256_add_ps(lo, hi));
    }
  }
  weigh_values(u, exp_row_avx2);
}

KEEL_AVX512 void attend_avx512(const Unit& u) {  // D a multiple of 16
  for (int64_t p = 0; p < u.len; ++p) {
    const float* k = u.keys + u.slot[p] * u.d;
    for (int64_t i = 0; i < u.g; ++i) {
      const float* q = u.q + i * u.d;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < u.d; j += 16)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + j), _mm512_loadu_ps(k + j)));
      const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
      u.score[i * u.len + p] = u.scale * tree8(_mm256_add_ps(_mm512_castps512_ps256(acc), high));
    }
  }
  weigh_values(u, exp_row_avx512);
}

using AttendFn = void (*)(const Unit&);

const AttendFn kAttend[] = {attend_portable, attend_avx2, attend_avx512};  // by isa code (common.h kFloatIsas)

void check_f32(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got sizes ", t.sizes());
  TORCH_CHECK(t.stride(dim - 1) == 1, op, ": ", name, "'s last dimension must be contiguous");
}

void check_index(const char* op, const char* name, const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() &&
                  t.size(0) == n,
              op, ": ", name, " must be a contiguous int64 vector of ", n, ", got ", t.scalar_type(), " ", t.sizes());
}

// Rows of work in one parallel_for task: about `target` multiply-adds each, at least one row.
int64_t grain(int64_t cost_per_row, int64_t target = 1 << 15) {
  return std::max<int64_t>(1, target / std::max<int64_t>(1, cost_per_row));
}

}  // namespace

namespace keel {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32("keel::rms_norm", "x", x, 2);
  check_f32("keel::rms_norm", "w", w, 1);
  const int64_t n = x.size(0), e = x.size(1);
  TORCH_CHECK(w.size(0) == e, "keel::rms_norm: w has ", w.size(0), " elements for rows of ", e);
  at::Tensor y = at::empty({n, e}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, n, grain(e), [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) norm_row(xp + i * xs, wp, yp + i * e, e, float(eps));
  });
  return y;
}

at::Tensor rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& keys, const at::Tensor& values) {
  const char* op = "keel::rope_store";
  const std::pair<const char*, const at::Tensor*> mats[] = {{"q", &q}, {"k", &k}, {"v", &v}, {"cos", &cos}, {"sin", &sin}};
  for (const auto& [name, t] : mats) check_f32(op, name, *t, 2);
  check_f32(op, "keys", keys, 3);
  check_f32(op, "values", values, 3);
  const int64_t n = q.size(0), kv = keys.size(0), s = keys.size(1), d = keys.size(2);
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && values.sizes() == keys.sizes(), op,
              ": keys and values must be contiguous [KV, S, D] of one shape");
  TORCH_CHECK(d % 2 == 0 && cos.size(1) == d && sin.size(1) == d && cos.size(0) == n && sin.size(0) == n, op,
              ": cos and sin must be [N, D] with D even, the pool's head size");
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && k.size(1) == kv * d && v.size(1) == kv * d && q.size(1) % d == 0,
              op, ": q [N, H*D], k and v [N, KV*D] must agree with the pool's KV = ", kv, " and D = ", d);
  check_index(op, "slots", slots, n);
  const int64_t h = q.size(1) / d;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < s, op, ": slot ", sp[i], " outside the pool's ", s);
  at::Tensor out = at::empty({n, h * d}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *qo = out.data_ptr<float>(), *kd = keys.data_ptr<float>(), *vd = values.data_ptr<float>();
  at::parallel_for(0, n, grain((h + 2 * kv) * d), [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i)
      rope_token(qp + i * q.stride(0), kp + i * k.stride(0), vp + i * v.stride(0), cp + i * cos.stride(0),
                 snp + i * sin.stride(0), qo + i * h * d, kd, vd, sp[i], h, kv, d, s);
  });
  return out;
}

void decode_attention_(const at::Tensor& out, const at::Tensor& rows, const at::Tensor& q, const at::Tensor& keys,
                       const at::Tensor& values, const at::Tensor& table, const at::Tensor& lengths,
                       int64_t block_tokens, double scale, int64_t isa) {
  const char* op = "keel::decode_attention_";
  check_f32(op, "out", out, 2);
  check_f32(op, "q", q, 2);
  check_f32(op, "keys", keys, 3);
  check_f32(op, "values", values, 3);
  const int64_t kv = keys.size(0), s = keys.size(1), d = keys.size(2), hd = q.size(1), h = hd / d;
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && values.sizes() == keys.sizes(), op,
              ": keys and values must be contiguous [KV, S, D] of one shape");
  TORCH_CHECK(hd % d == 0 && h % kv == 0 && out.size(1) == hd, op, ": q and out must be [*, H*D] with H a multiple of KV");
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.dim() == 2 && table.is_contiguous(),
              op, ": table must be a contiguous int64 [B, W]");
  const int64_t nb = table.size(0), w = table.size(1), g = h / kv;
  check_index(op, "rows", rows, nb);
  check_index(op, "lengths", lengths, nb);
  TORCH_CHECK(block_tokens > 0 && s % block_tokens == 0, op, ": the pool's S = ", s, " is not whole blocks of ", block_tokens);
  const int64_t *rp = rows.data_ptr<int64_t>(), *lp = lengths.data_ptr<int64_t>(), *tp = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < nb; ++b) {
    TORCH_CHECK(rp[b] >= 0 && rp[b] < q.size(0) && rp[b] < out.size(0), op, ": row ", rp[b], " outside q or out");
    TORCH_CHECK(lp[b] > 0 && lp[b] <= w * block_tokens, op, ": length ", lp[b], " outside 1..", w * block_tokens);
    for (int64_t i = 0; i < (lp[b] + block_tokens - 1) / block_tokens; ++i)
      TORCH_CHECK(tp[b * w + i] >= 0 && tp[b * w + i] < s / block_tokens, op, ": block ", tp[b * w + i], " outside the pool");
  }
  const float *qp = q.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  float* o = out.data_ptr<float>();
  int64_t longest = 0;
  for (int64_t b = 0; b < nb; ++b) longest = std::max(longest, lp[b]);
  // One task: one (row, KV head) unit. slots: each row's flat slots, the same for every KV head.
  std::vector<int64_t> slots(nb * longest);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t p = 0; p < lp[b]; ++p) slots[b * longest + p] = tp[b * w + p / block_tokens] * block_tokens + p % block_tokens;
  static const int best = keel::resolve_isa(op, -1, keel::kFloatIsas, keel::cpu_has_float_isa);
  const int path = isa < 0 ? best : keel::resolve_isa(op, isa, keel::kFloatIsas, keel::cpu_has_float_isa);
  const AttendFn attend = d % 16 ? attend_portable : kAttend[path];  // the SIMD versions take D in 16s
  at::parallel_for(0, nb * kv, grain(2 * g * longest * d), [&](int64_t a, int64_t z) {
    std::vector<float> score(g * longest);
    for (int64_t u = a; u < z; ++u) {
      const int64_t b = u / kv, hk = u % kv;
      attend({qp + rp[b] * q.stride(0) + hk * g * d, kp + hk * s * d, vp + hk * s * d, slots.data() + b * longest,
              lp[b], g, d, float(scale), score.data(), o + rp[b] * out.stride(0) + hk * g * d});
    }
  });
}

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &keel::rms_norm);
  m.def("rope_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor slots, Tensor(a!) keys, "
        "Tensor(b!) values) -> Tensor", &keel::rope_store);
  m.def("decode_attention_(Tensor(a!) out, Tensor rows, Tensor q, Tensor keys, Tensor values, Tensor table, "
        "Tensor lengths, int block_tokens, float scale, int isa) -> ()", &keel::decode_attention_);
}
