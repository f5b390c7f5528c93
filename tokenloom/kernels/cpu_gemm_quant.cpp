// Weight-only quantized GEMM for x86 CPUs: y[M, N] = x[M, K] * dequant(W)[N, K]^T (+ bias),
// W in int8 (one scale per output column, or one per group of G k per column) or int4 (one scale
// per group of G k per column).
//
// Decode at small batch is bound by the bytes of weights it reads (the seed: each step reads
// the whole model), so storing 8 or 4 bits per weight instead of 16 is what makes it faster;
// the arithmetic stays float32 (activations are not quantized).  Layouts, 32 columns a panel
// as the bf16/fp32 kernels (kernels/cpu.py `pack_int8`, `pack_int4`), each panel one
// sequential stream:
//
//   int8  [P, K, 32] int8; scales [P * 32] float32:  w[32p + c, k] = q[p, k, c] * s[32p + c]
//         (the VNNI build: [P, K / 4, 32, 4] k-quads,  w[32p + c, k] = q[p, k / 4, c, k % 4] * s)
//   int4  [P, Kp, 16] uint8, low nibble column c, high nibble column c + 16 (biased by 8);
//         scales [P, Kp / G, 32] bfloat16, float16 or float32: w[32p + c, k] = (nib - 8) * s[p, k / G, c]
//   int8 in groups (`linear_int8_group`): the int8 panels above, scales as int4's (16-bit):
//                                                     w[32p + c, k] = q[.., k, c] * s[p, k / G, c]
//
// Group scales come in bfloat16 (our own int4) or float16 (GGUF's Q4_0 and Q8_0 blocks, kept
// exactly as the file stores them: float16 has three more mantissa bits than bfloat16); either
// is widened to float32 as it is loaded, so both cost the same 16 bits per group.  int4 also
// takes float32 scales, for GGUF's Q4_K sub-blocks: d * sc, a float16 times a 6-bit integer, is
// exact in float32 but in neither 16-bit type (32 bits per group of 32, one more bit a weight).
//
// Two ways through a panel, chosen by the row count:
// * few rows (decode): each k's 32 weights are widened to float32 in registers and used at
//   once by every row (`Int8Source` / `Int4Source` fed to `micro`), read exactly once: int8 by
//   sign extension and conversion, its column scales applied to the finished sums; int4 by one
//   permute that looks each nibble up in a table of the 16 levels (-8..7), the group's scales
//   applied to each group's sums.
// * more rows (batched decode, prefill): each block of KC k is first dequantized into a
//   16 KB float32 buffer (in L1), which every 12-row tile then reads like the fp32 kernel's
//   panel, so the widening is paid once per weight, not once per tile.
// On CPUs with AVX512-VNNI and VBMI a third way replaces both for bf16 activations, and for up
// to 8 rows of float32 ones: integer dot products on a split of each activation into two bytes
// (three for float32 activations) (quant_vnni.h, `decode_vnni` below).
// Either way each thread prefetches its weight stream a short way ahead of its reads
// (`prefetch`, panel_linear.h), so the reads overlap the widening.
// Both compute the product of x with the dequantized float32 weights above (the PyTorch
// reference in model/weights/quantization.py), up to float32 summation order.
//
// The same source builds twice (kernels/cpu.py): with AVX-512 (16-float vectors, 12-row tiles)
// and with AVX2 + FMA (8-float vectors, 2-row tiles), registering `tokenloom_q512` or
// `tokenloom_q256`.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "gemm_driver.h"
#include "panel_linear.h"
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define TOKENLOOM_QUANT_VNNI 1
#include "quant_vnni.h"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

constexpr int64_t W = 32;    // columns per panel
constexpr int64_t KC = 128;  // k per dequantized block (a multiple of both group sizes, 32 and 128)

