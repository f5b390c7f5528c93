// The decoder layer's small element-wise ops, fused, for float32 on x86 CPUs with AVX2.
//
// A decode step's matmuls stream the weights; between them every layer runs a handful of
// element-wise ops (two residual adds and RMSNorms, SiLU(gate) * up), and in eager PyTorch each is several
// ops, each one a dispatch plus a pass over its tensor: RMSNorm alone is pow, mean, add,
// rsqrt, mul, mul.  At batch 1 the dispatches cost more than the arithmetic; at batch 32
// the extra passes over [32, 2 x 4864] activations do.  Here each is one op and one pass
// per row, rows split over the threads only when there are enough of them to pay for it.
//
// Also here: `stream_read`, a bare read of a buffer, the rate the local roofline reports.
//
// Arithmetic follows the Hugging Face reference order: RMSNorm is w * (x * rsqrt(mean(x^2)
// + eps)) in float32, SiLU is x * sigmoid(x).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "panel_linear.h"
#include "simd_avx2.h"
#include "swiglu_op.h"

namespace {

// Rows per thread before a second thread is worth waking (one row: a batch-1 decode).
constexpr int64_t kRowGrain = 8;

// bfloat16 <-> float32 on eight lanes.  Widening is exact; narrowing rounds to nearest even
// and keeps NaN a (quiet) NaN, exactly as c10::BFloat16 does, so vector and scalar code and
// PyTorch's own bf16 ops all round alike.
using bf16 = at::BFloat16;

inline __m256 bf16_load8(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

inline __m256i bf16_bits8(__m256 v) {  // each lane's rounded bf16 bits, in its low half
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

inline __m256 bf16_round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }

inline void bf16_store8(bf16* p, __m256 v) {
  const __m256i r = bf16_bits8(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) { return bf16_load8(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) { bf16_store8(p, v); }

// The sum of a row's squares, in float32: eight independent sums (no wait on the FMA latency),
// added in a fixed order.
template <typename E>
float square_sum(const E* xr, int64_t H) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 64 <= H; j += 64)
    for (int u = 0; u < 8; ++u) {
      const __m256 v = load8(xr + j + 8 * u);
      acc[u] = _mm256_fmadd_ps(v, v, acc[u]);
    }
  for (; j + 8 <= H; j += 8) {
    const __m256 v = load8(xr + j);
    acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
  }
  // hsum8 gives each accumulator's sum in its own lane: add the eight lanes
  alignas(32) float sums[8];
  _mm256_store_ps(sums, tokenloom::hsum8(acc));
  float ss = 0.0f;
  for (float v : sums) ss += v;
  for (; j < H; ++j) ss += static_cast<float>(xr[j]) * static_cast<float>(xr[j]);
  return ss;
}

// yr = w * (xr / sqrt(mean(xr^2) + eps)) for one row of H.
inline void norm_row(const float* xr, const float* wp, float* yr, int64_t H, float eps) {
  const float inv = 1.0f / std::sqrt(square_sum(xr, H) / static_cast<float>(H) + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t j = 0;
  for (; j + 8 <= H; j += 8)
    _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_loadu_ps(wp + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), iv)));
  for (; j < H; ++j) yr[j] = wp[j] * (xr[j] * inv);
}

// bfloat16 norm_row, rounding where the reference does: the normalized row (computed in
// float32) to bf16, then w * that to bf16.
inline void norm_row(const bf16* xr, const bf16* wp, bf16* yr, int64_t H, float eps) {
  const float inv = 1.0f / std::sqrt(square_sum(xr, H) / static_cast<float>(H) + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t j = 0;
  for (; j + 8 <= H; j += 8)
    bf16_store8(yr + j, _mm256_mul_ps(bf16_load8(wp + j), bf16_round8(_mm256_mul_ps(bf16_load8(xr + j), iv))));
  for (; j < H; ++j) yr[j] = static_cast<float>(wp[j]) * static_cast<float>(bf16(static_cast<float>(xr[j]) * inv));
}

// The row-wise driver of both norms, float32 or bfloat16 (E): y = norm(x), or with a
// residual, s = x + residual (rounded to E, as the reference's add is) and y = norm(s).
template <typename E>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor& y,
               at::Tensor* sum) {
  const int64_t H = x.size(-1);
  const int64_t rows = H ? x.numel() / H : 0;
  const E* xp = x.data_ptr<E>();
  const E* rp = residual ? residual->data_ptr<E>() : nullptr;
  const E* wp = weight.data_ptr<E>();
  E* yp = y.data_ptr<E>();
  E* sp = sum ? sum->data_ptr<E>() : nullptr;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const E* xr = xp + r * H;
      if (rp) {
        E* sr = sp + r * H;
        const E* rr = rp + r * H;
        int64_t j = 0;
        for (; j + 8 <= H; j += 8) store8(sr + j, _mm256_add_ps(load8(xr + j), load8(rr + j)));
        for (; j < H; ++j) sr[j] = static_cast<float>(xr[j]) + static_cast<float>(rr[j]);
        xr = sr;
      }
      norm_row(xr, wp, yp + r * H, H, static_cast<float>(eps));
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "tokenloom_cpu::rms_norm takes float32 or bfloat16 CPU tensors");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x differ in dtype");
  TORCH_CHECK(weight.numel() == x.size(-1), "weight has ", weight.numel(), " elements, rows have ", x.size(-1));
}

