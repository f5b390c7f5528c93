// Paged decode attention for x86 CPUs with AVX2 + FMA.
//
// The seed's decode step: the new token's Q attends to every K/V already in the cache.
// The cache is paged -- [num_blocks, block_size, Hk, D] per layer, a request's history
// scattered over the blocks its block table names -- and decode reads all of it every
// step, so at long context attention is a memory stream like the weights.  PyTorch's
// path first gathers the blocks into a dense tensor (a full copy) and then runs SDPA
// over the copy; this kernel reads each block in place, once:
//
//   for each (request, KV head), in parallel:
//     the G query heads that share the KV head (grouped-query attention) are scored
//     together against each cached key, so a key is loaded once for its whole group;
//     softmax runs online, block by block (running max and sum, rescaling the partial
//     output when the max grows), so nothing of context length is materialized.
//
// Arithmetic is float32; bf16 caches are widened on load.
//
// The same source is also built into the AVX-512 extension (kernels/cpu.py), where a
// 512-bit version of the loop runs for head sizes that are multiples of 16 up to 128 and
// registers as tokenloom_avx512::paged_decode_attention.  Beyond the wider vectors its
// P.V product holds a chunk of the group's outputs in registers and reads each value row
// once for the whole group, instead of once per query head.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "simd_avx2.h"
#ifdef __AVX512F__
#include "simd_avx512.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

using tokenloom::exp8;
using tokenloom::hsum8;

// One (request, KV head): q [G, D] (pre-scaled), out [G, D].  `scores` holds G rows of
// `bsp` (block size rounded up to 8), `acc` G x D partial outputs.
template <typename T>
void attend(const float* q, int64_t G, int64_t D, const T* k_cache, const T* v_cache, const int64_t* table,
            int64_t ctx, int64_t bs, int64_t token_stride, float* out, float* scores, float* acc,
            const T** rows) {
  const int64_t nv = D / 8, bsp = (bs + 7) / 8 * 8;
  std::vector<float> m(G, -std::numeric_limits<float>::infinity()), l(G, 0.0f);
  std::fill(acc, acc + G * D, 0.0f);
  for (int64_t b0 = 0; b0 < ctx; b0 += bs) {
    const int64_t n = std::min(bs, ctx - b0);
    const int64_t block = table[b0 / bs];
    const T* kb = k_cache + block * bs * token_stride;
    const T* vb = v_cache + block * bs * token_stride;
    if (b0 + bs < ctx) {  // the next block is elsewhere in the pool: start fetching it now
      const int64_t next = table[b0 / bs + 1] * bs * token_stride;
      const int64_t nn = std::min(bs, ctx - b0 - bs), row_bytes = D * int64_t(sizeof(T));
      for (int64_t t = 0; t < nn; ++t)
        for (int64_t c = 0; c < row_bytes; c += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + next + t * token_stride) + c, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + next + t * token_stride) + c, _MM_HINT_T0);
        }
    }
    // scores[g, t] = q_g . k_t, eight keys at a time (independent FMA chains); the rows
    // past n repeat the last key and are overwritten below.
    for (int64_t t = 0; t < bsp; ++t) rows[t] = kb + std::min(t, n - 1) * token_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      for (int64_t t = 0; t < n; t += 8) {
        __m256 a[8];
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
        for (int64_t j = 0; j < nv; ++j) {
          const __m256 qv = _mm256_loadu_ps(qg + 8 * j);
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, load8(rows[t + u] + 8 * j), a[u]);
        }
        _mm256_storeu_ps(scores + g * bsp + t, hsum8(a));
      }
    }
    // online softmax: fold this block into the running max / sum, rescaling the partial output
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * bsp;
      float mb = m[g];
      for (int64_t t = 0; t < n; ++t) mb = std::max(mb, sg[t]);
      const float alpha = std::exp(m[g] - mb);  // exp(-inf) = 0 on the first block
      const __m256 mv = _mm256_set1_ps(mb);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t t = 0; t < n; t += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
        if (t + 8 > n) {  // zero the rows past the block's last token
          const __m256 idx = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
          p = _mm256_and_ps(p, _mm256_cmp_ps(idx, _mm256_set1_ps(float(n - t)), _CMP_LT_OQ));
        }
        _mm256_storeu_ps(sg + t, p);
        sum = _mm256_add_ps(sum, p);
      }
      __m256 s8[8] = {sum, sum, sum, sum, sum, sum, sum, sum};
      l[g] = l[g] * alpha + _mm256_cvtss_f32(hsum8(s8));
      m[g] = mb;
      if (alpha != 1.0f) {
        const __m256 av = _mm256_set1_ps(alpha);
        float* ag = acc + g * D;
        for (int64_t j = 0; j < nv; ++j) _mm256_storeu_ps(ag + 8 * j, _mm256_mul_ps(av, _mm256_loadu_ps(ag + 8 * j)));
      }
    }
    // acc[g] += p[g, t] * v_t, up to eight vectors of acc held in registers across the block
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = scores + g * bsp;
      float* ag = acc + g * D;
      int64_t j0 = 0;
      for (; j0 + 8 <= nv; j0 += 8) {
        __m256 a[8];
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) a[u] = _mm256_loadu_ps(ag + 8 * (j0 + u));
        for (int64_t t = 0; t < n; ++t) {
          const __m256 p = _mm256_set1_ps(pg[t]);
          const T* vt = vb + t * token_stride + 8 * j0;
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(p, load8(vt + 8 * u), a[u]);
        }
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) _mm256_storeu_ps(ag + 8 * (j0 + u), a[u]);
      }
      for (; j0 < nv; ++j0) {  // head_dim not a multiple of 64
        __m256 a = _mm256_loadu_ps(ag + 8 * j0);
        for (int64_t t = 0; t < n; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(pg[t]), load8(vb + t * token_stride + 8 * j0), a);
        _mm256_storeu_ps(ag + 8 * j0, a);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
  }
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// The low and high halves of a 16-float vector added: its sum spread over eight lanes.
inline __m256 fold16(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

using tokenloom::exp16;

// acc[g] += sum_t p[g, t] v_t for GN query heads at once: their NV-vector outputs stay in
// registers over the block, and each value row is loaded once for all of them.
template <int NV, int GN, typename T>
inline void pv_tile(const float* p, int64_t bsp, const T* vb, int64_t n, int64_t token_stride, float* acc) {
  __m512 a[GN][NV];
#pragma GCC unroll 8
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) a[g][j] = _mm512_loadu_ps(acc + (g * NV + j) * 16);
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) v[j] = load16(vb + t * token_stride + 16 * j);
#pragma GCC unroll 8
    for (int g = 0; g < GN; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * bsp + t]);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) a[g][j] = _mm512_fmadd_ps(pg, v[j], a[g][j]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (g * NV + j) * 16, a[g][j]);
}