#ifdef __AVX512F__
using vf = __m512;
constexpr int VL = 16;
constexpr int MR = 12;  // 2 x 12 accumulators + 2 weight vectors of 32 registers
constexpr int kFusedRows = 4;  // up to this many rows: dequantize in registers
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
// bfloat16 -> float32 of 16 scales.
inline vf vload_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// float16 -> float32 of 16 scales.
inline vf vload_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
// 32 int8 weights of one k -> 2 vectors of their integer values.
inline void widen_int8(const int8_t* src, vf* out) {
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)src)));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 16))));
}
// 16 bytes of nibbles of one k -> 2 vectors of nib - 8: a lookup of the 16 levels indexed by
// each lane's low 4 bits (one permute instead of mask, convert and subtract).
inline void widen_int4(const uint8_t* src, vf* out) {
  const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)src));
  out[0] = _mm512_permutexvar_ps(b, levels);
  out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), levels);
}
#else
using vf = __m256;
constexpr int VL = 8;
constexpr int MR = 2;  // 2 x 4 accumulators + 4 weight vectors of 16 registers
constexpr int kFusedRows = 2;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vload_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vf vload_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }  // F16C
inline __m128i load8(const void* p) { return _mm_loadl_epi64((const __m128i*)p); }
inline void widen_int8(const int8_t* src, vf* out) {
  for (int j = 0; j < 4; ++j) out[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(src + 8 * j)));
}
// bytes 0-7: columns 0-7 (low) and 16-23 (high); bytes 8-15: columns 8-15 and 24-31.
inline void widen_int4(const uint8_t* src, vf* out) {
  const vf eight = _mm256_set1_ps(8.0f);
  for (int h = 0; h < 2; ++h) {
    const __m256i b = _mm256_cvtepu8_epi32(load8(src + 8 * h));
    out[h] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), eight);
    out[h + 2] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), eight);
  }
}
#endif

constexpr int NV = W / VL;  // vectors per k of a panel

// One group's scales of VL columns, bfloat16, float16 or float32 (`SK`, panel_linear.h), as float32.
template <typename SK>
inline vf vload_scales(const typename SK::T* p) {
  if constexpr (SK::kind == tokenloom::ScaleKind::F32) return vload(p);
  else if constexpr (SK::kind == tokenloom::ScaleKind::F16) return vload_f16(p);
  else return vload_bf16(p);
}

// Weight sources: `get(k, out)` gives the 32 weights of block offset k as float32, times the
// scales unless the source defers them (`kScale`): 0 = none, 1 = per column (applied to the
// sums at the end), 2 = per group (applied to each group's sums); `group(k)` loads the scales
// of the group that starts at block offset k into `s`.

// Weights of a block, already float32: [kc][32]; group scales applied, column scales (kS = 1)
// left to the sums, as the block's source would.
template <int kS>
struct BufSource {
  static constexpr int kScale = kS;
  const float* w;
  vf s[NV];
  void group(int64_t) {}
  void prefetch(int64_t, int64_t) const {}
  void get(int64_t k, vf* out) const {
    for (int j = 0; j < NV; ++j) out[j] = vload(w + k * W + j * VL);
  }
};

// int8 weights of one panel from k0 on: q as float32.
// In k-quads on the VNNI build ([.., 32, 4]: the layout its integer path reads), else k-major
// ([.., 32]); 32 bytes a k either way.
struct Int8Stream {
  const int8_t* q;  // panel's k0 row (k0 a multiple of 4 in quads)
  // The stream ahead of the weights of k .. k + n - 1 (panel_linear.h).
  void prefetch(int64_t k, int64_t n) const { tokenloom::prefetch_stream(q + k * W, n * W); }
#ifdef TOKENLOOM_QUANT_VNNI
  // byte k % 4 of each column's lane, sign-extended: shifted to the top, then back down
  void get(int64_t k, vf* out) const {
    const int8_t* quad = q + (k / 4) * 4 * W;
    const int up = 24 - 8 * static_cast<int>(k % 4);
    for (int j = 0; j < NV; ++j) {
      const __m512i v = _mm512_loadu_si512(quad + 64 * j);
      out[j] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_sll_epi32(v, _mm_cvtsi32_si128(up)), 24));
    }
  }
#else
  void get(int64_t k, vf* out) const { widen_int8(q + k * W, out); }
#endif
};

