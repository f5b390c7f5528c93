// Batched LoRA for x86 CPUs with AVX2 + FMA: every adapter's delta of one linear, for every
// row of a step, in one call (model/lora.py describes the layout).
//
// A step's rows come grouped by adapter (segments of rows, each on one weight slot).  For
// one linear the deltas are two small matmuls per segment, a shrink t = x A^T ([n, S*R]: S
// sub-adapters of rank R, q/k/v of a fused qkv) and an expand y[:, sub] += t_sub B_sub^T.
// As PyTorch ops that is 2..4 dispatches per segment per linear, each costing more than its
// arithmetic at decode's few rows; here it is one call and two passes:
//
//   1. shrink, split over the S*R rank rows of A: each A row is read once per block of up to
//      four rows of x and dotted with all of them (float32 accumulation);
//   2. expand, split over y's columns: for a block of rows and 16 columns, y += sum_k t[k] *
//      B^T[k, cols], reading B^T ([R, out], each rank row contiguous) once per row block.
//
// x, A, B^T and y share one dtype, float32 or bfloat16 (widened to float32 as they load; y
// is rounded once, to nearest even, after its delta is added).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kMR = 4;  // rows of x per block

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {  // round to nearest even; NaN stays a quiet NaN
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                                   _mm256_extracti128_si256(r, 1)));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct Segment {
  int64_t start, end, slot;
};

// t[r, j] = x[row r] . A[slot, j] for rank rows j0..j1-1 of every segment's rows.
template <typename T>
void shrink(const T* x, int64_t x_stride, const T* a, int64_t sr, int64_t in, const std::vector<Segment>& segs,
            float* t, int64_t j0, int64_t j1) {
  const int64_t in8 = in / 8 * 8;
  int64_t trow = 0;  // t's row of the segment's first row
  for (const Segment& s : segs) {
    const T* as = a + s.slot * sr * in;
    for (int64_t r0 = s.start; r0 < s.end; r0 += kMR) {
      const int64_t mr = std::min(kMR, s.end - r0);
      const T* xr[kMR];
      for (int64_t m = 0; m < kMR; ++m) xr[m] = x + (r0 + std::min(m, mr - 1)) * x_stride;
      for (int64_t j = j0; j < j1; ++j) {
        const T* aj = as + j * in;
        __m256 acc[kMR] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < in8; i += 8) {
          const __m256 av = load8(aj + i);
          for (int64_t m = 0; m < kMR; ++m) acc[m] = _mm256_fmadd_ps(load8(xr[m] + i), av, acc[m]);
        }
        for (int64_t m = 0; m < mr; ++m) {
          float v = hsum(acc[m]);
          for (int64_t i = in8; i < in; ++i) v += static_cast<float>(xr[m][i]) * static_cast<float>(aj[i]);
          t[(trow + (r0 - s.start) + m) * sr + j] = v;
        }
      }
    }
    trow += s.end - s.start;
  }
}