// pv_tile for a run-time count gn <= GN of query heads.
template <int NV, int GN, typename T>
inline void pv_rows(int64_t gn, const float* p, int64_t bsp, const T* vb, int64_t n, int64_t token_stride, float* acc) {
  if constexpr (GN > 0) {
    if (gn == GN) return pv_tile<NV, GN>(p, bsp, vb, n, token_stride, acc);
    return pv_rows<NV, GN - 1>(gn, p, bsp, vb, n, token_stride, acc);
  }
}

// `attend` with 512-bit vectors for D = 16 * NV, over H neighbouring KV heads of one
// request at once: q, out and acc hold H * G rows.  Walking the blocks once for all H
// heads reads each cached token's row (every head's K, then V) as one contiguous run,
// where a pass per head would read a strided piece of every row, H times over.
template <int NV, typename T>
void attend16(const float* q, int64_t H, int64_t G, const T* k_cache, const T* v_cache, const int64_t* table,
              int64_t ctx, int64_t bs, int64_t token_stride, float* out, float* scores, float* acc,
              const T** rows) {
  constexpr int64_t D = 16 * NV;
  // Query heads per P.V tile: GN x NV accumulators plus NV value vectors within 32 registers.
  constexpr int GN = NV <= 2 ? 8 : 24 / NV;
  const int64_t bsp = (bs + 7) / 8 * 8, HG = H * G;
  std::vector<float> m(HG, -std::numeric_limits<float>::infinity()), l(HG, 0.0f);
  std::fill(acc, acc + HG * D, 0.0f);
  for (int64_t b0 = 0; b0 < ctx; b0 += bs) {
    const int64_t n = std::min(bs, ctx - b0);
    const int64_t block = table[b0 / bs];
    if (b0 + bs < ctx) {  // the next block is elsewhere in the pool: start fetching it now
      const int64_t next = table[b0 / bs + 1] * bs * token_stride;
      const int64_t nn = std::min(bs, ctx - b0 - bs), row_bytes = H * D * int64_t(sizeof(T));
      for (int64_t t = 0; t < nn; ++t)
        for (int64_t c = 0; c < row_bytes; c += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + next + t * token_stride) + c, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + next + t * token_stride) + c, _MM_HINT_T0);
        }
    }
    for (int64_t h = 0; h < H; ++h) {
      const T* kb = k_cache + block * bs * token_stride + h * D;
      const T* vb = v_cache + block * bs * token_stride + h * D;
      // scores[g, t] = q_g . k_t, eight keys at a time; rows past n repeat the last key.
      for (int64_t t = 0; t < bsp; ++t) rows[t] = kb + std::min(t, n - 1) * token_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + (h * G + g) * D;
        for (int64_t t = 0; t < n; t += 8) {
          __m512 a[8];
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
#pragma GCC unroll 8
          for (int j = 0; j < NV; ++j) {
            const __m512 qv = _mm512_loadu_ps(qg + 16 * j);
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) a[u] = _mm512_fmadd_ps(qv, load16(rows[t + u] + 16 * j), a[u]);
          }
          __m256 f[8];
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) f[u] = fold16(a[u]);
          _mm256_storeu_ps(scores + g * bsp + t, hsum8(f));
        }
      }
      // online softmax over the block's n scores, sixteen at a time
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hg = h * G + g;
        float* sg = scores + g * bsp;
        float mb = m[hg];
        for (int64_t t = 0; t < n; t += 16) {  // the block's max, sixteen at a time, not a chain of scalars
          const __mmask16 live = static_cast<__mmask16>(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
          mb = std::max(mb, _mm512_mask_reduce_max_ps(live, _mm512_maskz_loadu_ps(live, sg + t)));
        }
        // exp(-inf) = 0 on the first block; once the running max stops growing, exp(0) = 1 exactly
        const float alpha = mb == m[hg] ? 1.0f : std::exp(m[hg] - mb);
        const __m512 mv = _mm512_set1_ps(mb);
        float sum = 0.0f;
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 live = static_cast<__mmask16>(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
          const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + t), mv)));
          _mm512_mask_storeu_ps(sg + t, live, e);
          sum += _mm512_reduce_add_ps(e);
        }
        l[hg] = l[hg] * alpha + sum;
        m[hg] = mb;
        if (alpha != 1.0f) {
          const __m512 av = _mm512_set1_ps(alpha);
          float* ag = acc + hg * D;
#pragma GCC unroll 8
          for (int j = 0; j < NV; ++j) _mm512_storeu_ps(ag + 16 * j, _mm512_mul_ps(av, _mm512_loadu_ps(ag + 16 * j)));
        }
      }
      for (int64_t g0 = 0; g0 < G; g0 += GN)
        pv_rows<NV, GN>(std::min<int64_t>(GN, G - g0), scores + g0 * bsp, bsp, vb, n, token_stride,
                        acc + (h * G + g0) * D);
    }
  }
  for (int64_t r = 0; r < HG; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] * inv;
  }
}