// int8 with one scale per column: the column scales come after the sum.
struct Int8Source : Int8Stream {
  static constexpr int kScale = 1;
  vf s[NV];
  Int8Source(const int8_t* q_, const float* scales) : Int8Stream{q_} {
    for (int j = 0; j < NV; ++j) s[j] = vload(scales + j * VL);
  }
  void group(int64_t) {}
};

// int8 with one scale per group of G k per column (float16 or bfloat16, k0 a multiple of G):
// the group's scales multiply each group's sums.
template <typename SK>
struct Int8GroupSource : Int8Stream {
  static constexpr int kScale = 2;
  const typename SK::T* sc;  // panel's scales from k0's group: [.., 32]
  int64_t G;
  vf s[NV];
  Int8GroupSource(const int8_t* q_, const typename SK::T* sc_, int64_t G_) : Int8Stream{q_}, sc(sc_), G(G_) {}
  void group(int64_t k) {
    const typename SK::T* g = sc + (k / G) * W;
    for (int j = 0; j < NV; ++j) s[j] = vload_scales<SK>(g + j * VL);
  }
};

// int4 weights of one panel from k0 on (k0 a multiple of G): nib - 8; the group's scales
// (`SK`: bfloat16, float16 or float32) multiply each group's sums.
template <typename SK>
struct Int4Source {
  static constexpr int kScale = 2;
  const uint8_t* q;             // panel's k0 row: [.., 16]
  const typename SK::T* sc;     // panel's scales from k0's group: [.., 32]
  int64_t G;
  vf s[NV];
  void group(int64_t k) {
    const typename SK::T* g = sc + (k / G) * W;
    for (int j = 0; j < NV; ++j) s[j] = vload_scales<SK>(g + j * VL);
  }
  void prefetch(int64_t k, int64_t n) const { tokenloom::prefetch_stream(q + k * (W / 2), n * (W / 2)); }
  void get(int64_t k, vf* out) const { widen_int4(q + k * (W / 2), out); }
};

// y[0:R, 0:32] (+)= x[0:R, 0:kc] . w[0:kc]; S interleaved accumulator chains keep a single row
// from waiting on FMA latency.  `G`: the source's group length (scales change at multiples).
template <int R, int S, typename Src>
inline void micro(const float* x, int64_t ldx, int64_t ldk, Src& src, int64_t kc, int64_t G, float* y, int64_t ldy,
                  bool accumulate, const float* bias) {
  vf acc[S][R][NV], tot[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) tot[i][j] = vzero();
  for (int64_t g0 = 0; g0 < kc; g0 += G) {
    src.group(g0);
    for (int s = 0; s < S; ++s)
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < NV; ++j) acc[s][i][j] = vzero();
    const int64_t g1 = std::min(kc, g0 + G);
    int64_t k = g0;
    for (; k + S <= g1; k += S) {
      src.prefetch(k, S);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        vf wv[NV];
        src.get(k + s, wv);
#pragma GCC unroll 12
        for (int i = 0; i < R; ++i) {
          const vf a = vset1(x[i * ldx + (k + s) * ldk]);
#pragma GCC unroll 4
          for (int j = 0; j < NV; ++j) acc[s][i][j] = vfma(a, wv[j], acc[s][i][j]);
        }
      }
    }
    for (; k < g1; ++k) {
      vf wv[NV];
      src.get(k, wv);
      for (int i = 0; i < R; ++i) {
        const vf a = vset1(x[i * ldx + k * ldk]);
        for (int j = 0; j < NV; ++j) acc[0][i][j] = vfma(a, wv[j], acc[0][i][j]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NV; ++j) {
        vf v = acc[0][i][j];
        for (int s = 1; s < S; ++s) v = vadd(v, acc[s][i][j]);
        tot[i][j] = Src::kScale == 2 ? vfma(v, src.s[j], tot[i][j]) : vadd(tot[i][j], v);
      }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) {
      vf v = Src::kScale == 1 ? vmul(tot[i][j], src.s[j]) : tot[i][j];
      float* yij = y + i * ldy + j * VL;
      if (accumulate) v = vadd(v, vload(yij));
      if (bias) v = vadd(v, vload(bias + j * VL));
      vstore(yij, v);
    }
}

