// keel::row_stats: what the sampler (engine/sampling.py) needs of each row of logits, in two passes
// over the row instead of torch's log_softmax, exp, product, sum and argmax (4-5 passes, two exps per
// element).
//
//   row_stats(logits [R, V], scores [R, V], tokens [R], isa) -> (argmax [R] int64, stats [R, 4] float64)
//     argmax[r]  the lowest id among the largest scores of row r (torch.argmax's choice)
//     stats[r] = (m, S, H, logprob), from the float32 logits x of row r:
//       m = max_j x_j;  d_j = x_j - m;  e_j = exp_le0(d_j) (expf.h)
//       S = sum_j e_j;  T = sum_j e_j * max(d_j, -86)   (the max makes a -inf logit's term 0, not NaN;
//                                                         every e_j of d_j < -86 is 0)
//       H = log S - T / S      the entropy of softmax(x) in nats, float64
//       logprob = (x_t - m) - log S, float64, at t = tokens[r], or at argmax[r] where tokens[r] < 0
//   scores may be the logits tensor itself (one pass then serves both maxima).
//   rows_finite(x [R, V]) -> [R] bool: whether every element of the row is finite (one pass, one
//   thread per row: the engine's check before it samples, sampling.row_is_finite).
//
// Pass 1 finds the maxima: lane l = j % 16 keeps its largest element in order of j (a later equal one
// does not replace it), then the lanes' largest, the lowest index among equals. Pass 2 sums: element j
// goes to float32 lane j % 16 in order of j; every 1024 elements (a block) each lane's sum is added to
// its float64 lane and restarts at +0; the 16 float64 lanes end in a fixed tree (lane l + lane l + w,
// w = 8, 4, 2, 1). e_j * max(d_j, -86) is a product then an add (-ffp-contract=off), exp_le0 has the
// same bits on every path, and AVX-512 (one zmm of 16 lanes), AVX2 (two ymm, lanes 0-7 and 8-15) and
// the portable code (16 floats) keep the same lanes: every path gives the same bits, and a row's
// results depend on its own V values only (one thread per row, never on the batch or the thread count).
// isa: 0 portable, 1 avx2, 2 avx512 (common.h kFloatIsas), -1 the best the CPU runs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "common.h"
#include "expf.h"

namespace {

using keel::exp_le0;
using keel::kExpMin;

constexpr int L = 16;            // lanes
constexpr int64_t kBlock = 1024;  // elements per float32 partial sum of the 16 lanes

struct Lanes {  // pass 1's per-lane maxima
  float v[L];
  int64_t i[L];
};

struct Sums {  // pass 2's float32 lanes of S and T within a block
  float s[L], t[L];
};

inline void init(Lanes& a) {
  for (int l = 0; l < L; ++l) a.v[l] = -std::numeric_limits<float>::infinity(), a.i[l] = l;
}

inline void max_tail(const float* x, int64_t j, int64_t n, Lanes& a) {
  for (; j < n; ++j)
    if (x[j] > a.v[j % L]) a.v[j % L] = x[j], a.i[j % L] = j;
}

inline void sum_tail(const float* x, int64_t j, int64_t end, float m, Sums& b) {
  for (; j < end; ++j) {
    const float d = x[j] - m, e = exp_le0(d);
    b.s[j % L] += e;
    b.t[j % L] += e * std::max(d, kExpMin);
  }
}

// The lanes' largest value and the lowest index holding it.
inline std::pair<float, int64_t> best(const Lanes& a) {
  int k = 0;
  for (int l = 1; l < L; ++l)
    if (a.v[l] > a.v[k] || (a.v[l] == a.v[k] && a.i[l] < a.i[k])) k = l;
  return {a.v[k], a.i[k]};
}

// The versions differ in how many elements a call takes at a time; each leaves the rest to the tails.
struct Path {
  void (*max)(const float* x, int64_t n, Lanes& a);                        // pass 1 up to n - n % 16
  void (*sum)(const float* x, int64_t j, int64_t end, float m, Sums& b);   // pass 2 over [j, end) in 16s
};

void max_portable(const float* x, int64_t n, Lanes& a) { max_tail(x, 0, n - n % L, a); }
void sum_portable(const float* x, int64_t j, int64_t end, float m, Sums& b) { sum_tail(x, j, end, m, b); }

KEEL_AVX2 void max_avx2(const float* x, int64_t n, Lanes& a) {
  __m256 v0 = _mm256_loadu_ps(a.v), v1 = _mm256_loadu_ps(a.v + 8);
  __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
  __m256i k0 = i0, k1 = i1;
  const __m256i step = _mm256_set1_epi32(L);
  for (int64_t j = 0; j + L <= n; j += L) {
    const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
    const __m256 g0 = _mm256_cmp_ps(x0, v0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(x1, v1, _CMP_GT_OQ);
    v0 = _mm256_blendv_ps(v0, x0, g0);
    v1 = _mm256_blendv_ps(v1, x1, g1);
    k0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(k0), _mm256_castsi256_ps(i0), g0));
    k1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(k1), _mm256_castsi256_ps(i1), g1));
    i0 = _mm256_add_epi32(i0, step);
    i1 = _mm256_add_epi32(i1, step);
  }
  int32_t k[L];
  _mm256_storeu_ps(a.v, v0);
  _mm256_storeu_ps(a.v + 8, v1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(k), k0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(k + 8), k1);
  for (int l = 0; l < L; ++l) a.i[l] = k[l];
}