void any_norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                   at::Tensor& y, at::Tensor* sum) {
  if (x.scalar_type() == at::kBFloat16)
    norm_rows<bf16>(x, residual, weight, eps, y, sum);
  else
    norm_rows<float>(x, residual, weight, eps, y, sum);
}

// y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)) for every row r of the last dimension.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  const auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  any_norm_rows(xc, nullptr, weight.contiguous(), eps, y, nullptr);
  return y;
}

// The residual stream's add and the next RMSNorm in one pass: s = x + residual,
// y = rms_norm(s); returns (y, s), s being the new residual.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual must match x");
  const auto xc = x.contiguous(), rc = residual.contiguous();
  auto y = at::empty_like(xc), s = at::empty_like(xc);
  any_norm_rows(xc, &rc, weight.contiguous(), eps, y, &s);
  return {y, s};
}

// A float32 result as the element type E stores it: unchanged, or rounded to bf16.
template <typename E>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<E, bf16>) return bf16_round8(v);
  return v;
}

// silu(gate) * up for rows of [gate | up] (I each), in float32 or bfloat16 (E); in bf16 the
// SiLU is rounded before the product, as F.silu(gate) * up rounds.
template <typename E>
void silu_rows(const E* xp, E* yp, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = r0; r < r1; ++r) {
      const E* g = xp + r * 2 * I;
      const E* u = g + I;
      E* yr = yp + r * I;
      int64_t j = 0;
      for (; j + 8 <= I; j += 8) {
        const __m256 gv = load8(g + j);
        // sigmoid(g) = 1 / (1 + e^-g); exp8 clamps, so a very negative g gives 0, not NaN
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, tokenloom::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        store8(yr + j, _mm256_mul_ps(round8<E>(_mm256_mul_ps(gv, sig)), load8(u + j)));
      }
      for (; j < I; ++j) {
        const float gj = g[j];
        yr[j] = static_cast<float>(E(gj / (1.0f + std::exp(-gj)))) * static_cast<float>(u[j]);
      }
    }
  });
}

// x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]: the SwiGLU activation on the fused
// gate/up projection's output.
at::Tensor silu_and_mul(const at::Tensor& x) {
  return tokenloom::silu_and_mul_op(x, "tokenloom_cpu::silu_and_mul",
                                    [](auto* xp, auto* yp, int64_t rows, int64_t I) { silu_rows(xp, yp, rows, I); });
}

// Rotary embedding of q [T, Hq, D] and k [T, Hk, D] (any row and head strides, such as views
// into the fused qkv output) at each token's position, HF's rotate_half layout:
//   out[i] = x[i] cos[i] - x[i + D/2] sin[i],  out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]
// with cos/sin [max_positions, D] tables.  Returns new contiguous q and k.
// One head of D = 2 * half values rotated into `out` (HF's rotate_half layout).
inline void rotate_head(const float* x, float* out, const float* c, const float* sn, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * c[i] - x2 * sn[i];
    out[i + half] = x2 * c[i + half] + x1 * sn[i + half];
  }
}

