// Decode rows (up to 8) of the quantized GEMM (cpu_gemm_quant.cpp) by integer dot products, for CPUs
// with AVX512-VNNI and AVX512-VBMI.
//
// Widening each weight to float32 costs three instructions per 16 weights, which at one row
// keeps the core busier than the memory stream it reads.  `vpdpbusd` instead multiplies 64
// unsigned bytes by 64 signed bytes and adds each four products into a 32-bit lane: one
// instruction per 64 weights.  It needs both sides as bytes, so each block of 32 activations
// is written as three signed bytes ("limbs") on a power-of-two unit D of the block:
//
//     x ~= D * (a + b / 128 + c / 16384),   D = 2^(floor(log2 max|x|) - 6),  a, b, c in -127..127
//
// a = trunc(x / D), b = trunc of the remainder times 128, c = the rest rounded (to -127..127).
// Every step but that last rounding is exact, so the error is at most one unit of c,
// D / 16384 <= 2^-20 of the block's largest value (half that unless c is clamped); a
// bfloat16 activation within 2^13 of its block's largest is represented exactly.  bfloat16
// activations take two limbs, b the rounded one: the error is at most D / 128 <= 2^-13 of the
// block's largest, and an activation within 2^6 of it is exact.  The weights are themselves
// rounded far coarser (int8 to 1/254 of a column's range, int4 to 1/15 of a group's), and the
// third limb's `vpdpbusd` was what bound the int4 step at one row and the int8 step at 4-8 rows
// (docs/quantization.md, "Two limbs for int4", "Two limbs for int8's bf16 rows").  Either way
// the activations are not quantized in the usual sense (8 bits per block, as llama.cpp's
// integer dot products take them).
// The weights are read as unsigned bytes (int8 + 128; int4 nibbles are stored as q + 8), so
// each limb's sum over a block times that bias starts the block's accumulator negative and the
// integer sums come out as the signed dot products.  Each block's sums are combined in
// float32 and scaled by D; the weight scales are applied as in the float32 path.
//
// int8 panels are stored in k-quads on this build (four k of a column in one 32-bit lane, as
// `vpdpbusd` reads them); int4 keeps the float32 path's layout, four k of a panel turned into
// one lane per column by a byte permute (`Int4Quad`).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "panel_linear.h"

namespace tokenloom::vnni {

constexpr int64_t XB = 32;    // activations per block (one unit D)
constexpr int kMaxLimbs = 3;
constexpr int64_t kPanel = 32;  // columns per panel

// Every row's activations as `count` (2 or 3) limbs: per row and block, the limbs' 32 bytes each,
// the block's unit and each limb's sum over the block.
struct Limbs {
  int count = kMaxLimbs;
  int64_t blocks = 0;
  std::vector<int8_t> q;     // [rows][blocks][count][32]
  std::vector<float> unit;   // [rows][blocks]
  std::vector<int32_t> sum;  // [rows][blocks][count]

  const int8_t* limbs(int64_t row, int64_t blk) const { return q.data() + ((row * blocks + blk) * count) * XB; }
  float d(int64_t row, int64_t blk) const { return unit[row * blocks + blk]; }
  int32_t s(int64_t row, int64_t blk, int l) const { return sum[(row * blocks + blk) * count + l]; }
};

// 16 activations from k on, as float32; past `valid` of them, zeros.
inline __m512 load16(const float* p, int64_t valid) {
  return valid >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << std::max<int64_t>(valid, 0)) - 1), p);
}
inline __m512 load16(const uint16_t* p, int64_t valid) {  // bfloat16
  const __m256i h = valid >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << std::max<int64_t>(valid, 0)) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 float32 sums to y: all, or the first `cols`; as float32, or rounded to bfloat16
// (panel_linear.h `round_to_bf16`).
inline void store16(float* p, __m512 v, int64_t cols) {
  if (cols >= 16) _mm512_storeu_ps(p, v);
  else if (cols > 0) _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << cols) - 1), v);
}
inline void store16(uint16_t* p, __m512 v, int64_t cols) {
  if (cols > 0)
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1), round_to_bf16(v));
}

