// bfloat16 decode GEMM for x86 CPUs with AVX512-BF16: y[M, N] = x[M, K] * W[N, K]^T (+ bias).
//
// The same idea as cpu_gemm_avx512.cpp (weights in 32-column panels, each thread's run of
// panels one sequential stream, read once per call), with the layout the AVX512-BF16
// dot-product instruction wants: vdpbf16ps multiplies 16 pairs of bf16 values and adds each
// pair's sum into one float32 lane.  So each panel stores its 32 columns as pairs of
// consecutive k ([ceil(N/32), ceil(K/2), 32, 2], zero-padded), two 64-byte vectors per
// k-pair (one per 16-column half), and an activation pair (x[k], x[k+1]) is broadcast as
// one 32-bit value.  At one row that is one instruction per 64 bytes of weights, so the
// stream is bound by memory, not by widening bf16 to float32 as the AVX2 kernel must.
// Products of bf16 values are exact in float32 and accumulation is float32, as in oneDNN's
// bf16 matmul.
//
// Some CPUs with AVX512-BF16 run that instruction far below their float32 FMA rate, so that
// it multiplies-adds fewer values a cycle than FMAs do (docs/performance.md, "bf16 on CPUs with
// a slow dot product").  There the same panels are multiplied the other way (`linear_fma`):
// each 64-byte vector is widened in registers into its even-k and odd-k float32 halves (a
// shift and a mask: a bf16 value is the top half of a float32) and multiplied by float32 FMAs,
// the activations packed as float32 pairs.  kernels/cpu.py `bf16_dot` measures both once and
// picks one for the process; every row count then takes the same one.
//
// Built as its own extension with AVX-512 flags (kernels/cpu.py loads it only where the CPU
// has avx512_bf16), so the AVX2 kernels never contain AVX-512 instructions.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "gemm_driver.h"
#include "panel_linear.h"
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t NR = 16;    // one 512-bit vector of float32 sums: half a panel
constexpr int64_t LDW = 2;    // vectors per k-pair of a panel (32 columns; kernels/cpu.py WIDE)
constexpr int64_t MR = 12;    // rows per micro-tile: 2 x 12 accumulators + 2 weight vectors of 32 zmm registers
constexpr int64_t KC2 = 128;  // k-pairs per block: 16 KB of a panel, reused from L1 by every micro-tile
// From this many rows each k-block's first micro-tile prefetches the block after it (the
// kernel is then bound by the dot products, and would stall on every new block); one row
// prefetches its stream a short way ahead instead (panel_linear.h `kStreamPrefetchBytes`).
constexpr int64_t kPrefetchRows = 2;
constexpr int64_t MC = 240;   // m-block: activations of one k-block (240 x 128 pairs x 4 B) stay in L2

// y[0:R, NP halves of a panel] (+)= x-pairs[0:kc, 0:R] . panel[0:kc]; S interleaved
// accumulator chains keep one or two rows from waiting on the instruction's latency.  Both
// halves at once (NP = 2) give each broadcast two uses.  `pf`, when set, is the block to
// prefetch, one line per half per k-pair.
template <int R, int NP, int S>
inline void micro(const uint32_t* x, const __m512bh* w, int64_t kc, float* y, int64_t ldy, bool accumulate,
                  const float* bias, int64_t ncols, const __m512bh* pf) {
  __m512 acc[S][R][NP];
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NP; ++j) acc[s][i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + S <= kc; k += S) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      __m512bh wv[NP];
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) {
        if (pf) tokenloom::prefetch_weights<R, MR>(pf + (k + s) * LDW + j);
        wv[j] = (__m512bh)_mm512_loadu_si512(w + (k + s) * LDW + j);  // loadu: a view may be unaligned
      }
#pragma GCC unroll 12
      for (int i = 0; i < R; ++i) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[(k + s) * R + i]));
#pragma GCC unroll 2
        for (int j = 0; j < NP; ++j) acc[s][i][j] = _mm512_dpbf16_ps(acc[s][i][j], a, wv[j]);
      }
    }
  }
  for (; k < kc; ++k) {
    __m512bh wv[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + k * LDW + j);
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[k * R + i]));
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[0][i][j] = _mm512_dpbf16_ps(acc[0][i][j], a, wv[j]);
    }
  }
  tokenloom::store_tile<S, R, NP>(acc, y, ldy, accumulate, bias, ncols);
}