// Whether this build has a 512-bit loop for head size D (then one pass serves many heads).
inline bool wide_head(int64_t D) { return D % 16 == 0 && D / 16 <= 8; }
#else
inline bool wide_head(int64_t) { return false; }
#endif

// H KV heads of one request (their query rows contiguous in q and out, acc H * G * D),
// with the widest loop this build has for D.
template <typename T>
void attend_heads(const float* q, int64_t H, int64_t G, int64_t D, const T* k_cache, const T* v_cache,
                  const int64_t* table, int64_t ctx, int64_t bs, int64_t token_stride, float* out, float* scores,
                  float* acc, const T** rows) {
#ifdef __AVX512F__
  switch (wide_head(D) ? D / 16 : 0) {
#define TOKENLOOM_WIDE(nv) \
    case nv: return attend16<nv>(q, H, G, k_cache, v_cache, table, ctx, bs, token_stride, out, scores, acc, rows);
    TOKENLOOM_WIDE(1) TOKENLOOM_WIDE(2) TOKENLOOM_WIDE(3) TOKENLOOM_WIDE(4)
    TOKENLOOM_WIDE(5) TOKENLOOM_WIDE(6) TOKENLOOM_WIDE(7) TOKENLOOM_WIDE(8)
#undef TOKENLOOM_WIDE
    default: break;
  }
#endif
  for (int64_t h = 0; h < H; ++h)
    attend(q + h * G * D, G, D, k_cache + h * D, v_cache + h * D, table, ctx, bs, token_stride, out + h * G * D,
           scores, acc, rows);
}