template <typename Src>
void micro_rows(int64_t rows, const float* x, int64_t ldx, int64_t ldk, Src& src, int64_t kc, int64_t G, float* y, int64_t ldy,
                bool accumulate, const float* bias) {
  switch (rows) {
    case 1: return micro<1, 4, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
#ifdef __AVX512F__
    case 2: return micro<2, 2, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    case 3: return micro<3, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    case 4: return micro<4, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    case 5: return micro<5, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    case 6: return micro<6, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    case 7: return micro<7, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    case 8: return micro<8, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    case 9: return micro<9, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    case 10: return micro<10, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    case 11: return micro<11, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
    default: return micro<12, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
#else
    default: return micro<2, 1, Src>(x, ldx, ldk, src, kc, G, y, ldy, accumulate, bias);
#endif
  }
}

// Fill buf[0:kc][0:32] with the block's weights as float32: times their group scales, not
// their column scales (those multiply the sums, one product per output instead of per weight).
template <typename Src>
void dequant_block(Src& src, int64_t kc, int64_t G, float* buf) {
  for (int64_t g0 = 0; g0 < kc; g0 += G) {
    src.group(g0);
    src.prefetch(g0, std::min(kc, g0 + G) - g0);
    for (int64_t k = g0; k < std::min(kc, g0 + G); ++k) {
      vf wv[NV];
      src.get(k, wv);
      for (int j = 0; j < NV; ++j) vstore(buf + k * W + j * VL, Src::kScale == 2 ? vmul(wv[j], src.s[j]) : wv[j]);
    }
  }
}

#ifdef TOKENLOOM_QUANT_VNNI
// int8 k-quads (kc and G multiples of 4): one load gives four k of 16 columns, each k's byte
// shifted to the top of its lane and back down by immediate shifts (a shift by a register count
// costs two instructions; `Int8Stream::get` pays it once per k); group scales (kScale 2) applied.
template <typename Src>
inline void dequant_quads(Src& src, int64_t kc, int64_t G, float* buf) {
  for (int64_t g0 = 0; g0 < kc; g0 += G) {
    src.group(g0);
    for (int64_t k = g0; k < std::min(kc, g0 + G); k += 4) {
      src.prefetch(k, 4);
      for (int j = 0; j < NV; ++j) {
        const __m512i v = _mm512_loadu_si512(src.q + k * W + 64 * j);
        float* b = buf + k * W + j * VL;
        vf w[4] = {_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24)),
                   _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)),
                   _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24)),
                   _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24))};
        for (int t = 0; t < 4; ++t) vstore(b + t * W, Src::kScale == 2 ? vmul(w[t], src.s[j]) : w[t]);
      }
    }
  }
}
inline void dequant_block(Int8Source& src, int64_t kc, int64_t, float* buf) { dequant_quads(src, kc, kc, buf); }
template <typename SK>
inline void dequant_block(Int8GroupSource<SK>& src, int64_t kc, int64_t G, float* buf) { dequant_quads(src, kc, G, buf); }
#endif

// The GEMM over panels; `make(p, k0)` is a weight source for panel p from k0 on.  y is
// [M, P * 32] (padded to whole panels), x [M, K] with K a multiple of G (padded by the caller).
template <typename Make>
void gemm(const float* x, int64_t M, int64_t K, int64_t P, int64_t G, const float* bias, float* y, Make make) {
  const int64_t ldy = P * W;
  // More rows than kFusedRows: x in tiles of MR rows, each [K][rows], so that a micro-tile's
  // activations of one k are adjacent (one line for all its rows, not one line per row).
  std::unique_ptr<float[]> tiles;  // uninitialized: every element is written below
  const float* xt = x;
  if (M > kFusedRows) {
    tiles.reset(new float[M * K]);
    tokenloom::pack_row_tiles(x, M, K, MR, tiles.get());
    xt = tiles.get();
  }
  // All M rows are one row block (no MC loop): a block is dequantized once and used by every
  // row; the buffer it goes to is the thread's, kept for its whole run of panels.
  tokenloom::for_panel_runs(P, [&](int64_t p0, int64_t p1) {
    alignas(64) float buf[KC * W];
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const float* b = (bias && k0 + kc == K) ? bias + p * W : nullptr;
        auto src = make(p, k0);
        using Src = decltype(src);
        if (M <= kFusedRows) {
          micro_rows(M, x + k0, K, 1, src, kc, G, y + p * W, ldy, k0 > 0, b);
          continue;
        }
        dequant_block(src, kc, G, buf);
        BufSource<Src::kScale == 1> bs{buf};
        if constexpr (Src::kScale == 1) std::copy(src.s, src.s + NV, bs.s);
        for (int64_t m = 0; m < M; m += MR) {
          const int64_t r = std::min<int64_t>(MR, M - m);
          micro_rows(r, xt + m * K + k0 * r, 1, r, bs, kc, KC, y + m * ldy + p * W, ldy, k0 > 0, b);
        }
      }
    }
  });
}