// `micro` computed with float32 FMAs: x is [kc][R][2] float32 pairs; each k-pair's weight
// vector gives its even-k values (shifted up 16 bits) and odd-k values (low half masked off),
// and each row's sum takes the even product, then the odd one.
template <int R, int NP>
inline void micro_fma(const float* x, const __m512bh* w, int64_t kc, float* y, int64_t ldy, bool accumulate,
                      const float* bias, int64_t ncols, const __m512bh* pf) {
  __m512 acc[1][R][NP];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NP; ++j) acc[0][i][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < kc; ++k) {
    __m512 even[NP], odd[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      if (pf) tokenloom::prefetch_weights<R, MR>(pf + k * LDW + j);
      const __m512i v = _mm512_loadu_si512(w + k * LDW + j);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(x[(k * R + i) * 2]), b = _mm512_set1_ps(x[(k * R + i) * 2 + 1]);
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[0][i][j] = _mm512_fmadd_ps(b, odd[j], _mm512_fmadd_ps(a, even[j], acc[0][i][j]));
    }
  }
  tokenloom::store_tile<1, R, NP>(acc, y, ldy, accumulate, bias, ncols);
}

// One micro-tile of R rows through either kernel (kFma: x is float32 pairs, else bf16 pairs).
template <bool kFma, int R, int NP>
inline void tile(const void* x, const __m512bh* w, int64_t kc, float* y, int64_t ldy, bool accumulate,
                 const float* bias, int64_t ncols, const __m512bh* pf) {
  if constexpr (kFma)
    micro_fma<R, NP>(static_cast<const float*>(x), w, kc, y, ldy, accumulate, bias, ncols, pf);
  else
    micro<R, NP, 1>(static_cast<const uint32_t*>(x), w, kc, y, ldy, accumulate, bias, ncols, pf);
}

// Every row count sums its products in the same order (S = 1, one chain per row and half), so
// a row's result does not depend on how many rows share the call: a speculative verifying step
// (k + 1 rows) then gives exactly what k + 1 one-row steps would.  Interleaving chains (S > 1)
// at one or two rows was not measurably faster, the weight stream being the limit there.
template <bool kFma, int NP>
void micro_rows(int64_t rows, const void* x, const __m512bh* w, int64_t kc, float* y, int64_t ldy,
                bool accumulate, const float* bias, int64_t ncols, const __m512bh* pf) {
  switch (rows) {
#define TOKENLOOM_ROWS(r) \
    case r: return tile<kFma, r, NP>(x, w, kc, y, ldy, accumulate, bias, ncols, pf);
    TOKENLOOM_ROWS(1) TOKENLOOM_ROWS(2) TOKENLOOM_ROWS(3) TOKENLOOM_ROWS(4) TOKENLOOM_ROWS(5)
    TOKENLOOM_ROWS(6) TOKENLOOM_ROWS(7) TOKENLOOM_ROWS(8) TOKENLOOM_ROWS(9) TOKENLOOM_ROWS(10)
    TOKENLOOM_ROWS(11)
#undef TOKENLOOM_ROWS
    default: return tile<kFma, 12, NP>(x, w, kc, y, ldy, accumulate, bias, ncols, pf);
  }
}

// x [M, K] bf16 row-major -> tiles of MR rows, each [K2, rows] of (x[k], x[k+1]) pairs; an odd
// K gets a zero partner (the panel's padded k row is zero too).
void pack_rows(const uint16_t* x, int64_t M, int64_t K, int64_t K2, uint32_t* out) {
  tokenloom::for_row_tiles(M, MR, [&](int64_t m, int64_t r) {
    uint32_t* dst = out + m * K2;
    for (int64_t i = 0; i < r; ++i) {
      const uint16_t* src = x + (m + i) * K;
      for (int64_t j = 0; j < K2; ++j) {
        const uint32_t lo = src[2 * j], hi = 2 * j + 1 < K ? src[2 * j + 1] : 0;
        dst[j * r + i] = lo | (hi << 16);
      }
    }
  });
}

