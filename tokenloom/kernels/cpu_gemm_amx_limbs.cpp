// AMX int8 tiles for int8 weights, with each activation row written as byte limbs:
// y[M, N] = x[M, K] * W[N, K]^T (+ bias).
//
// AMX's int8 tile multiply (TDPBSSD: [16 x 64] int8 times [64 x 16] int8 into int32) needs the
// activations as bytes too.  Rounding them to int8 would keep each to 2^-8 of its row's largest
// value; instead each row is written in fixed point on a power-of-two unit D of the row,
//
//     t = round(x / D),  D = 2^(floor(log2 max|x_row|) - 30),  |t| < 2^31,
//     t = 2^24 a + 2^16 b + 2^8 c + d,  a a signed byte, b, c, d unsigned ones,
//
// each limb one plane of tiles (a multiplied by TDPBSSD, the others by TDPBUSD).  A row is
// off by at most D / 2, 2^-31 of its largest value, and an outlier channel 10^4 times the rest
// costs the rest nothing.  A bfloat16 row whose largest value is at most 2^6 times its mean
// |value| (the common case) is rounded to sixteen bits instead, c = d = 0: it is off by at
// most 2^-15 of its largest value, 2^-9 of its mean |value| -- the size of the row's own
// rounding to bfloat16 -- and every value within 2^7 of the largest is written exactly.  A row
// tile whose rows are all rounded so skips the pass over c and d: half the tile multiplies.
// A row with an outlier channel keeps all four limbs.
//
// Each limb's sums over all of K stay in int32 (|sum| <= 255 * 128 * K, below 2^31 for K <
// 2^16) and are combined in float32 once per output, scaled by the row's D and the column's
// scale.  The int8 weights are multiplied as they are packed, never widened: the k-quad panels
// of `pack_int8(quads=True)` are AMX's int8 B-tile layout (a tile is 16 k-quads of one
// 16-column half, rows 128 bytes apart).  Rows stay independent of the rows beside them: a
// row's limbs depend on the row alone, and a skipped pass would have added zeros.
//
// Per k-block of 64 the panel's two weight tiles meet two limb tiles (four multiplies, each tile
// loaded used twice); limbs a, b take one pass over the panel's weights and c, d a second, from
// cache.  docs/quantization.md, "AMX", has the measurements against the bf16-tile kernel
// (cpu_gemm_amx.cpp), which widens every weight to bfloat16, and of each limb count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "gemm_driver.h"
#include "quant_vnni.h"

namespace {

constexpr int64_t PANEL = 32;  // columns per weight panel
constexpr int LIMBS = 4;

// Tiles 0-3: int32 sums [16 x 16] of (limb l, columns 0-15), (l, 16-31), (l + 1, 0-15),
// (l + 1, 16-31); 4-5: limbs l and l + 1 [16 rows x 64 bytes]; 6-7: the weights of columns 0-15
// and 16-31 [16 k-quads x 16 columns x 4 bytes].  Every tile is 16 rows of 64 bytes.
alignas(64) static const tokenloom::amx::TileConfig kConfig = tokenloom::amx::uniform_config(8, 16, 64);
constexpr int64_t KBLK = 64;  // k per tile multiply

// Each row of x as four limbs on its unit (see the top): limb l of rows [Mp] is plane l, [Mp,
// Kq] bytes (rows and k past x's are zero); `du` is each row's unit D; `wide[t]` says whether a
// row of row tile t keeps limbs c and d.
struct RowLimbs {
  int64_t Mp = 0, Kq = 0;
  std::vector<int8_t> q;
  std::vector<float> du;
  std::vector<char> wide;
  const int8_t* tile(int limb, int64_t row0, int64_t k0) const { return q.data() + (limb * Mp + row0) * Kq + k0; }
  int64_t plane() const { return Mp * Kq; }
};

// The largest |value| of a row of K values and their sum, or a largest of -1 if one is not
// finite.
template <typename T>
std::pair<float, float> row_max_and_sum(const T* row, int64_t K) {
  const __m512 big = _mm512_set1_ps(3.4028235e38f);  // above it: inf; unordered: NaN
  __m512 mx = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = _mm512_abs_ps(tokenloom::vnni::load16(row + k, K - k));
    if (_mm512_cmp_ps_mask(v, big, _CMP_NLE_UQ)) return {-1.f, 0.f};
    mx = _mm512_max_ps(mx, v);
    sum = _mm512_add_ps(sum, v);
  }
  return {_mm512_reduce_max_ps(mx), _mm512_reduce_add_ps(sum)};
}