struct Call {
  at::Tensor x2, y, bias;
  const float* bias_ptr = nullptr;
  int64_t M = 0;
};

// x as float32 [M, Kp] (zero-padded past K), y [M, P*32] float32, bias float32 [P*32].
Call begin(const at::Tensor& x, int64_t Kp, int64_t P, const c10::optional<at::Tensor>& bias) {
  Call c;
  const int64_t K = x.size(-1);
  auto x2 = x.reshape({-1, K}).to(at::kFloat);
  if (Kp != K) x2 = at::constant_pad_nd(x2, {0, Kp - K});
  c.x2 = x2.contiguous();
  c.M = c.x2.size(0);
  c.y = at::empty({c.M, P * W}, c.x2.options());
  if (bias.has_value() && bias->defined()) {
    c.bias = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(c.bias.numel() >= P * W, "bias must be padded to the panels");
    c.bias_ptr = c.bias.data_ptr<float>();
  }
  return c;
}

at::Tensor finish(const Call& c, const at::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = c.y.size(1) == n ? c.y : c.y.narrow(1, 0, n).contiguous();
  return y.view(sizes).to(x.scalar_type());
}

#ifdef TOKENLOOM_QUANT_VNNI
// Which calls take the integer path.  bfloat16 activations take it at every row count: on two
// limbs a `vpdpbusd` makes 32 useful products where an FMA of the dequantized-block path makes
// 16 (and that path dequantizes besides), so the integer path wins wherever the dot product
// runs at least half the FMAs' rate (1.7-1.8x faster from 12 to 300 rows on AMD Zen 4).
// float32 activations take it up to 8 rows: three limbs make 21 products per instruction,
// level with the FMAs once each block's combination is counted (docs/quantization.md).  Each row's arithmetic is its own
// (limbs, dot products, combination), so a row's result does not depend on the rows beside it:
// a speculative verifying step, or a batch of any size in bfloat16, gives exactly what one-row
// steps would.
constexpr int64_t kIntegerRowsFloat32 = 8;
inline bool integer_path(bool bf16, int64_t rows) { return bf16 || rows <= kIntegerRowsFloat32; }

// Decode rows by integer dot products (quant_vnni.h), x read and y written in x's own dtype
// (float32 or bfloat16), so no conversion runs around the kernel.  `run(p, limbs, M, y, ldy,
// ncols, bias)` does panel p, its weights read as `Quad` (x is split into `limbs_for` limbs).
// Nothing where that path does not apply: more rows, a K that is not whole blocks,
// another dtype, or a value that is not finite (the float32 path propagates it).
template <typename Quad, typename Run>
c10::optional<at::Tensor> decode_vnni(const at::Tensor& x, int64_t Kp, int64_t P, int64_t n,
                                      const c10::optional<at::Tensor>& bias, Run run) {
  namespace v = tokenloom::vnni;
  const int64_t K = x.size(-1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (K == 0 || Kp % v::XB != 0 || (!bf16 && x.scalar_type() != at::kFloat)) return c10::nullopt;
  const int64_t M = x.numel() / K;
  if (M == 0 || !integer_path(bf16, M)) return c10::nullopt;
  const auto x2 = x.reshape({M, K}).contiguous();
  v::Limbs xl;
  const int limbs = v::limbs_for(bf16);
  if (!(bf16 ? v::split(reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>()), M, K, Kp, limbs, xl)
             : v::split(x2.data_ptr<float>(), M, K, Kp, limbs, xl)))
    return c10::nullopt;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() >= P * W, "bias must be padded to the panels");
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  tokenloom::for_panel_pieces(P, [&](auto& pieces) {
    int64_t p0, p1;
    while (pieces.next(p0, p1))
      for (int64_t p = p0; p < p1; ++p) {
        const float* bp = b.defined() ? b.data_ptr<float>() + p * W : nullptr;
        const int64_t ncols = std::min(W, n - p * W);
        if (bf16)
          run(p, xl, M, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) + p * W, n, ncols, bp);
        else
          run(p, xl, M, y.data_ptr<float>() + p * W, n, ncols, bp);
      }
  });
  return y;
}
#endif

