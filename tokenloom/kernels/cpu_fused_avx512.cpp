// SiLU(gate) * up on sixteen lanes, for x86 CPUs with AVX-512: cpu_fused.cpp's `silu_and_mul`
// (same arithmetic, same order, same roundings: the two agree bit for bit wherever that one
// is vectorized, every row length a multiple of 8, but for denormal values and NaN payloads
// where the CPU's own bf16 conversion runs; its scalar tail uses std::exp) in the AVX-512
// extension, where a prefill step's [tokens, 2 x intermediate] activation takes half the
// instructions.  SiLU is element-wise arithmetic (an exponential and a division per value),
// bound by the vector units, which the two vCPUs of a core share.
//
// In bfloat16 the SiLU is rounded before the product, as F.silu(gate) * up rounds; rounding is
// to nearest even with NaN kept a quiet NaN, as c10::BFloat16 rounds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "panel_linear.h"
#include "simd_avx512.h"
#include "swiglu_op.h"

namespace {

using bf16 = at::BFloat16;

constexpr int64_t kRowGrain = 8;  // as cpu_fused.cpp: rows per thread before a second wakes

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  const __m256i w = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
}

inline __m512i bf16_bits16(__m512 v) {  // each lane's rounded bf16 bits, in its low half
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

template <typename E>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<E, bf16>) return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
  return v;
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(bf16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}

template <typename E>
void silu_rows(const E* xp, E* yp, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = r0; r < r1; ++r) {
      const E* g = xp + r * 2 * I;
      const E* u = g + I;
      E* yr = yp + r * I;
      for (int64_t j = 0; j < I; j += 16) {
        const __mmask16 m = static_cast<__mmask16>(I - j >= 16 ? 0xFFFF : (1u << (I - j)) - 1);
        const __m512 gv = load16(g + j, m);
        // sigmoid(g) = 1 / (1 + e^-g); exp16 clamps, so a very negative g gives 0, not NaN
        const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, tokenloom::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        store16(yr + j, _mm512_mul_ps(round16<E>(_mm512_mul_ps(gv, sig)), load16(u + j, m)), m);
      }
    }
  });
}

// bfloat16 rows on CPUs with AVX512-BF16: each rounding to bfloat16 by the CPU's conversion
// (panel_linear.h `convert_to_bf16`: bit for bit bf16_bits16's).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void silu_row_cvt(const bf16* g, const bf16* u, bf16* yr,
                                                                                     int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < I; j += 16) {
    const __mmask16 m = static_cast<__mmask16>(I - j >= 16 ? 0xFFFF : (1u << (I - j)) - 1);
    const __m512 gv = load16(g + j, m);
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, tokenloom::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    const __m512 sr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(tokenloom::convert_to_bf16(_mm512_mul_ps(gv, sig))), 16));
    _mm256_mask_storeu_epi16(yr + j, m, tokenloom::convert_to_bf16(_mm512_mul_ps(sr, load16(u + j, m))));
  }
}

void silu_rows_cvt(const bf16* xp, bf16* yp, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_row_cvt(xp + r * 2 * I, xp + r * 2 * I + I, yp + r * I, I);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  static const bool cvt = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq");
  return tokenloom::silu_and_mul_op(x, "tokenloom_avx512::silu_and_mul", [](auto* xp, auto* yp, int64_t rows, int64_t I) {
    if constexpr (std::is_same_v<std::remove_const_t<std::remove_pointer_t<decltype(xp)>>, bf16>) {
      if (cvt) return silu_rows_cvt(xp, yp, rows, I);
    }
    silu_rows(xp, yp, rows, I);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_avx512, m) { m.def("silu_and_mul(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenloom_avx512, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