// x's rows as limbs (see the top); a bfloat16 row (`narrow_ok`) whose largest value is at most
// 2^6 times its mean |value| rounded to sixteen bits.  False if some value is not finite (the
// caller then takes the bf16-tile kernel, which propagates it).
template <typename T>
bool split_rows(const T* x, int64_t M, int64_t K, int64_t Kq, bool narrow_ok, RowLimbs& out) {
  out.Mp = (M + 15) / 16 * 16;
  out.Kq = Kq;
  out.q.assign(LIMBS * out.Mp * Kq, 0);
  out.du.assign(out.Mp, 0.f);
  std::vector<char> finite(M, 1), wide(M, 0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    const __m512i byte = _mm512_set1_epi32(255);
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * K;
      const auto [m, sum] = row_max_and_sum(row, K);
      if (m < 0) {
        finite[r] = 0;
        continue;
      }
      // In double: m * K overflows float32 for rows near float32's largest values.
      const bool narrow = narrow_ok && static_cast<double>(m) * K <= 64.0 * sum;
      wide[r] = !narrow;
      const int e = m > 0 ? std::max(std::ilogb(m) - 30, -126) : 0;  // D = 2^e; |x| / D < 2^31
      out.du[r] = std::ldexp(1.0f, e);
      const __m512 inv = _mm512_set1_ps(std::ldexp(1.0f, -(narrow ? e + 16 : e)));
      for (int64_t k = 0; k < K; k += 16) {
        // t = round(x / D) (narrow: round(x / 2^16 D), its top two limbs); x / D is exact in
        // float32, so only the rounding to an integer loses anything.
        const __m512i t = _mm512_cvtps_epi32(_mm512_mul_ps(tokenloom::vnni::load16(row + k, K - k), inv));
        const __m512i limb[LIMBS] = {
            _mm512_srai_epi32(t, narrow ? 8 : 24),
            _mm512_and_si512(narrow ? t : _mm512_srai_epi32(t, 16), byte),
            _mm512_and_si512(_mm512_srai_epi32(t, 8), byte),
            _mm512_and_si512(t, byte)};
        const int64_t valid = std::min<int64_t>(16, K - k);
        const __mmask16 mk = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
        for (int l = 0; l < (narrow ? 2 : LIMBS); ++l)  // a narrow row's c, d stay the planes' zeros
          _mm_mask_storeu_epi8(out.q.data() + (l * out.Mp + r) * Kq + k, mk, _mm512_cvtepi32_epi8(limb[l]));
      }
    }
  });
  out.wide.assign(out.Mp / 16, 0);
  for (int64_t r = 0; r < M; ++r) out.wide[r / 16] |= wide[r];
  return std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; });
}

// One k-block of a panel: its two weight tiles (columns 0-15, 16-31) times two limb tiles of 16
// rows, into sums 0-3; the first limb signed with kSigned (a), else unsigned (c), the second
// unsigned (b, d).  Each tile loaded is used by two multiplies.
template <bool kSigned>
inline void block(const int8_t* w, const int8_t* a, int64_t lda, int64_t plane) {
  _tile_loadd(6, w, PANEL * 4);
  _tile_loadd(7, w + 64, PANEL * 4);
  _tile_loadd(4, a, lda);
  _tile_loadd(5, a + plane, lda);
  if constexpr (kSigned) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
  } else {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
  }
  _tile_dpbusd(2, 5, 6);
  _tile_dpbusd(3, 5, 7);
}