void check_rope_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t D) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos/sin must be float32");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(), "cos/sin must be [positions, D]");
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                        const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat,
              "tokenloom_cpu::rope takes float32 CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0,
              "q [T, Hq, D] and k [T, Hk, D] with unit stride in D (even)");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  check_rope_tables(cos, sin, D);
  const auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == T, "one position per token");
  const auto cc = cos.contiguous(), sc = sin.contiguous();
  auto qo = at::empty(q.sizes(), q.options());
  auto ko = at::empty(k.sizes(), k.options());
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cc.size(0);
  auto rotate = [&](const at::Tensor& x, at::Tensor& out, int64_t t, const float* c, const float* sn) {
    const float* xp = x.data_ptr<float>() + t * x.stride(0);
    float* op = out.data_ptr<float>() + t * out.stride(0);
    for (int64_t h = 0; h < x.size(1); ++h) rotate_head(xp + h * x.stride(1), op + h * D, c, sn, half);
  };
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " is outside the rotary table");
      const float* c = cc.data_ptr<float>() + pp[t] * D;
      const float* sn = sc.data_ptr<float>() + pp[t] * D;
      rotate(q, qo, t, c, sn);
      rotate(k, ko, t, c, sn);
    }
  });
  return {qo, ko};
}

// The attention block's glue between the qkv projection and attention, in one op: from the
// fused projection's output qkv [T, (Hq + 2 Hk) D] (rows may be strided), rotate q and k at
// each token's position, write the rotated k and v into the paged caches
// ([num_blocks, block_size, Hk, D], float32) at the token's slot, and return the rotated q
// [T, Hq, D].  In PyTorch this is a split, three views, the rotation and two index_copy_.
// rotate_head for bfloat16, rounding as the reference's bf16 ops do: the tables to bf16, each
// product to bf16, their sum to bf16.
inline void rotate_head(const bf16* x, bf16* out, const float* c, const float* sn, int64_t half) {
  auto r = [](float v) { return static_cast<float>(bf16(v)); };
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = r(x1 * r(c[i])) + r(-x2 * r(sn[i]));
    out[i + half] = r(x2 * r(c[i + half])) + r(x1 * r(sn[i + half]));
  }
}

template <typename E>
void rope_write_kv_rows(const at::Tensor& qkv, const int64_t* pp, const int64_t* sp, const float* cp, const float* snp,
                        int64_t max_pos, int64_t num_slots, int64_t Hq, int64_t Hk, int64_t D, at::Tensor& qo,
                        at::Tensor& k_cache, at::Tensor& v_cache) {
  const int64_t T = qkv.size(0), half = D / 2;
  const E* xp = qkv.data_ptr<E>();
  E* qp = qo.data_ptr<E>();
  E* kp = k_cache.data_ptr<E>();
  E* vp = v_cache.data_ptr<E>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " is outside the rotary table");
      TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " is outside the KV cache");
      const float* c = cp + pp[t] * D;
      const float* sn = snp + pp[t] * D;
      const E* row = xp + t * qkv.stride(0);
      for (int64_t h = 0; h < Hq; ++h) rotate_head(row + h * D, qp + (t * Hq + h) * D, c, sn, half);
      const E* k = row + Hq * D;
      for (int64_t h = 0; h < Hk; ++h) rotate_head(k + h * D, kp + (sp[t] * Hk + h) * D, c, sn, half);
      std::copy(k + Hk * D, k + 2 * Hk * D, vp + sp[t] * Hk * D);
    }
  });
}

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(qkv.device().is_cpu() && (dt == at::kFloat || dt == at::kBFloat16) && qkv.dim() == 2 &&
                  qkv.stride(1) == 1,
              "qkv must be a float32 or bfloat16 CPU [T, (Hq + 2 Hk) D] tensor with unit inner stride");
  TORCH_CHECK(k_cache.scalar_type() == dt && v_cache.scalar_type() == dt && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, Hk, D] in qkv's dtype");
  const int64_t T = qkv.size(0), Hq = num_heads, Hk = num_kv_heads, D = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == Hk && D % 2 == 0 && qkv.size(1) == (Hq + 2 * Hk) * D,
              "qkv's width must be (num_heads + 2 num_kv_heads) head_dim");
  check_rope_tables(cos, sin, D);
  const auto pos = positions.to(at::kLong).contiguous();
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == T && slots.numel() == T, "one position and one slot per token");
  const auto cc = cos.contiguous(), sc = sin.contiguous();
  auto qo = at::empty({T, Hq, D}, qkv.options());
  const int64_t max_pos = cc.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (dt == at::kBFloat16)
    rope_write_kv_rows<bf16>(qkv, pp, sp, cc.data_ptr<float>(), sc.data_ptr<float>(), max_pos, num_slots, Hq,
                                     Hk, D, qo, k_cache, v_cache);
  else
    rope_write_kv_rows<float>(qkv, pp, sp, cc.data_ptr<float>(), sc.data_ptr<float>(), max_pos, num_slots, Hq, Hk, D,
                              qo, k_cache, v_cache);
  return qo;
}