// The int8 panels' K (padded to whole quads on the VNNI build) and count, after checking their layout.
std::pair<int64_t, int64_t> int8_panels(const at::Tensor& x, const at::Tensor& qweight) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "quantized linear runs on CPU");
#ifdef TOKENLOOM_QUANT_VNNI
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 4 && qweight.size(2) == W &&
                  qweight.size(3) == 4,
              "int8 weight must be packed in k-quads as [P, K / 4, 32, 4] int8 (kernels/cpu.py pack_int8)");
  const int64_t P = qweight.size(0), K = qweight.size(1) * 4;  // K: padded to whole quads
  TORCH_CHECK(x.size(-1) <= K && x.size(-1) > K - 4, "x has ", x.size(-1), " features, the weight ", K);
#else
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 3 && qweight.size(2) == W,
              "int8 weight must be packed as [P, K, 32] int8");
  const int64_t P = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
#endif
  return {K, P};
}

// Group scales [P, Kp / group, 32]: bfloat16 or float16, or (`f32_ok`: the int4 kernel) float32.
tokenloom::ScaleKind check_group_scales(const at::Tensor& scales, int64_t P, int64_t Kp, int64_t group, bool f32_ok) {
  TORCH_CHECK(group > 0 && KC % group == 0, "group must divide ", KC);
  TORCH_CHECK(Kp % group == 0, "packed k must be a multiple of the group");
  const auto t = scales.scalar_type();
  TORCH_CHECK((t == at::kBFloat16 || t == at::kHalf || (f32_ok && t == at::kFloat)) && scales.dim() == 3 &&
                  scales.size(0) == P && scales.size(1) == Kp / group && scales.size(2) == W,
              f32_ok ? "group scales: bfloat16, float16 or float32 [P, Kp / group, 32]"
                     : "group scales: bfloat16 or float16 [P, Kp / group, 32]");
  using tokenloom::ScaleKind;
  return t == at::kFloat ? ScaleKind::F32 : t == at::kHalf ? ScaleKind::F16 : ScaleKind::BF16;
}

template <typename SK>
const typename SK::T* scale_ptr(const at::Tensor& s) { return reinterpret_cast<const typename SK::T*>(s.data_ptr()); }

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  const auto [K, P] = int8_panels(x, qweight);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == P * W, "int8 scales: float32 [P * 32]");
  TORCH_CHECK(P * W >= n, "n exceeds the packed panels");
  const auto q = qweight.contiguous();
  const auto s = scales.contiguous();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
#ifdef TOKENLOOM_QUANT_VNNI
  namespace v = tokenloom::vnni;
  auto y = decode_vnni<v::Int8Quad>(x, K, P, n, bias, [&](int64_t p, const v::Limbs& xl, int64_t M, auto* yp,
                                                          int64_t ldy, int64_t ncols, const float* bp) {
    v::panel<tokenloom::ScalesBF16>(xl, M, v::Int8Quad(qp + p * K * W), K, K, sp + p * W, nullptr, yp, ldy, ncols,
                                    bp);
  });
  if (y.has_value()) return *y;
#endif
  Call c = begin(x, K, P, bias);
  if (c.M > 0) {
    gemm(c.x2.data_ptr<float>(), c.M, K, P, KC, c.bias_ptr, c.y.data_ptr<float>(),
         [&](int64_t p, int64_t k0) { return Int8Source(qp + (p * K + k0) * W, sp + p * W); });
  }
  return finish(c, x, n);
}

