// Decode GEMM for x86 CPUs with AVX2 + FMA: y[M, N] = x[M, K] * W[N, K]^T (+ bias).
//
// A decode step multiplies a few activation rows (one per running request) by every
// weight matrix, so its speed is the speed at which the weights stream through the
// cores: at one row the product is bound by memory bandwidth, at a few dozen rows by the
// FMA units.  One blocked layout serves both ends:
//
//   W is stored as panels of NR = 16 output columns, each panel K rows of 16 values
//   ([ceil(N/16), K, 16], zero-padded), so a panel is one contiguous stream.
//
// The micro-kernel keeps an R x 16 tile of y in 2R ymm registers and, for each k, loads
// 16 weights (two vectors) and broadcasts one activation per row: R <= 6 rows use 12
// accumulators, the register file's budget.  Weights are read from memory exactly once
// per call when M <= MC; the activations of a k-block stay in L1/L2 while every panel
// passes by.  bfloat16 weights are widened to float32 in registers (a shift), so bf16
// halves the bytes streamed at batch 1 and costs only two extra instructions per 12
// FMAs at batch 32.  Accumulation is float32 throughout.
//
// Registered as torch ops (namespace tokenloom_cpu) so that PyTorch's thread pool runs
// the panels (gemm_driver.h) and torch.compile can call it as an opaque kernel.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "gemm_driver.h"
#include "panel_linear.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t NR = 16;   // panel width: two 8-float vectors
constexpr int64_t MR = 6;    // rows per micro-tile: 12 accumulators + 2 weights + 1 broadcast <= 16 ymm
// k-block: 16 KB of weights (256 fp32 or 512 bf16 rows of a panel), reused from L1 by
// every micro-tile, and the prefetch distance when streaming.
template <typename T>
constexpr int64_t KC = 16384 / (NR * sizeof(T));
constexpr int64_t MC = 192;  // m-block: activations of one k-block (192 x 256 x 4 B = 192 KB for fp32 weights) stay in L2

inline void load_w(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}

inline void load_w(const uint16_t* w, __m256& w0, __m256& w1) {
  // bf16 is the top half of an fp32: widen each 16-bit value and shift it into place.
  const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8)));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
}

// y[0:R, 0:ncols] (+)= x[0:R, 0:kc] * panel[0:kc, 0:16], plus bias on the last k-block.
// x is a packed tile: the R activations of each k side by side, so the broadcasts read
// one contiguous stream.  S accumulator sets split the k loop into interleaved chains:
// at one or two rows a single chain would wait on FMA latency instead of on memory.
// `pf`, when set, is the next weight block: prefetched one cache line per k so that it
// arrives from DRAM while this block is being multiplied.
template <int R, int S, typename T>
inline void micro(const float* x, const T* w, int64_t kc, float* y, int64_t ldy,
                  bool accumulate, const float* bias, int64_t ncols, const T* pf) {
  __m256 acc[S][R][2];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) acc[s][i][0] = acc[s][i][1] = _mm256_setzero_ps();

  int64_t k = 0;
  for (; k + S <= kc; k += S) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      __m256 w0, w1;
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + (k + s) * NR), _MM_HINT_T0);
      load_w(w + (k + s) * NR, w0, w1);
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i) {
        const __m256 a = _mm256_broadcast_ss(x + (k + s) * R + i);
        acc[s][i][0] = _mm256_fmadd_ps(a, w0, acc[s][i][0]);
        acc[s][i][1] = _mm256_fmadd_ps(a, w1, acc[s][i][1]);
      }
    }
  }
  for (; k < kc; ++k) {  // tail when S does not divide kc
    __m256 w0, w1;
    load_w(w + k * NR, w0, w1);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + k * R + i);
      acc[0][i][0] = _mm256_fmadd_ps(a, w0, acc[0][i][0]);
      acc[0][i][1] = _mm256_fmadd_ps(a, w1, acc[0][i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    __m256 v0 = acc[0][i][0], v1 = acc[0][i][1];
#pragma GCC unroll 4
    for (int s = 1; s < S; ++s) {
      v0 = _mm256_add_ps(v0, acc[s][i][0]);
      v1 = _mm256_add_ps(v1, acc[s][i][1]);
    }
    float* yi = y + i * ldy;
    if (ncols == NR) {
      if (accumulate) {
        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(yi));
        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(yi + 8));
      }
      if (bias) {
        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias));
        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias + 8));
      }
      _mm256_storeu_ps(yi, v0);
      _mm256_storeu_ps(yi + 8, v1);
    } else {  // the last panel of an N that is not a multiple of 16
      alignas(32) float tmp[NR];
      _mm256_store_ps(tmp, v0);
      _mm256_store_ps(tmp + 8, v1);
      for (int64_t j = 0; j < ncols; ++j)
        yi[j] = (accumulate ? yi[j] : 0.0f) + tmp[j] + (bias ? bias[j] : 0.0f);
    }
  }
}