// The largest value of x[j0, j1) and where it first is, or where its first NaN is.
struct RowMax {
  float m = -INFINITY;
  int64_t at = -1;   // -1: an empty stretch
  int64_t nan = -1;  // the first NaN, or -1
};

template <typename E>
RowMax row_max(const E* x, int64_t j0, int64_t j1) {
  RowMax r;
  if (j0 >= j1) return r;
  // Four sets of eight lanes, each lane the running max of its own stride-32 subsequence and
  // where it was first seen; strictly greater replaces, so every lane keeps its first maximum.
  // Four sets, not one: each set's compare and blend wait for its previous ones, and a
  // single chain of them, not the memory, was the loop's bound.
  constexpr int kSets = 4;
  __m256 best[kSets];
  __m256i where[kSets];
  for (int a = 0; a < kSets; ++a) {
    best[a] = _mm256_set1_ps(-INFINITY);
    where[a] = _mm256_setzero_si256();
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 nan = _mm256_setzero_ps();
  const E* xs = x + j0;
  const int64_t n = j1 - j0;
  int64_t j = 0;
  const int64_t nv = n < (int64_t{1} << 31) ? n / 8 * 8 : 0;  // lane indices are int32
  const auto take = [&](int a, int64_t at) {
    const __m256 v = load8(xs + at);
    const __m256 gt = _mm256_cmp_ps(v, best[a], _CMP_GT_OQ);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best[a] = _mm256_blendv_ps(best[a], v, gt);
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(at)), lane);
    where[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where[a]), _mm256_castsi256_ps(idx), gt));
  };
  for (; j + 8 * kSets <= nv; j += 8 * kSets)
    for (int a = 0; a < kSets; ++a) take(a, j + 8 * a);
  for (; j < nv; j += 8) take(0, j);
  if (_mm256_movemask_ps(nan)) {  // rare: find the first NaN as torch does
    int64_t k = 0;
    while (!std::isnan(static_cast<float>(xs[k]))) ++k;
    r.nan = j0 + k;
    return r;
  }
  // A set that took nothing offers -inf at index 0, which loses to every value taken but an
  // all -inf row's, whose answer is index 0 anyway.
  alignas(32) float bv[8 * kSets];
  alignas(32) int32_t bi[8 * kSets];
  for (int a = 0; a < kSets; ++a) {
    _mm256_store_ps(bv + 8 * a, best[a]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bi + 8 * a), where[a]);
  }
  int64_t at = -1;
  for (int u = 0; u < 8 * kSets; ++u)
    if (j > 0 && (at < 0 || bv[u] > r.m || (bv[u] == r.m && bi[u] < at))) {
      r.m = bv[u];
      at = bi[u];
    }
  for (; j < n; ++j) {  // the tail, in order
    const float v = static_cast<float>(xs[j]);
    if (std::isnan(v)) {
      r.nan = j0 + j;
      return r;
    }
    if (at < 0 || v > r.m) {
      r.m = v;
      at = j;
    }
  }
  r.at = j0 + at;
  return r;
}

// Index of each row's largest value: greedy decoding over the vocabulary.  Same answer as
// torch.argmax: the first index on ties, and the first NaN if the row has one.  (PyTorch's
// CPU argmax scans each row one element at a time, with no vector compares; the timing is
// in docs/performance.md.)  Fewer rows than threads: each row in one stretch per thread,
// combined in order.  bfloat16 logits (a greedy decode step's, straight from the head) are
// widened as they are read: every bfloat16 is exactly a float32, so the answer is the same as
// over their float32 copy, without making one.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.size(1) > 0,
              "tokenloom_cpu::argmax_rows takes a non-empty float32 or bfloat16 [rows, n] CPU tensor");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto out = at::empty({rows}, xc.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t threads = at::get_num_threads();
  const int64_t parts = rows < threads ? std::min<int64_t>(threads, std::max<int64_t>(1, n >> 12)) : 1;
  std::vector<RowMax> part(rows * parts);
  const auto scan = [&](const auto* xp) {
    at::parallel_for(0, rows * parts, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / parts, s = i % parts;
        part[i] = row_max(xp + r * n, n * s / parts, n * (s + 1) / parts);
      }
    });
  };
  if (xc.scalar_type() == at::kBFloat16)
    scan(xc.data_ptr<bf16>());
  else
    scan(xc.data_ptr<float>());
  for (int64_t r = 0; r < rows; ++r) {
    RowMax best;
    for (int64_t s = 0; s < parts; ++s) {
      const RowMax& p = part[r * parts + s];
      if (p.nan >= 0) {
        best.at = p.nan;
        break;
      }
      if (p.at >= 0 && (best.at < 0 || p.m > best.m)) best = p;
    }
    op[r] = best.at;
  }
  return out;
}