template <typename SK>
at::Tensor int8_group(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t K, int64_t P, int64_t n,
                      int64_t group, const c10::optional<at::Tensor>& bias) {
  const int8_t* qp = q.data_ptr<int8_t>();
  const auto* sp = scale_ptr<SK>(s);
  const int64_t ng = K / group;
#ifdef TOKENLOOM_QUANT_VNNI
  namespace v = tokenloom::vnni;
  auto y = decode_vnni<v::Int8Quad>(x, K, P, n, bias, [&](int64_t p, const v::Limbs& xl, int64_t M, auto* yp,
                                                          int64_t ldy, int64_t ncols, const float* bp) {
    v::panel<SK>(xl, M, v::Int8Quad(qp + p * K * W), K, group, nullptr, sp + p * ng * W, yp, ldy, ncols, bp);
  });
  if (y.has_value()) return *y;
#endif
  Call c = begin(x, K, P, bias);
  if (c.M > 0) {
    gemm(c.x2.data_ptr<float>(), c.M, K, P, group, c.bias_ptr, c.y.data_ptr<float>(), [&](int64_t p, int64_t k0) {
      return Int8GroupSource<SK>(qp + (p * K + k0) * W, sp + (p * ng + k0 / group) * W, group);
    });
  }
  return finish(c, x, n);
}

// int8 weights with one scale per group of `group` k per column (GGUF's Q8_0 blocks).
at::Tensor linear_int8_group(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t n,
                             int64_t group, const c10::optional<at::Tensor>& bias) {
  const auto [K, P] = int8_panels(x, qweight);
  TORCH_CHECK(x.size(-1) == K, "grouped int8: x has ", x.size(-1), " features, the weight ", K);
  const auto kind = check_group_scales(scales, P, K, group, false);
  TORCH_CHECK(P * W >= n, "n exceeds the packed panels");
  const auto q = qweight.contiguous();
  const auto s = scales.contiguous();
  return kind == tokenloom::ScaleKind::F16 ? int8_group<tokenloom::ScalesF16>(x, q, s, K, P, n, group, bias)
                                           : int8_group<tokenloom::ScalesBF16>(x, q, s, K, P, n, group, bias);
}

// Offsets per group and column (GGUF's Q4_K mins), float32 packed as the scales: [P, Kp / G, 32],
// and each row's sums of x over each group, in float32: [M, Kp / G].
struct Offsets {
  const float* o = nullptr;
  at::Tensor sums;  // [M, ng] float32
  const float* xsum = nullptr;
  int64_t ng = 0;
};

Offsets group_offsets(const at::Tensor& x, const c10::optional<at::Tensor>& offsets, int64_t P, int64_t Kp,
                      int64_t group) {
  Offsets off;
  if (!offsets.has_value() || !offsets->defined()) return off;
  off.ng = Kp / group;
  TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() && offsets->dim() == 3 &&
                  offsets->size(0) == P && offsets->size(1) == off.ng && offsets->size(2) == W,
              "group offsets: contiguous float32 [P, Kp / group, 32]");
  off.o = offsets->data_ptr<float>();
  const int64_t K = x.size(-1);
  auto xf = x.reshape({-1, K}).to(at::kFloat);
  if (Kp != K) xf = at::constant_pad_nd(xf, {0, Kp - K});
  off.sums = xf.reshape({-1, off.ng, group}).sum(-1).contiguous();
  off.xsum = off.sums.data_ptr<float>();
  return off;
}

// y [M, P * 32] float32 += the offsets' contribution (the float32 path; the integer path adds it per
// group inside its micro-kernel).
void add_offsets(float* y, int64_t M, int64_t P, const Offsets& off) {
  tokenloom::for_panel_runs(P, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t m = 0; m < M; ++m) {
        vf acc[NV];
        for (int j = 0; j < NV; ++j) acc[j] = vload(y + m * P * W + p * W + j * VL);
        for (int64_t g = 0; g < off.ng; ++g) {
          const vf xs = vset1(off.xsum[m * off.ng + g]);
          for (int j = 0; j < NV; ++j) acc[j] = vfma(vload(off.o + (p * off.ng + g) * W + j * VL), xs, acc[j]);
        }
        for (int j = 0; j < NV; ++j) vstore(y + m * P * W + p * W + j * VL, acc[j]);
      }
  });
}

