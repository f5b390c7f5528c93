// float32 decode GEMM for x86 CPUs with AVX-512: y[M, N] = x[M, K] * W[N, K]^T (+ bias).
//
// W is packed in 32-column panels ([ceil(N/32), K, 32], kernels/cpu.py `pack(w, WIDE)`):
// one k of a panel is 128 contiguous bytes, two cache lines and two zmm registers.  At a
// few dozen rows a decode step is bound by the FMA units, not by memory, so the
// micro-kernel is shaped for FMA throughput: it multiplies both 16-column halves of a panel
// (two weight vectors per k) by up to 12 activation rows, 24 accumulators of the 32 zmm
// registers, so each weight load feeds 12 FMAs and each broadcast 2.  At one row it is a
// memory stream, and the layout is what matters: each thread reads its run of panels as
// one sequential stream, which the hardware prefetchers serve best.  (16-column panels read
// two at a time were two interleaved streams per thread and streamed measurably slower;
// the figures are in docs/performance.md, "Why each CPU kernel is chosen".)  From 16 rows
// up the activations are read in place (`kDirectRows`); below, from a k-major copy of each
// 12-row tile.
//
// Built as its own extension with AVX-512 flags (kernels/cpu.py loads it only where the CPU
// has AVX-512), so the AVX2 kernels never contain AVX-512 instructions.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "gemm_driver.h"
#include "panel_linear.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t NR = 16;   // one zmm of float32: half a panel
constexpr int64_t LDW = 32;  // panel width (kernels/cpu.py WIDE): floats per k of a panel
constexpr int64_t MR = 12;   // rows per micro-tile: 2 x 12 accumulators + 2 weight vectors of 32 registers
constexpr int64_t KC = 128;  // k-block: 16 KB of a panel, reused from L1 by every micro-tile
constexpr int64_t MC = 240;  // m-block: activations of one k-block (240 x 128 x 4 B) stay in L2
// From this many rows the micro-kernel reads x in place (a row's next 16 k share one line)
// instead of from a k-major copy: packing costs a pass over x per call, which pays back only
// at a few rows, where each packed value is reused across the most FMAs per load (measured
// crossover: docs/performance.md, "The AVX-512 fp32 GEMM's row thresholds").
constexpr int64_t kDirectRows = 16;
// From this many rows each k-block's first micro-tile prefetches the block after it: there
// the kernel is FMA-bound and would otherwise stall on every new block (the same section has
// the figures).  One row prefetches its stream a short way ahead instead (panel_linear.h
// `kStreamPrefetchBytes`); prefetching the whole next block there was slower.
constexpr int64_t kPrefetchRows = 2;

// y[0:R, NP halves of a panel] (+)= x[0:kc, 0:R] * panel[0:kc]; S interleaved accumulator
// chains keep one or two rows from waiting on FMA latency.
template <int R, int NP, int S, bool DIRECT>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t kc, float* y, int64_t ldy, bool accumulate,
                  const float* bias, int64_t ncols, const float* pf) {
  __m512 acc[S][R][NP];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[s][i][j] = _mm512_setzero_ps();

  int64_t k = 0;
  for (; k + S <= kc; k += S) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      __m512 wv[NP];
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) {
        if (pf) tokenloom::prefetch_weights<R, MR>(pf + (k + s) * LDW + j * NR);
        wv[j] = _mm512_loadu_ps(w + (k + s) * LDW + j * NR);  // loadu: a view may be unaligned
      }
#pragma GCC unroll 12
      for (int i = 0; i < R; ++i) {
        const __m512 a = _mm512_set1_ps(DIRECT ? x[i * ldx + k + s] : x[(k + s) * R + i]);
#pragma GCC unroll 2
        for (int j = 0; j < NP; ++j) acc[s][i][j] = _mm512_fmadd_ps(a, wv[j], acc[s][i][j]);
      }
    }
  }
  for (; k < kc; ++k) {  // tail when S does not divide kc
    __m512 wv[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) wv[j] = _mm512_loadu_ps(w + k * LDW + j * NR);
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(DIRECT ? x[i * ldx + k] : x[k * R + i]);
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[0][i][j] = _mm512_fmadd_ps(a, wv[j], acc[0][i][j]);
    }
  }
  tokenloom::store_tile<S, R, NP>(acc, y, ldy, accumulate, bias, ncols);
}