KEEL_AVX2 void sum_avx2(const float* x, int64_t j, int64_t end, float m, Sums& b) {
  const __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(kExpMin);
  __m256 s0 = _mm256_loadu_ps(b.s), s1 = _mm256_loadu_ps(b.s + 8);
  __m256 t0 = _mm256_loadu_ps(b.t), t1 = _mm256_loadu_ps(b.t + 8);
  for (; j + L <= end; j += L) {
    const __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(x + j), vm), d1 = _mm256_sub_ps(_mm256_loadu_ps(x + j + 8), vm);
    const __m256 e0 = keel::exp_le0_avx2(d0), e1 = keel::exp_le0_avx2(d1);
    s0 = _mm256_add_ps(s0, e0);
    s1 = _mm256_add_ps(s1, e1);
    t0 = _mm256_add_ps(t0, _mm256_mul_ps(e0, _mm256_max_ps(d0, lo)));
    t1 = _mm256_add_ps(t1, _mm256_mul_ps(e1, _mm256_max_ps(d1, lo)));
  }
  _mm256_storeu_ps(b.s, s0);
  _mm256_storeu_ps(b.s + 8, s1);
  _mm256_storeu_ps(b.t, t0);
  _mm256_storeu_ps(b.t + 8, t1);
}

KEEL_AVX512 void max_avx512(const float* x, int64_t n, Lanes& a) {
  __m512 v = _mm512_loadu_ps(a.v);
  __m512i i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), k = i;
  const __m512i step = _mm512_set1_epi32(L);
  for (int64_t j = 0; j + L <= n; j += L) {
    const __m512 xj = _mm512_loadu_ps(x + j);
    const __mmask16 g = _mm512_cmp_ps_mask(xj, v, _CMP_GT_OQ);
    v = _mm512_mask_mov_ps(v, g, xj);
    k = _mm512_mask_mov_epi32(k, g, i);
    i = _mm512_add_epi32(i, step);
  }
  int32_t kk[L];
  _mm512_storeu_ps(a.v, v);
  _mm512_storeu_si512(kk, k);
  for (int l = 0; l < L; ++l) a.i[l] = kk[l];
}

KEEL_AVX512 void sum_avx512(const float* x, int64_t j, int64_t end, float m, Sums& b) {
  const __m512 vm = _mm512_set1_ps(m), lo = _mm512_set1_ps(kExpMin);
  __m512 s = _mm512_loadu_ps(b.s), t = _mm512_loadu_ps(b.t);
  for (; j + L <= end; j += L) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + j), vm);
    const __m512 e = keel::exp_le0_avx512(d);
    s = _mm512_add_ps(s, e);
    t = _mm512_add_ps(t, _mm512_mul_ps(e, _mm512_max_ps(d, lo)));
  }
  _mm512_storeu_ps(b.s, s);
  _mm512_storeu_ps(b.t, t);
}

const Path kPaths[] = {{max_portable, sum_portable}, {max_avx2, sum_avx2}, {max_avx512, sum_avx512}};

std::pair<float, int64_t> row_max(const Path& p, const float* x, int64_t n) {
  Lanes a;
  init(a);
  p.max(x, n, a);
  max_tail(x, n - n % L, n, a);
  return best(a);
}

// (S, T) of a row whose maximum is m, in the order of the header.
std::pair<double, double> row_sums(const Path& p, const float* x, int64_t n, float m) {
  double s[L] = {}, t[L] = {};
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t end = std::min(n, b0 + kBlock), simd = end - (end - b0) % L;
    Sums b = {};
    p.sum(x, b0, simd, m, b);
    sum_tail(x, simd, end, m, b);
    for (int l = 0; l < L; ++l) s[l] += b.s[l], t[l] += b.t[l];
  }
  for (int w = L / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) s[l] += s[l + w], t[l] += t[l + w];
  return {s[0], t[0]};
}