// logits[r, j] = -inf wherever bit j of bitmask[r] is 0 (bit j: word j / 32, bit j % 32,
// least significant first -- xgrammar's layout), in place, for float32 [rows, n] logits and
// int32 [rows, ceil(n / 32)] bitmasks.  A word of all ones (the unconstrained rows, and most
// of a string's vocabulary) is skipped at the cost of one load.
at::Tensor mask_logits_(at::Tensor logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "mask_logits_: logits must be contiguous float32 [rows, n]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.size(0) == logits.size(0) &&
                  bitmask.size(1) * 32 >= logits.size(1),
              "mask_logits_: bitmask must be int32 [rows, ceil(n / 32)]");
  const at::Tensor bits = bitmask.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1), words = bits.size(1);
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  at::parallel_for(0, rows * words, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint32_t keep = bp[i];
      if (keep == 0xFFFFFFFFu) continue;
      const int64_t r = i / words, j0 = (i % words) * 32;
      float* row = lp + r * n;
      const int64_t stop = std::min<int64_t>(32, n - j0);
      if (keep == 0 && stop == 32) {
        for (int b = 0; b < 32; ++b) row[j0 + b] = -INFINITY;
        continue;
      }
      for (int64_t b = 0; b < stop; ++b)
        if (!((keep >> b) & 1u)) row[j0 + b] = -INFINITY;
    }
  });
  return logits;
}

// The sum of every byte of x (as unsigned 0..255), int64: a read of the whole buffer that the
// compiler cannot drop, and nothing written.  The local roofline (specs/microbench.py) times it
// for the rate a decode step's weight stream can reach: like the GEMMs at one row, each thread
// reads one contiguous run with 256-bit loads, prefetching it as they do
// (panel_linear.h `prefetch_stream`).  _mm256_sad_epu8 against zero adds 32 bytes into four 64-bit lanes, so
// the checksum is exact and order-free: it equals x.view(uint8).sum().
at::Tensor stream_read(const at::Tensor& x) {
  const at::Tensor xc = x.contiguous();
  const uint8_t* base = static_cast<const uint8_t*>(xc.data_ptr());
  const int64_t nbytes = static_cast<int64_t>(xc.nbytes());
  const int64_t nvec = nbytes / 32;
  // A thread only where it gets at least 256 KiB: below that waking it costs more than it reads.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nbytes >> 18));
  std::vector<int64_t> partial(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const __m256i* p = reinterpret_cast<const __m256i*>(base) + nvec * t / threads;
      const __m256i* stop = reinterpret_cast<const __m256i*>(base) + nvec * (t + 1) / threads;
      const __m256i zero = _mm256_setzero_si256();
      __m256i a0 = zero, a1 = zero, a2 = zero, a3 = zero;
      for (; p + 4 <= stop; p += 4) {  // 128 bytes, two cache lines, a step
        tokenloom::prefetch_stream(p, 128);
        a0 = _mm256_add_epi64(a0, _mm256_sad_epu8(_mm256_loadu_si256(p), zero));
        a1 = _mm256_add_epi64(a1, _mm256_sad_epu8(_mm256_loadu_si256(p + 1), zero));
        a2 = _mm256_add_epi64(a2, _mm256_sad_epu8(_mm256_loadu_si256(p + 2), zero));
        a3 = _mm256_add_epi64(a3, _mm256_sad_epu8(_mm256_loadu_si256(p + 3), zero));
      }
      for (; p < stop; ++p) a0 = _mm256_add_epi64(a0, _mm256_sad_epu8(_mm256_loadu_si256(p), zero));
      alignas(32) int64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                         _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
      partial[t] = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    }
  });
  int64_t total = 0;
  for (int64_t v : partial) total += v;
  for (int64_t b = nvec * 32; b < nbytes; ++b) total += base[b];  // the last < 32 bytes
  return at::full({}, total, xc.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("stream_read(Tensor x) -> Tensor");
  m.def("mask_logits_(Tensor(a!) logits, Tensor bitmask) -> Tensor(a!)");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rope_write_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("stream_read", &stream_read);
  m.impl("mask_logits_", &mask_logits_);
  m.impl("rope", &rope);
  m.impl("rope_write_kv", &rope_write_kv);
}