// Every row count sums in the same order (S = 1): a row's result does not depend on the rows
// beside it (cpu_gemm_bf16.cpp says why that matters).
template <int NP, bool DIRECT>
void micro_rows(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t kc, float* y, int64_t ldy,
                bool accumulate, const float* bias, int64_t ncols, const float* pf) {
  switch (rows) {
    case 1: return micro<1, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 2: return micro<2, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 3: return micro<3, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 4: return micro<4, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 5: return micro<5, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 6: return micro<6, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 7: return micro<7, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 8: return micro<8, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 9: return micro<9, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 10: return micro<10, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 11: return micro<11, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
    default: return micro<12, NP, 1, DIRECT>(x, ldx, w, kc, y, ldy, accumulate, bias, ncols, pf);
  }
}

// x: packed in row tiles (gemm_driver.h pack_row_tiles), or (`direct`) the row-major [M, K]
// input itself.
template <bool DIRECT>
void gemm(const float* xp, int64_t M, int64_t K, const float* wp, int64_t N, const float* bias, float* y) {
  const bool prefetch = M >= kPrefetchRows;
  tokenloom::for_panels((N + LDW - 1) / LDW, M, MC, [&](int64_t p, int64_t p1, int64_t m0, int64_t m1) {
    const int64_t ncols = std::min(LDW, N - p * LDW);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      const float* b = (bias && k0 + kc == K) ? bias + p * LDW : nullptr;
      const float* w = wp + (p * K + k0) * LDW;
      // Prefetched by the first micro-tile, which stalls on these weights otherwise.
      const float* next = prefetch ? tokenloom::next_weights(wp, p, p1, k0, kc, K, LDW)
                                   : w + tokenloom::kStreamPrefetchBytes / sizeof(*w);
      for (int64_t m = m0; m < m1; m += MR) {
        const int64_t r = std::min(MR, m1 - m);
        const float* xt = xp + m * K + (DIRECT ? k0 : k0 * r);
        float* yt = y + m * N + p * LDW;
        const float* pf = m == m0 ? next : nullptr;
        if (ncols > NR)
          micro_rows<2, DIRECT>(r, xt, K, w, kc, yt, N, k0 > 0, b, ncols, pf);
        else  // a last panel of at most 16 columns: its zero half is not multiplied
          micro_rows<1, DIRECT>(r, xt, K, w, kc, yt, N, k0 > 0, b, ncols, pf);
      }
    }
  });
}

// weight_packed: [ceil(N/16), K, 16] float32; bias: None or float32 [ceil(N/16) * 16].
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& weight_packed, int64_t n,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight_packed.device().is_cpu(), "tokenloom_avx512::linear runs on CPU");
  TORCH_CHECK(weight_packed.scalar_type() == at::kFloat && weight_packed.dim() == 3 && weight_packed.size(2) == LDW,
              "weight must be float32 packed as [P, K, 32]");
  const int64_t K = weight_packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(weight_packed.size(0) * LDW >= n, "n exceeds the packed panels");
  const auto wp = weight_packed.contiguous();
  const auto c = tokenloom::begin_linear(x, K, n, weight_packed.size(0) * LDW, bias, at::kFloat);
  if (c.M >= kDirectRows || c.M == 1) {  // one row: its k-major copy would be itself
    gemm<true>(c.x2.data_ptr<float>(), c.M, K, wp.data_ptr<float>(), n, c.bias_ptr, c.y.data_ptr<float>());
  } else if (c.M > 0) {
    auto xp = at::empty({c.M * K}, c.x2.options());
    tokenloom::pack_row_tiles(c.x2.data_ptr<float>(), c.M, K, MR, xp.data_ptr<float>());
    gemm<false>(xp.data_ptr<float>(), c.M, K, wp.data_ptr<float>(), n, c.bias_ptr, c.y.data_ptr<float>());
  }
  return c.result(x);
}

}  // namespace

TORCH_LIBRARY(tokenloom_avx512, m) {
  m.def("linear(Tensor x, Tensor weight_packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_avx512, CPU, m) {
  m.impl("linear", &linear_f32);
}