// The GEMM over `panels` k-quad panels of Kq k each (`quads(p, buf)` gives panel p's bytes), x
// as limbs (a bfloat16 x's narrow rows rounded to sixteen bits); undefined where x holds a
// value that is not finite.
template <typename Quads>
at::Tensor limb_linear(const at::Tensor& x, int64_t Kq, int64_t panels, int64_t n, Quads quads,
                       const float* col_scales, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu(), "tokenloom_amx runs on CPU");
  TORCH_CHECK(panels * PANEL >= n, "n exceeds the packed panels");
  const int64_t K = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  RowLimbs a;
  const bool ok = x2.scalar_type() == at::kBFloat16
                      ? split_rows(reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>()), M, K, Kq, true, a)
                      : split_rows(x2.to(at::kFloat).contiguous().data_ptr<float>(), M, K, Kq, false, a);
  if (!ok) return at::Tensor();
  const int64_t nkb = Kq / KBLK;
  const tokenloom::amx::Output out(x2, M, n, bias);
  const float* bp = out.bias();
  tokenloom::for_panel_pieces(panels, [&](auto& pieces) {
    TORCH_CHECK(tokenloom::amx::request_tiles(), "tokenloom_amx: the kernel refused AMX tile permission");
    _tile_loadconfig(&kConfig);
    std::vector<int8_t> buf(Kq * PANEL + 64);
    alignas(64) int32_t ct[4 * 256];
    alignas(64) float acc[16 * PANEL];
    int64_t p0, p1;
    while (pieces.next(p0, p1)) {
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* b = quads(p, buf.data());
        const int64_t ncols = std::min<int64_t>(PANEL, n - p * PANEL);
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
          // Limbs a, b in one pass over the panel's weights, c, d in a second (from cache) where a
          // row of the tile keeps them.
          for (int pass = 0; pass < (a.wide[m0 / 16] ? 2 : 1); ++pass) {
            const __m512 w0 = _mm512_set1_ps(pass ? 256.f : 16777216.f);  // 2^8, 2^24: limbs c, a
            const __m512 w1 = _mm512_set1_ps(pass ? 1.f : 65536.f);      // 2^0, 2^16: limbs d, b
            const int8_t* al = a.tile(2 * pass, m0, 0);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < nkb; ++kb) {
              // The first pass streams the weights: prefetch them ahead (panel_linear.h), across
              // panel ends too, since a thread's pieces mostly follow one another; the second reads the cache.
              if (pass == 0) {
                tokenloom::prefetch_stream(b + kb * KBLK * PANEL, KBLK * PANEL);
                block<true>(b + kb * KBLK * PANEL, al + kb * KBLK, a.Kq, a.plane());
              } else {
                block<false>(b + kb * KBLK * PANEL, al + kb * KBLK, a.Kq, a.plane());
              }
            }
            _tile_stored(0, ct, 64);
            _tile_stored(1, ct + 256, 64);
            _tile_stored(2, ct + 512, 64);
            _tile_stored(3, ct + 768, 64);
            for (int h = 0; h < 2; ++h)
              for (int i = 0; i < 16; ++i) {
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_load_si512(ct + h * 256 + i * 16));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_load_si512(ct + 512 + h * 256 + i * 16));
                const __m512 s = _mm512_fmadd_ps(hi, w0, _mm512_mul_ps(lo, w1));
                float* ai = acc + i * PANEL + h * 16;
                _mm512_store_ps(ai, pass ? _mm512_add_ps(s, _mm512_load_ps(ai)) : s);
              }
          }
          for (int h = 0; h < 2 && h * 16 < ncols; ++h) {
            const int64_t cols = std::min<int64_t>(16, ncols - h * 16);
            const __mmask16 mk = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
            const __m512 cs = _mm512_loadu_ps(col_scales + p * PANEL + h * 16);
            const __m512 bs = bp ? _mm512_maskz_loadu_ps(mk, bp + p * PANEL + h * 16) : _mm512_setzero_ps();
            for (int64_t i = 0; i < std::min<int64_t>(16, M - m0); ++i) {
              const __m512 v = _mm512_fmadd_ps(
                  _mm512_mul_ps(_mm512_load_ps(acc + i * PANEL + h * 16), _mm512_set1_ps(a.du[m0 + i])), cs, bs);
              out.store((m0 + i) * n + p * PANEL + h * 16, mk, v);
            }
          }
        }
      }
    }
    _tile_release();
  });
  return out.result(x, n);
}

// int8 weights in k-quad panels [P, K4, 32, 4], float32 column scales [P * 32]; x's rows as
// limbs (see the top).  A limb's sums over K stay in int32 for K below 2^16 (255 * 128 * K);
// longer rows take the bf16-tile kernel.
at::Tensor linear_int8_limbs(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 4 && q.size(2) == PANEL && q.size(3) == 4 &&
              q.is_contiguous(), "tokenloom_amx::linear_int8_limbs takes k-quad int8 panels");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() >= q.size(0) * PANEL && scales.is_contiguous(),
              "int8 scales: float32, one per padded column");
  const int64_t K = x.size(-1), K4 = q.size(1);
  TORCH_CHECK((K + 3) / 4 == K4, "x has ", K, " features, the packed weight ", K4, " quads");
  const int64_t K4p = (K4 + 15) / 16 * 16;
  const int8_t* w = q.data_ptr<int8_t>();
  auto quads = [&](int64_t p, int8_t* buf) -> const int8_t* {
    const int8_t* src = w + p * K4 * PANEL * 4;
    if (K4 == K4p) return src;
    std::memcpy(buf, src, K4 * PANEL * 4);
    std::memset(buf + K4 * PANEL * 4, 0, (K4p - K4) * PANEL * 4);
    return buf;
  };
  at::Tensor y;
  if (K < (1 << 16)) y = limb_linear(x, K4p * 4, q.size(0), n, quads, scales.data_ptr<float>(), bias);
  if (y.defined()) return y;
  return c10::Dispatcher::singleton()  // not finite, or too long: the bf16-tile kernel
      .findSchemaOrThrow("tokenloom_amx::linear_int8", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                        const c10::optional<at::Tensor>&)>()
      .call(x, q, scales, n, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_amx, m) {
  m.def("linear_int8_limbs(Tensor x, Tensor qweight, Tensor scales, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_amx, CPU, m) {
  m.impl("linear_int8_limbs", &linear_int8_limbs);
}