// Split rows x[M, K] (float32 or bfloat16, row stride K) into `count` (2 or 3) limbs over Kp >= K
// activations (whole blocks; those past K are zero).  False if some value is not finite: the
// caller then takes the float32 path, which propagates infinities and NaNs.  Rows are split in
// parallel once there are enough of them (a prefill's), each row by one thread.
template <typename T>
inline bool split(const T* x, int64_t M, int64_t K, int64_t Kp, int count, Limbs& out) {
  const int n = count;
  out.count = count;
  out.blocks = Kp / XB;
  out.q.resize(M * Kp * n);
  out.unit.resize(M * out.blocks);
  out.sum.resize(M * out.blocks * n);
  std::atomic<bool> finite{true};
  const auto rows = [&](int64_t r0, int64_t r1) {
    const __m512 k128 = _mm512_set1_ps(128.0f);
    const __m512i lim = _mm512_set1_epi32(127);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < out.blocks; ++b) {
        const T* xb = x + r * K + b * XB;
        const int64_t valid = K - b * XB;
        const __m512 v[2] = {load16(xb, valid), load16(xb + 16, valid - 16)};
        const __m512 a0 = _mm512_abs_ps(v[0]), a1 = _mm512_abs_ps(v[1]);
        const __m512 big = _mm512_set1_ps(3.4028235e38f);  // above it: inf; unordered: NaN
        if (_mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ)) {
          finite.store(false, std::memory_order_relaxed);
          return;
        }
        const float m = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        const int e = m > 0 ? std::max(std::ilogb(m) - 6, -126) : 0;
        const float unit = std::ldexp(1.0f, e);
        const __m512 inv = _mm512_set1_ps(std::ldexp(1.0f, -e));
        const int64_t i = r * out.blocks + b;
        out.unit[i] = unit;
        int8_t* q = out.q.data() + i * n * XB;
        __m512i s[kMaxLimbs] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        // the last limb rounded, clamped to -127..127; the ones before it truncated (exact)
        const __m512i neg_lim = _mm512_sub_epi32(_mm512_setzero_si512(), lim);
        const auto last = [&](__m512 r) { return _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(r), lim), neg_lim); };
        for (int h = 0; h < 2; ++h) {
          const __m512 t = _mm512_mul_ps(v[h], inv);  // |t| < 128
          const __m512i a = _mm512_cvttps_epi32(t);
          const __m512 r1 = _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(a)), k128);
          __m512i limb[kMaxLimbs] = {a, _mm512_setzero_si512(), _mm512_setzero_si512()};
          if (n == 3) {
            limb[1] = _mm512_cvttps_epi32(r1);
            limb[2] = last(_mm512_mul_ps(_mm512_sub_ps(r1, _mm512_cvtepi32_ps(limb[1])), k128));
          } else {
            limb[1] = last(r1);
          }
          for (int l = 0; l < n; ++l) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + l * XB + h * 16), _mm512_cvtepi32_epi8(limb[l]));
            s[l] = _mm512_add_epi32(s[l], limb[l]);
          }
        }
        for (int l = 0; l < n; ++l) out.sum[i * n + l] = _mm512_reduce_add_epi32(s[l]);
      }
  };
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(Kp, 1)), rows);
  return finite.load();
}

// Byte indices that gather four k of 16 columns into one 32-bit lane per column: byte 4c + t
// of the result is byte at(c0 + c, t) of the source.  Built once per process (a table per use).
struct QuadIndex {
  alignas(64) int8_t idx[64];
  QuadIndex(int (*at)(int c, int t), int c0) {
    for (int c = 0; c < 16; ++c)
      for (int t = 0; t < 4; ++t) idx[4 * c + t] = static_cast<int8_t>(at(c0 + c, t));
  }
  __m512i load() const { return _mm512_load_si512(idx); }
};

// int8 panel in k-quads ([K / 4, 32, 4] bytes, kernels/cpu.py `pack_int8(quads=True)`): k .. k+3
// of columns 0-15 are one 64-byte load, of columns 16-31 the next, already one 32-bit lane per
// column; + 128 (sign bit flipped) makes them the unsigned operand.  (Permuting them out of the
// k-major layout instead kept the one-row stream below the memory's read rate:
// docs/quantization.md, "What kept int8 below the read rate".)
struct Int8Quad {
  static constexpr int kBias = 128;
  static constexpr int64_t kBytesPerK = kPanel;
  const int8_t* q;
  explicit Int8Quad(const int8_t* q_) : q(q_) {}
  void get4(int64_t k, __m512i* out) const {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    out[0] = _mm512_xor_si512(_mm512_loadu_si512(q + k * kPanel), flip);
    out[1] = _mm512_xor_si512(_mm512_loadu_si512(q + k * kPanel + 64), flip);
  }
};