// Rows r0..r0+MR-1 of y, columns c0..c1-1 (inside one sub): y += t_sub B_sub^T.
template <int MR, typename T>
void expand_rows(T* y, int64_t y_stride, const T* bs, int64_t rank, int64_t out, const float* tr, int64_t sr,
                 int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + 16 <= c1; c += 16) {
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) {
      acc[m][0] = load8(y + m * y_stride + c);
      acc[m][1] = load8(y + m * y_stride + c + 8);
    }
    for (int64_t k = 0; k < rank; ++k) {
      const __m256 b0 = load8(bs + k * out + c), b1 = load8(bs + k * out + c + 8);
      for (int m = 0; m < MR; ++m) {
        const __m256 tk = _mm256_broadcast_ss(tr + m * sr + k);
        acc[m][0] = _mm256_fmadd_ps(tk, b0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(tk, b1, acc[m][1]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      store8(y + m * y_stride + c, acc[m][0]);
      store8(y + m * y_stride + c + 8, acc[m][1]);
    }
  }
  for (; c < c1; ++c) {
    for (int m = 0; m < MR; ++m) {
      float v = static_cast<float>(y[m * y_stride + c]);
      for (int64_t k = 0; k < rank; ++k) v += tr[m * sr + k] * static_cast<float>(bs[k * out + c]);
      y[m * y_stride + c] = static_cast<T>(v);
    }
  }
}

// y[row, c] += sum_k t[row, sub * R + k] * B^T[slot, k, c] for columns c0..c1-1 (inside one sub).
template <typename T>
void expand(T* y, int64_t y_stride, const T* bt, int64_t rank, int64_t out, const std::vector<Segment>& segs,
            const float* t, int64_t sr, int64_t sub, int64_t c0, int64_t c1) {
  int64_t trow = 0;
  for (const Segment& s : segs) {
    const T* bs = bt + s.slot * rank * out;
    for (int64_t r0 = s.start; r0 < s.end; r0 += kMR) {
      const float* tr = t + (trow + (r0 - s.start)) * sr + sub * rank;
      T* yr = y + r0 * y_stride;
      switch (std::min(kMR, s.end - r0)) {
        case 4: expand_rows<4>(yr, y_stride, bs, rank, out, tr, sr, c0, c1); break;
        case 3: expand_rows<3>(yr, y_stride, bs, rank, out, tr, sr, c0, c1); break;
        case 2: expand_rows<2>(yr, y_stride, bs, rank, out, tr, sr, c0, c1); break;
        default: expand_rows<1>(yr, y_stride, bs, rank, out, tr, sr, c0, c1); break;
      }
    }
    trow += s.end - s.start;
  }
}

template <typename T>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
         const std::vector<Segment>& segs, const std::vector<int64_t>& subs, int64_t rank) {
  const int64_t in = x.size(1), out = y.size(1), sr = a.size(1);
  int64_t rows = 0;
  for (const Segment& s : segs) rows += s.end - s.start;
  std::vector<float> t(static_cast<size_t>(rows * sr));
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // Split only work that pays for a second thread: at least ~256K multiply-adds (some ten
  // microseconds) each.  (A parallel region waits for its slowest thread: on a machine busier
  // than its cores, one descheduled thread stalls it -- as it does the base model's GEMMs.)
  constexpr int64_t kGrainMacs = int64_t{1} << 18;
  const int64_t shrink_grain = std::max<int64_t>(1, kGrainMacs / std::max<int64_t>(1, rows * in));
  at::parallel_for(0, sr, shrink_grain, [&](int64_t j0, int64_t j1) {
    shrink(xp, x.stride(0), ap, sr, in, segs, t.data(), j0, j1);
  });
  const int64_t nsub = static_cast<int64_t>(subs.size()) / 2;
  const int64_t col_grain = std::max<int64_t>(16, kGrainMacs / std::max<int64_t>(1, rows * rank) / 16 * 16);
  at::parallel_for(0, out, col_grain, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < nsub; ++i) {
      const int64_t lo = std::max(subs[2 * i], c0), hi = std::min(subs[2 * i + 1], c1);
      if (lo < hi) expand(yp, y.stride(0), bp, rank, out, segs, t.data(), sr, i, lo, hi);
    }
  });
}

// y[rows of each segment] += their slot's delta; y is updated in place and returned.
at::Tensor lora_apply_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                       const at::Tensor& segments, at::IntArrayRef subs, int64_t rank) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && bt.dim() == 3, "lora_apply_: bad ranks");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  bt.scalar_type() == x.scalar_type(),
              "lora_apply_: y, x, A and B^T must share a dtype");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1 && a.is_contiguous() && bt.is_contiguous(),
              "lora_apply_: rows of y and x, and A and B^T, must be contiguous");
  TORCH_CHECK(x.size(0) == y.size(0) && a.size(2) == x.size(1) && bt.size(2) == y.size(1) &&
                  bt.size(1) == rank && a.size(0) == bt.size(0) && a.size(1) * 2 == rank * (int64_t)subs.size(),
              "lora_apply_: shapes do not agree");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.is_contiguous(),
              "lora_apply_: segments must be int64 [n, 3]");
  std::vector<Segment> segs(segments.size(0));
  std::memcpy(segs.data(), segments.data_ptr<int64_t>(), sizeof(Segment) * segs.size());
  for (const Segment& s : segs)
    TORCH_CHECK(0 <= s.start && s.start <= s.end && s.end <= y.size(0) && 0 <= s.slot && s.slot < a.size(0),
                "lora_apply_: a segment is out of range");
  std::vector<int64_t> sub(subs.begin(), subs.end());
  for (size_t i = 0; i + 1 < sub.size(); i += 2)
    TORCH_CHECK(0 <= sub[i] && sub[i] <= sub[i + 1] && sub[i + 1] <= y.size(1), "lora_apply_: a sub is out of range");
  if (segs.empty()) return y;
  if (x.scalar_type() == at::kFloat) {
    run<float>(y, x, a, bt, segs, sub, rank);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_apply_: float32 or bfloat16 only");
    run<bf16>(y, x, a, bt, segs, sub, rank);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(tokenloom_lora, m) {
  m.def("lora_apply_(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor segments, int[] subs, int rank) "
        "-> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(tokenloom_lora, CPU, m) { m.impl("lora_apply_", &lora_apply_); }