template <typename T>
void micro_rows(int64_t rows, const float* x, const T* w, int64_t kc, float* y, int64_t ldy, bool accumulate,
                const float* bias, int64_t ncols, const T* pf) {
  switch (rows) {
    case 1: return micro<1, 4, T>(x, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 2: return micro<2, 2, T>(x, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 3: return micro<3, 2, T>(x, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 4: return micro<4, 1, T>(x, w, kc, y, ldy, accumulate, bias, ncols, pf);
    case 5: return micro<5, 1, T>(x, w, kc, y, ldy, accumulate, bias, ncols, pf);
    default: return micro<6, 1, T>(x, w, kc, y, ldy, accumulate, bias, ncols, pf);
  }
}

template <typename T>
void gemm(const float* xp, int64_t M, int64_t K, const T* wp, int64_t N, const float* bias, float* y) {
  tokenloom::for_panels((N + NR - 1) / NR, M, MC, [&](int64_t p, int64_t p1, int64_t m0, int64_t m1) {
    const T* panel = wp + p * K * NR;
    const int64_t ncols = std::min(NR, N - p * NR);
    for (int64_t k0 = 0; k0 < K; k0 += KC<T>) {
      const int64_t kc = std::min(KC<T>, K - k0);
      const float* b = (bias && k0 + kc == K) ? bias + p * NR : nullptr;
      // The weights that follow this block in memory (next k-block or next panel);
      // past this thread's last block the prefetch is simply wasted.
      const T* next = (p + 1 < p1 || k0 + kc < K) ? panel + (k0 + kc) * NR : nullptr;
      for (int64_t m = m0; m < m1; m += MR) {
        const int64_t r = std::min(MR, m1 - m);
        micro_rows<T>(r, xp + m * K + k0 * r, panel + k0 * NR, kc, y + m * N + p * NR, N, k0 > 0, b, ncols,
                      m == m0 ? next : nullptr);
      }
    }
  });
}

// weight_packed: [ceil(N/16), K, 16] float32 or bfloat16; bias: None or float32 [ceil(N/16) * 16].
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight_packed, int64_t n,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight_packed.device().is_cpu(), "tokenloom_cpu::linear runs on CPU");
  TORCH_CHECK(weight_packed.dim() == 3 && weight_packed.size(2) == NR, "weight must be packed as [P, K, 16]");
  const int64_t K = weight_packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(weight_packed.size(0) * NR >= n, "n exceeds the packed panels");
  const auto wp = weight_packed.contiguous();
  const auto c = tokenloom::begin_linear(x, K, n, weight_packed.size(0) * NR, bias, at::kFloat);
  if (c.M > 0) {
    auto xp = at::empty({c.M * K}, c.x2.options());
    tokenloom::pack_row_tiles(c.x2.data_ptr<float>(), c.M, K, MR, xp.data_ptr<float>());
    if (wp.scalar_type() == at::kFloat) {
      gemm<float>(xp.data_ptr<float>(), c.M, K, wp.data_ptr<float>(), n, c.bias_ptr, c.y.data_ptr<float>());
    } else {
      TORCH_CHECK(wp.scalar_type() == at::kBFloat16, "packed weights must be float32 or bfloat16");
      gemm<uint16_t>(xp.data_ptr<float>(), c.M, K, reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>()), n,
                     c.bias_ptr, c.y.data_ptr<float>());
    }
  }
  return c.result(x);
}

}  // namespace

TORCH_LIBRARY(tokenloom_cpu, m) {
  m.def("linear(Tensor x, Tensor weight_packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("linear", &linear);
}