// int4 panel ([Kp, 16] bytes: column c low nibble, c + 16 high): k .. k+3 are one 64-byte
// load; each half's nibbles masked out, then a byte permute.
struct Int4Quad {
  static constexpr int kBias = 8;
  static constexpr int64_t kBytesPerK = kPanel / 2;
  const uint8_t* q;
  __m512i idx;
  explicit Int4Quad(const uint8_t* q_) : q(q_) {
    static const QuadIndex table([](int c, int t) { return 16 * t + c; }, 0);
    idx = table.load();
  }
  void get4(int64_t k, __m512i* out) const {
    const __m512i v = _mm512_loadu_si512(q + k * kBytesPerK);
    const __m512i m15 = _mm512_set1_epi8(15);
    out[0] = _mm512_permutexvar_epi8(idx, _mm512_and_si512(v, m15));
    out[1] = _mm512_permutexvar_epi8(idx, _mm512_and_si512(_mm512_srli_epi16(v, 4), m15));
  }
};

// 16 group scales as float32: bfloat16, float16 (GGUF's Q4_0 / Q8_0 blocks) or float32 (GGUF's
// Q4_K sub-block scales, d * sc, which no 16-bit type holds exactly): `SK` (panel_linear.h).
template <typename SK>
inline __m512 load_scales16(const typename SK::T* p) {
  if constexpr (SK::kind == ScaleKind::F32) return _mm512_loadu_ps(p);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (SK::kind == ScaleKind::F16) return _mm512_cvtph_ps(h);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Per-group offsets added to a panel's sums (GGUF's Q4_K mins): y[m, c] += sum_g o[g, c] * xsum[m, g],
// o [K / G, 32] float32 for the panel, xsum [M, ng] the sums of x over each group; o null: none.
struct GroupOffsets {
  const float* o = nullptr;
  const float* xsum = nullptr;
  int64_t ng = 0;
};

// y[row0 .. row0+R, one panel] = x . panel over all K (+ bias), x in NL limbs.  Weight scales:
// `col_scales` (int8: one per column, applied at the end) or `group_scales` (int4, grouped int8:
// [K / G, 32] of the dtype `SK` names, applied to each group's sums).
template <int R, typename SK, int NL, typename Quad, typename Out>
inline void micro(const Limbs& xl, int64_t row0, const Quad& src, int64_t K, int64_t G, const float* col_scales,
                  const typename SK::T* group_scales, const GroupOffsets& off, Out* y, int64_t ldy, int64_t ncols,
                  const float* bias) {
  const __m512 c1 = _mm512_set1_ps(1.0f / 128), c2 = _mm512_set1_ps(1.0f / 16384);
  __m512 tot[R][2];
  for (int i = 0; i < R; ++i) tot[i][0] = tot[i][1] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    __m512 gacc[R][2];
    for (int i = 0; i < R; ++i) gacc[i][0] = gacc[i][1] = _mm512_setzero_ps();
    for (int64_t b0 = g0; b0 < g0 + G; b0 += XB) {
      const int64_t blk = b0 / XB;
      __m512i acc[R][NL][2];
      const int8_t* lp[R];
      for (int i = 0; i < R; ++i) {
        lp[i] = xl.limbs(row0 + i, blk);
        for (int l = 0; l < NL; ++l)
          acc[i][l][0] = acc[i][l][1] = _mm512_set1_epi32(-Quad::kBias * xl.s(row0 + i, blk, l));
      }
#pragma GCC unroll 8
      for (int64_t k = 0; k < XB; k += 4) {
        prefetch_stream(src.q + (b0 + k) * Quad::kBytesPerK, 4 * Quad::kBytesPerK);
        __m512i wv[2];
        src.get4(b0 + k, wv);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
          for (int l = 0; l < NL; ++l) {
            const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(lp[i] + l * XB + k));
            acc[i][l][0] = _mm512_dpbusd_epi32(acc[i][l][0], wv[0], a);
            acc[i][l][1] = _mm512_dpbusd_epi32(acc[i][l][1], wv[1], a);
          }
      }
      for (int i = 0; i < R; ++i) {
        const __m512 d = _mm512_set1_ps(xl.d(row0 + i, blk));
        for (int j = 0; j < 2; ++j) {
          __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][1][j]), c1, _mm512_cvtepi32_ps(acc[i][0][j]));
          if constexpr (NL == 3) f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][NL - 1][j]), c2, f);
          gacc[i][j] = _mm512_fmadd_ps(f, d, gacc[i][j]);
        }
      }
    }
    if (group_scales) {
      const typename SK::T* gs = group_scales + (g0 / G) * kPanel;
      for (int j = 0; j < 2; ++j) {
        const __m512 s = load_scales16<SK>(gs + 16 * j);
        for (int i = 0; i < R; ++i) tot[i][j] = _mm512_fmadd_ps(gacc[i][j], s, tot[i][j]);
      }
      if (off.o) {  // + o[g] * (the group's sum of x), row by row
        const float* go = off.o + (g0 / G) * kPanel;
        for (int j = 0; j < 2; ++j) {
          const __m512 o = _mm512_loadu_ps(go + 16 * j);
          for (int i = 0; i < R; ++i)
            tot[i][j] = _mm512_fmadd_ps(o, _mm512_set1_ps(off.xsum[(row0 + i) * off.ng + g0 / G]), tot[i][j]);
        }
      }
    } else {
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < 2; ++j) tot[i][j] = _mm512_add_ps(tot[i][j], gacc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 2; ++j) {
      __m512 v = col_scales ? _mm512_mul_ps(tot[i][j], _mm512_loadu_ps(col_scales + 16 * j)) : tot[i][j];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
      store16(y + i * ldy + 16 * j, v, ncols - 16 * j);
    }
}

