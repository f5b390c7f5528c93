// What every packed-linear op does besides its kernel (cpu_gemm*.cpp): flatten x to
// [M, K] in the dtype the kernel reads, allocate the float32 output, widen a bias padded
// to the panels, and give the output back in x's shape and dtype; and, for the two AVX-512
// kernels, which weights to prefetch next (`next_weights`) and the micro-kernel's epilogue
// (`store_tile`).  Shared by the AVX2, AVX-512 and AVX512-BF16 extensions, which are
// compiled separately with their own ISA flags and so cannot share one compiled function.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace tokenloom {

// The dtypes the quantized kernels' group scales come in (cpu_gemm_quant.cpp, quant_vnni.h):
// bfloat16 (our own int4), float16 (GGUF's Q4_0 / Q8_0 blocks, GPTQ's, AWQ's) or float32 (GGUF's
// Q4_K sub-block scales, a float16 times a 6-bit integer), each widened to float32 as loaded.
enum class ScaleKind { BF16, F16, F32 };
template <ScaleKind K>
struct Scales {
  static constexpr ScaleKind kind = K;
  using T = std::conditional_t<K == ScaleKind::F32, float, uint16_t>;
};
using ScalesBF16 = Scales<ScaleKind::BF16>;
using ScalesF16 = Scales<ScaleKind::F16>;
using ScalesF32 = Scales<ScaleKind::F32>;

struct LinearCall {
  at::Tensor x2;     // [M, K] contiguous, in the kernel's input dtype
  at::Tensor y;      // [M, n] float32, to be filled by the kernel
  at::Tensor bias;   // float32, padded to the panels, or undefined
  const float* bias_ptr = nullptr;
  int64_t M = 0;
  std::vector<int64_t> out_sizes;

  // y in x's leading shape and dtype.
  at::Tensor result(const at::Tensor& x) const { return y.view(out_sizes).to(x.scalar_type()); }
};

inline LinearCall begin_linear(const at::Tensor& x, int64_t K, int64_t n, int64_t padded_n,
                               const c10::optional<at::Tensor>& bias, at::ScalarType x_dtype) {
  LinearCall c;
  c.x2 = x.reshape({-1, K}).to(x_dtype).contiguous();
  c.M = c.x2.size(0);
  c.out_sizes = x.sizes().vec();
  c.out_sizes.back() = n;
  c.y = at::empty({c.M, n}, c.x2.options().dtype(at::kFloat));
  if (bias.has_value() && bias->defined()) {
    c.bias = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(c.bias.numel() >= padded_n, "bias must be padded to the panels");
    c.bias_ptr = c.bias.data_ptr<float>();
  }
  return c;
}

// At one row a GEMM streams each weight once and does little with it, and the hardware
// prefetchers alone do not run far enough ahead: reads then take turns with the arithmetic
// instead of overlapping it (docs/quantization.md, "Prefetching").  So every kernel prefetches
// its stream at two distances: near into L1, and further into L2, which can keep more lines in
// flight than L1's fill buffers.  A thread's run of panels is contiguous, so "ahead" is simply
// further along it, across panel ends too.
constexpr int64_t kStreamPrefetchBytes = 2048;     // into L1
constexpr int64_t kStreamPrefetchFarBytes = 8192;  // into L2

// One line of the stream at `p`: prefetch both distances ahead of it.
inline void prefetch_line(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kStreamPrefetchBytes, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(p) + kStreamPrefetchFarBytes, _MM_HINT_T1);
}

// What a micro-tile of R rows (of at most kTileRows) prefetches of the weights at `p` (one
// line).  One row: p is kStreamPrefetchBytes ahead of its reads; into L1 there, and into L2
// further on.  More rows: p is the next k-block (16 KB), prefetched by the row block's first
// micro-tile while it multiplies the current one: a full micro-tile prefetches it into L2 only,
// since in L1 (32 KB on AMD Zen 4) it evicts the block that this and the later micro-tiles still
// read (batch 12-32 GEMMs 1.1-1.3x faster, docs/performance.md); a smaller one, the row block's
// only micro-tile, into L1, as fast or faster there.
template <int R, int kTileRows>
inline void prefetch_weights(const void* p) {
  if constexpr (R == 1)
    _mm_prefetch(static_cast<const char*>(p) + (kStreamPrefetchFarBytes - kStreamPrefetchBytes), _MM_HINT_T1);
  _mm_prefetch(static_cast<const char*>(p), R < kTileRows ? _MM_HINT_T0 : _MM_HINT_T1);
}

// The same for `bytes` of the stream from `p`, one line at a time.
inline void prefetch_stream(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) prefetch_line(static_cast<const char*>(p) + b);
}

// The two AVX-512 GEMMs walk each thread's run of panels [p0, p1) k-block by k-block; the
// weights a thread reads after the block at k-offset k0 (kc long) of panel p: the rest of the
// panel, else the next panel's start, else nothing.  `ldw` is one k's elements in a panel, `K`
// a panel's k count.  What the first micro-tile of a block prefetches.
template <typename T>
inline const T* next_weights(const T* wp, int64_t p, int64_t p1, int64_t k0, int64_t kc, int64_t K, int64_t ldw) {
  if (k0 + kc < K) return wp + (p * K + k0 + kc) * ldw;
  if (p + 1 < p1) return wp + (p + 1) * K * ldw;
  return nullptr;
}

#ifdef __AVX512F__
// 16 float32 values rounded to bfloat16 (to nearest even, a NaN kept a quiet NaN), exactly as
// PyTorch's float -> bfloat16 conversion rounds.
inline __m256i round_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// round_to_bf16 by the CPU's own conversion, for CPUs with AVX512-BF16 (every AMX CPU; the
// callers check): one instruction instead of seven, the same bits -- but for denormals, which
// it takes as zero, and NaNs, whose payload it keeps: a vector holding either (found by one
// `vfpclassps`) takes round_to_bf16.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) inline __m256i convert_to_bf16(__m512 v) {
  if (_mm512_fpclass_ps_mask(v, 0xA1)) return round_to_bf16(v);  // 0xA1: a quiet or signalling NaN, a denormal
  return (__m256i)_mm512_cvtneps_pbh(v);
}

// The AVX-512 micro-kernels' epilogue (fp32 and bf16 GEMMs): each of R rows x NP 16-column
// panels sums its S interleaved partial sums and is written to y, plus the previous k-blocks'
// sums (`accumulate`) and, on the last k-block, the bias.  Only the last panel of an N that is
// not a multiple of 16 is partial: it is masked to its `ncols - 16 j` columns.
template <int S, int R, int NP>
inline void store_tile(const __m512 (&acc)[S][R][NP], float* y, int64_t ldy, bool accumulate, const float* bias,
                       int64_t ncols) {
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      __m512 v = acc[0][i][j];
#pragma GCC unroll 4
      for (int s = 1; s < S; ++s) v = _mm512_add_ps(v, acc[s][i][j]);
      float* yij = y + i * ldy + j * 16;
      const float* bj = bias ? bias + j * 16 : nullptr;
      const int64_t cols = std::min<int64_t>(16, ncols - j * 16);
      if (cols == 16) {
        if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(yij));
        if (bj) v = _mm512_add_ps(v, _mm512_loadu_ps(bj));
        _mm512_storeu_ps(yij, v);
      } else {
        const __mmask16 m = static_cast<__mmask16>((1u << cols) - 1);
        if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, yij));
        if (bj) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bj));
        _mm512_mask_storeu_ps(yij, m, v);
      }
    }
  }
}
#endif

}  // namespace tokenloom