// Whether every element of x [n] is finite: x - x is +0 for those, NaN for +-inf and NaN, and a sum of
// +0s and NaNs is +0 exactly when there is no NaN (16 lanes, so the compiler vectorizes the loop
// for each target; the sum's order changes nothing here).
__attribute__((target_clones("avx512f", "avx2", "default"))) bool finite_row(const float* x, int64_t n) {
  float acc[L] = {};
  int64_t j = 0;
  for (; j + L <= n; j += L)
    for (int l = 0; l < L; ++l) acc[l] += x[j + l] - x[j + l];
  for (; j < n; ++j) acc[0] += x[j] - x[j];
  float all = 0.f;
  for (int l = 0; l < L; ++l) all += acc[l];
  return all == 0.f;
}

void check_rows(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, op, ": ", name,
              " must be a float32 CPU [R, V] matrix with contiguous rows, got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

namespace keel {

std::tuple<at::Tensor, at::Tensor> row_stats(const at::Tensor& logits, const at::Tensor& scores,
                                             const at::Tensor& tokens, int64_t isa) {
  const char* op = "keel::row_stats";
  check_rows(op, "logits", logits);
  check_rows(op, "scores", scores);
  const int64_t r = logits.size(0), v = logits.size(1);
  TORCH_CHECK(scores.sizes() == logits.sizes(), op, ": scores ", scores.sizes(), " and logits ", logits.sizes(),
              " differ in shape");
  TORCH_CHECK(v > 0 && v < (int64_t(1) << 31), op, ": V = ", v, " outside 1..2^31-1");
  TORCH_CHECK(tokens.device().is_cpu() && tokens.scalar_type() == at::kLong && tokens.dim() == 1 &&
                  tokens.is_contiguous() && tokens.size(0) == r,
              op, ": tokens must be a contiguous int64 vector of ", r, ", got ", tokens.scalar_type(), " ", tokens.sizes());
  const int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i) TORCH_CHECK(tp[i] >= -1 && tp[i] < v, op, ": token ", tp[i], " outside -1..", v - 1);
  static const int best_isa = resolve_isa(op, -1, kFloatIsas, cpu_has_float_isa);
  const Path& path = kPaths[isa < 0 ? best_isa : resolve_isa(op, isa, kFloatIsas, cpu_has_float_isa)];
  at::Tensor argmax = at::empty({r}, tokens.options());
  at::Tensor stats = at::empty({r, 4}, logits.options().dtype(at::kDouble));
  const float *lp = logits.data_ptr<float>(), *sp = scores.data_ptr<float>();
  const bool same = lp == sp && logits.stride(0) == scores.stride(0);
  int64_t* ap = argmax.data_ptr<int64_t>();
  double* out = stats.data_ptr<double>();
  at::parallel_for(0, r, std::max<int64_t>(1, (1 << 15) / v), [&](int64_t a, int64_t z) {
    for (int64_t i = a; i < z; ++i) {
      const float* x = lp + i * logits.stride(0);
      const auto [m, top] = row_max(path, x, v);
      ap[i] = same ? top : row_max(path, sp + i * scores.stride(0), v).second;
      const auto [s, t] = row_sums(path, x, v, m);
      const double log_s = std::log(s);
      const int64_t at = tp[i] < 0 ? ap[i] : tp[i];
      double* o = out + 4 * i;
      o[0] = m, o[1] = s, o[2] = log_s - t / s, o[3] = (double(x[at]) - double(m)) - log_s;
    }
  });
  return {argmax, stats};
}

at::Tensor rows_finite(const at::Tensor& x) {
  check_rows("keel::rows_finite", "x", x);
  const int64_t r = x.size(0), v = x.size(1);
  at::Tensor out = at::empty({r}, x.options().dtype(at::kBool));
  const float* xp = x.data_ptr<float>();
  bool* o = out.data_ptr<bool>();
  // A task of at least ~1M elements (~0.1 ms): below that a second thread's start and join, or its wait
  // on a loaded host, costs more than it saves.
  at::parallel_for(0, r, std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, v)), [&](int64_t a, int64_t z) {
    for (int64_t i = a; i < z; ++i) o[i] = finite_row(xp + i * x.stride(0), v);
  });
  return out;
}

}  // namespace keel

TORCH_LIBRARY_FRAGMENT(keel, m) {
  m.def("rows_finite(Tensor x) -> Tensor", &keel::rows_finite);
  m.def("row_stats(Tensor logits, Tensor scores, Tensor tokens, int isa) -> (Tensor, Tensor)", &keel::row_stats);
}