template <typename SK>
at::Tensor int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t Kp, int64_t P, int64_t n,
                int64_t group, const c10::optional<at::Tensor>& bias, const Offsets& off) {
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const auto* sp = scale_ptr<SK>(s);
  const int64_t ng = Kp / group;
#ifdef TOKENLOOM_QUANT_VNNI
  namespace v = tokenloom::vnni;
  auto y = decode_vnni<v::Int4Quad>(x, Kp, P, n, bias, [&](int64_t p, const v::Limbs& xl, int64_t M, auto* yp,
                                                           int64_t ldy, int64_t ncols, const float* bp) {
    const v::GroupOffsets go{off.o ? off.o + p * ng * W : nullptr, off.xsum, off.ng};
    v::panel<SK>(xl, M, v::Int4Quad(qp + p * Kp * (W / 2)), Kp, group, nullptr, sp + p * ng * W, yp, ldy, ncols,
                 bp, go);
  });
  if (y.has_value()) return *y;
#endif
  Call c = begin(x, Kp, P, bias);
  if (c.M > 0) {
    gemm(c.x2.data_ptr<float>(), c.M, Kp, P, group, c.bias_ptr, c.y.data_ptr<float>(), [&](int64_t p, int64_t k0) {
      Int4Source<SK> src;
      src.q = qp + (p * Kp + k0) * (W / 2);
      src.sc = sp + (p * ng + k0 / group) * W;
      src.G = group;
      return src;
    });
    if (off.o) add_offsets(c.y.data_ptr<float>(), c.M, P, off);
  }
  return finish(c, x, n);
}

// `offsets` (optional, float32 like the scales' layout): y += sum_g offsets[g] * (x's sum over group g).
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t n,
                       int64_t group, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& offsets) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "quantized linear runs on CPU");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 3 && qweight.size(2) == W / 2,
              "int4 weight must be packed as [P, Kp, 16] uint8");
  const int64_t P = qweight.size(0), Kp = qweight.size(1);
  const auto kind = check_group_scales(scales, P, Kp, group, true);
  TORCH_CHECK(x.size(-1) <= Kp && x.size(-1) > Kp - group, "x has ", x.size(-1), " features, the weight ", Kp);
  TORCH_CHECK(P * W >= n, "n exceeds the packed panels");
  const auto q = qweight.contiguous();
  const auto s = scales.contiguous();
  const Offsets off = group_offsets(x, offsets, P, Kp, group);
  switch (kind) {
    case tokenloom::ScaleKind::F32: return int4<tokenloom::ScalesF32>(x, q, s, Kp, P, n, group, bias, off);
    case tokenloom::ScaleKind::F16: return int4<tokenloom::ScalesF16>(x, q, s, Kp, P, n, group, bias, off);
    default: return int4<tokenloom::ScalesBF16>(x, q, s, Kp, P, n, group, bias, off);
  }
}

}  // namespace

#if defined(TOKENLOOM_QUANT_VNNI)
#define TOKENLOOM_QNS tokenloom_q512v
#elif defined(__AVX512F__)
#define TOKENLOOM_QNS tokenloom_q512
#else
#define TOKENLOOM_QNS tokenloom_q256
#endif
#define TOKENLOOM_LIB(ns, m) TORCH_LIBRARY(ns, m)
#define TOKENLOOM_LIB_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TOKENLOOM_LIB(TOKENLOOM_QNS, m) {
  m.def("linear_int8(Tensor x, Tensor qweight, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor qweight, Tensor scales, int n, int group, Tensor? bias, Tensor? offsets=None) "
        "-> Tensor");
  m.def("linear_int8_group(Tensor x, Tensor qweight, Tensor scales, int n, int group, Tensor? bias) -> Tensor");
}

TOKENLOOM_LIB_IMPL(TOKENLOOM_QNS, CPU, m) {
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
  m.impl("linear_int8_group", &linear_int8_group);
}