// The same tiles for `micro_fma`: [K2, rows, 2] float32 pairs (a bf16 value's bits, shifted up,
// are its float32 value's).  A one-row tile is the row itself, widened in order.
void pack_rows_f32(const uint16_t* x, int64_t M, int64_t K, int64_t K2, float* out) {
  tokenloom::for_row_tiles(M, MR, [&](int64_t m, int64_t r) {
    uint32_t* dst = reinterpret_cast<uint32_t*>(out) + m * K2 * 2;
    for (int64_t i = 0; i < r; ++i) {
      const uint16_t* src = x + (m + i) * K;
      if (r == 1) {
        for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<uint32_t>(src[k]) << 16;
        if (K % 2) dst[K] = 0;  // an odd K's zero partner
        continue;
      }
      for (int64_t j = 0; j < K2; ++j) {
        dst[(j * r + i) * 2] = static_cast<uint32_t>(src[2 * j]) << 16;
        dst[(j * r + i) * 2 + 1] = 2 * j + 1 < K ? static_cast<uint32_t>(src[2 * j + 1]) << 16 : 0;
      }
    }
  });
}

// rows x cols of float32 y (row stride ldy) rounded to bfloat16 into y16, to nearest even with
// NaN kept a quiet NaN, exactly as PyTorch's float -> bfloat16 conversion does.
void round_tile(const float* y, int64_t ldy, int64_t rows, int64_t cols, at::BFloat16* y16) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; c += NR) {
      const __mmask16 m = static_cast<__mmask16>(cols - c >= NR ? 0xFFFF : (1u << (cols - c)) - 1);
      _mm256_mask_storeu_epi16(y16 + i * ldy + c, m, tokenloom::round_to_bf16(_mm512_maskz_loadu_ps(m, y + i * ldy + c)));
    }
}

// y16, when given, receives y rounded to bfloat16 tile by tile as each is finished (still in
// cache), instead of in a separate pass over y afterwards.
template <bool kFma>
void gemm(const void* xp, int64_t M, int64_t K2, const __m512bh* wp, int64_t N, const float* bias, float* y,
          at::BFloat16* y16) {
  // activations per row and k-pair: one bf16 pair (4 bytes), or two float32 (8)
  const int64_t xb = kFma ? 8 : 4;
  const int64_t W = NR * LDW;  // columns per panel
  const bool prefetch = M >= kPrefetchRows;
  tokenloom::for_panels((N + W - 1) / W, M, MC, [&](int64_t p, int64_t p1, int64_t m0, int64_t m1) {
    const int64_t ncols = std::min(W, N - p * W);
    for (int64_t k0 = 0; k0 < K2; k0 += KC2) {
      const int64_t kc = std::min(KC2, K2 - k0);
      const float* b = (bias && k0 + kc == K2) ? bias + p * W : nullptr;
      const __m512bh* w = wp + (p * K2 + k0) * LDW;
      const __m512bh* next = prefetch ? tokenloom::next_weights(wp, p, p1, k0, kc, K2, LDW)
                                      : w + tokenloom::kStreamPrefetchBytes / sizeof(*w);
      for (int64_t m = m0; m < m1; m += MR) {
        const int64_t r = std::min(MR, m1 - m);
        const void* xt = static_cast<const char*>(xp) + (m * K2 + k0 * r) * xb;
        float* yt = y + m * N + p * W;
        const __m512bh* pf = m == m0 ? next : nullptr;
        if (ncols > NR)
          micro_rows<kFma, 2>(r, xt, w, kc, yt, N, k0 > 0, b, ncols, pf);
        else  // a last panel of at most 16 columns: its zero half is not multiplied
          micro_rows<kFma, 1>(r, xt, w, kc, yt, N, k0 > 0, b, ncols, pf);
        if (y16 && k0 + kc == K2) round_tile(yt, N, r, ncols, y16 + m * N + p * W);
      }
    }
  });
}