// All rows of one panel, four at a time (24 accumulators with three limbs: the most that leave
// registers for the weights; each pass over the panel's weights loads and permutes them again,
// so fewer passes is faster: a 5-row verifying step as 4 + 1 rows, not 2 + 2 + 1), then the 1-3
// left: y[0:M, 0:ncols] with row stride ldy.  With two limbs 5 rows are one pass (20
// accumulators); 6 at a time spilled and lost to 4 + 2.
template <typename SK, int NL, typename Quad, typename Out>
inline void panel_limbs(const Limbs& xl, int64_t M, const Quad& src, int64_t K, int64_t G, const float* col_scales,
                        const typename SK::T* group_scales, const GroupOffsets& off, Out* y, int64_t ldy,
                        int64_t ncols, const float* bias) {
  if constexpr (NL == 2) {
    if (M == 5)
      return micro<5, SK, NL>(xl, 0, src, K, G, col_scales, group_scales, off, y, ldy, ncols, bias);
  }
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    micro<4, SK, NL>(xl, m, src, K, G, col_scales, group_scales, off, y + m * ldy, ldy, ncols, bias);
  switch (M - m) {
    case 3: return micro<3, SK, NL>(xl, m, src, K, G, col_scales, group_scales, off, y + m * ldy, ldy, ncols, bias);
    case 2: return micro<2, SK, NL>(xl, m, src, K, G, col_scales, group_scales, off, y + m * ldy, ldy, ncols, bias);
    case 1: return micro<1, SK, NL>(xl, m, src, K, G, col_scales, group_scales, off, y + m * ldy, ldy, ncols, bias);
    default: return;
  }
}

// How many limbs a row of x is split into: three, but two for bfloat16 activations (whose own
// rounding, and the weights', is far coarser than the third limb).
inline int limbs_for(bool bf16) { return bf16 ? 2 : kMaxLimbs; }

template <typename SK, typename Quad, typename Out>
inline void panel(const Limbs& xl, int64_t M, const Quad& src, int64_t K, int64_t G, const float* col_scales,
                  const typename SK::T* group_scales, Out* y, int64_t ldy, int64_t ncols, const float* bias,
                  const GroupOffsets& off = {}) {
  if (xl.count == 2) return panel_limbs<SK, 2>(xl, M, src, K, G, col_scales, group_scales, off, y, ldy, ncols, bias);
  panel_limbs<SK, kMaxLimbs>(xl, M, src, K, G, col_scales, group_scales, off, y, ldy, ncols, bias);
}

}  // namespace tokenloom::vnni