// q [N, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hk, D]; block_tables [N, max_blocks]
// int64; context_lens [N] int64 (tokens to attend, the new one included).  Returns [N, Hq, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0 && Hq % Hk == 0, "head_dim must be a multiple of 8");
  const int64_t G = Hq / Hk;
  // q and the output stay in q's dtype when it is float32 or bfloat16 (no conversion ops
  // around the kernel); the arithmetic is float32 either way.
  const bool bf16_io = q.scalar_type() == at::kBFloat16;
  const auto qc = bf16_io ? q.contiguous() : q.to(at::kFloat).contiguous();
  const auto bt = block_tables.to(at::kLong).contiguous();
  const auto cl = context_lens.to(at::kLong).contiguous();
  TORCH_CHECK(bt.size(0) == N && cl.size(0) == N, "one block table and context length per query");
  auto out = at::empty({N, Hq, D}, qc.options());
  const float* qp = bf16_io ? nullptr : qc.data_ptr<float>();
  const at::BFloat16* qp16 = bf16_io ? qc.data_ptr<at::BFloat16>() : nullptr;
  float* op = bf16_io ? nullptr : out.data_ptr<float>();
  at::BFloat16* op16 = bf16_io ? out.data_ptr<at::BFloat16>() : nullptr;
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* clp = cl.data_ptr<int64_t>();
  const int64_t nb = bt.size(1);
  const int64_t token_stride = Hk * D;
  // Work items: (request, KV head), or whole requests where the 512-bit loop serves all of
  // a request's heads in one pass and there are enough requests to keep every thread busy.
  const int64_t H = wide_head(D) && N >= at::get_num_threads() ? Hk : 1;
  auto run = [&](auto* kc, auto* vc) {
    at::parallel_for(0, N * (Hk / H), 1, [&](int64_t i0, int64_t i1) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
      const int64_t len = H * G * D;
      std::vector<float> scores(G * ((bs + 7) / 8 * 8)), acc(len), qs(len), o32(bf16_io ? len : 0);
      std::vector<const T*> rows((bs + 7) / 8 * 8);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / (Hk / H), h = i % (Hk / H) * H;
        const int64_t ctx = clp[r];
        TORCH_CHECK(ctx >= 0 && ctx <= nb * bs, "context length exceeds the block table");
        // The item's query rows, pre-scaled: the scores come out as q.k * scale.
        const int64_t off = (r * Hq + h * G) * D;
        const float sc = static_cast<float>(scale);
        if (bf16_io)
          for (int64_t j = 0; j < len; ++j) qs[j] = static_cast<float>(qp16[off + j]) * sc;
        else
          for (int64_t j = 0; j < len; ++j) qs[j] = qp[off + j] * sc;
        attend_heads(qs.data(), H, G, D, kc + h * D, vc + h * D, btp + r * nb, ctx, bs, token_stride,
                     bf16_io ? o32.data() : op + off, scores.data(), acc.data(), rows.data());
        if (bf16_io)  // rounded as float -> bfloat16 conversion rounds
          for (int64_t j = 0; j < len; ++j) op16[off + j] = at::BFloat16(o32[j]);
      }
    });
  };
  if (k_cache.scalar_type() == at::kFloat) {
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16, "KV cache must be float32 or bfloat16");
    run(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
  }
  return bf16_io ? out : out.to(q.scalar_type());
}

}  // namespace

// One source, two libraries: the AVX2 build's op and the AVX-512 build's.
#ifdef __AVX512F__
#define TOKENLOOM_ATTENTION_LIB tokenloom_avx512
#else
#define TOKENLOOM_ATTENTION_LIB tokenloom_cpu
#endif

TORCH_LIBRARY_FRAGMENT(TOKENLOOM_ATTENTION_LIB, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(TOKENLOOM_ATTENTION_LIB, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