// weight_packed: [ceil(N/32), ceil(K/2), 32, 2] bfloat16; bias: None or float32 [ceil(N/32) * 32].
// kFma: multiply by float32 FMAs on the widened weights (`micro_fma`), else by vdpbf16ps.
template <bool kFma>
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight_packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight_packed.device().is_cpu(), "tokenloom_bf16::linear runs on CPU");
  TORCH_CHECK(weight_packed.scalar_type() == at::kBFloat16 && weight_packed.dim() == 4 &&
                  weight_packed.size(2) == NR * LDW && weight_packed.size(3) == 2,
              "weight must be bfloat16 packed as [P, ceil(K/2), 32, 2]");
  const int64_t K = x.size(-1), K2 = weight_packed.size(1);
  TORCH_CHECK((K + 1) / 2 == K2, "x has ", K, " features, the packed weight ", K2, " pairs");
  TORCH_CHECK(weight_packed.size(0) * NR * LDW >= n, "n exceeds the packed panels");
  const auto wp = weight_packed.contiguous();
  const auto c = tokenloom::begin_linear(x, K, n, weight_packed.size(0) * NR * LDW, bias, at::kBFloat16);
  // A bfloat16 x gets a bfloat16 y, rounded by the kernel (a float32 x keeps float32).
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  auto y16 = bf16_out ? at::empty_like(c.y, c.y.options().dtype(at::kBFloat16)) : at::Tensor();
  if (c.M > 0) {
    const auto* x16 = reinterpret_cast<const uint16_t*>(c.x2.data_ptr<at::BFloat16>());
    at::Tensor xp;
    const void* xpp;
    if (kFma) {
      xp = at::empty({c.M * K2 * 2}, c.x2.options().dtype(at::kFloat));
      pack_rows_f32(x16, c.M, K, K2, xp.data_ptr<float>());
      xpp = xp.data_ptr<float>();
    } else if (c.M == 1 && K % 2 == 0) {  // one row's (x[k], x[k+1]) pairs are its own bytes, in order
      xpp = x16;
    } else {
      xp = at::empty({c.M * K2}, c.x2.options().dtype(at::kInt));
      pack_rows(x16, c.M, K, K2, reinterpret_cast<uint32_t*>(xp.data_ptr<int32_t>()));
      xpp = xp.data_ptr<int32_t>();
    }
    gemm<kFma>(xpp, c.M, K2, reinterpret_cast<const __m512bh*>(wp.data_ptr<at::BFloat16>()), n, c.bias_ptr,
               c.y.data_ptr<float>(), bf16_out ? y16.data_ptr<at::BFloat16>() : nullptr);
  }
  return bf16_out ? y16.view(c.out_sizes) : c.result(x);
}

// Multiply-adds per second of one core through each way, a full 12-row tile over a block of
// weights held in L1 (no memory in the way): [vdpbf16ps, float32 FMAs].  What `bf16_dot`
// (kernels/cpu.py) chooses by.
at::Tensor dot_rates() {
  constexpr int64_t kc = 64;  // k-pairs: 8 KB of weights
  std::vector<__m512bh> w(kc * LDW);
  for (auto& v : w) v = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // pairs of 1.0
  std::vector<uint32_t> x16(kc * MR, 0x3f803f80u);
  std::vector<float> x32(kc * MR * 2, 1.0f), y(MR * NR * LDW);
  const double macs = double(kc) * 2 * MR * NR * LDW;
  double best[2] = {0.0, 0.0};
  for (int round = 0; round < 3; ++round)
    for (int way = 0; way < 2; ++way) {
      const int reps = 2000;
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) {
        if (way == 0)
          micro<MR, 2, 1>(x16.data(), w.data(), kc, y.data(), NR * LDW, false, nullptr, NR * LDW, nullptr);
        else
          micro_fma<MR, 2>(x32.data(), w.data(), kc, y.data(), NR * LDW, false, nullptr, NR * LDW, nullptr);
        asm volatile("" : : "r"(y.data()) : "memory");
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best[way] = std::max(best[way], macs * reps / s);
    }
  auto out = at::empty({2}, at::kDouble);
  out[0] = best[0];
  out[1] = best[1];
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_bf16, m) {
  m.def("linear(Tensor x, Tensor weight_packed, int n, Tensor? bias) -> Tensor");
  m.def("linear_fma(Tensor x, Tensor weight_packed, int n, Tensor? bias) -> Tensor");
  m.def("dot_rates() -> Tensor", &dot_rates);  // no tensor arguments: one kernel for every key
}

TORCH_LIBRARY_IMPL(tokenloom_bf16, CPU, m) {
  m.impl("linear", &linear_bf16<false>);
  m.impl("linear_fma", &linear_bf16<true>);
}
