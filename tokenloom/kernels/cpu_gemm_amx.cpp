// AMX GEMMs for x86 CPUs with usable tile registers (Sapphire Rapids and later):
// y[M, N] = x[M, K] * W[N, K]^T (+ bias), W in bf16, int8 or int4.
//
// AMX multiplies whole tiles: TDPBF16PS adds a [16 x 32] bf16 tile of activations times a
// [32 x 16] bf16 tile of weights into a [16 x 16] float32 tile, 16 K x 16 N x 16 M products
// in one instruction, about sixteen times what one AVX512-BF16 dot product does.  From a few
// rows on, the AVX-512 kernels are bound by their arithmetic, not by the weights' stream, and
// this is where AMX wins (kernels/amx.py measures where, once per machine).
//
// Every precision goes through the same bf16 tile multiply, with the weights' tile in the
// k-pair layout of cpu_gemm_bf16.cpp (`pack_pairs`: per 32-column panel, per pair of k, 32
// columns x 2 bf16 = 128 bytes), which is already AMX's B-tile layout: a tile is 16 k-pairs of
// one 16-column half, rows 128 bytes apart.  So:
// * bf16 weights are loaded as tiles straight from their panels (no second copy);
// * int8 weights (the k-quad panels of `pack_int8(quads=True)`) are widened to bf16 per panel
//   into a thread's scratch: int8 values are exact in bf16, so every product is exact and the
//   column scale is applied to the float32 sums, as in the AVX-512 int8 kernel;
// * int4 weights (`pack_int4`) are widened through a 16-entry table (nibble -> bf16 of -8..7,
//   exact), and each group's sums are scaled by the group's scale when the group ends (the
//   group must be a multiple of 32 k: one k-block).
// bf16 activations are taken as they are; float32 ones as two bf16 planes (`amx_linear`);
// sums are float32.  int8 weights in int8 tiles, nothing widened, are cpu_gemm_amx_limbs.cpp's
// (activations in fixed point as two or four byte limbs per row); `linear_int8_tiles` below, two int8 planes per row,
// is its imprecise predecessor, kept for comparison (docs/quantization.md, "AMX").
//
// Tile permission and configuration: amx_tiles.h.  `probe` runs one int8 and one bf16 tile
// multiply and checks them; kernels/amx_probe.py runs it in a child process, so a CPU or VM
// that traps on tile instructions kills the child, not the server.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "gemm_driver.h"
#include "panel_linear.h"

namespace {

constexpr int64_t KB = 16;     // k-pairs per tile (32 k)
constexpr int64_t PANEL = 32;  // columns per weight panel (kernels/cpu.py WIDE)

using tokenloom::amx::request_tiles;
using tokenloom::amx::TileConfig;

// Tiles 0-3: float32 sums [16 x 16]; 4-5: activations [16 x 32 bf16]; 6-7: weights [16 pairs x
// 32 bf16].  Every tile is 16 rows of 64 bytes.
alignas(64) static const TileConfig kConfig = tokenloom::amx::uniform_config(8, 16, 64);

void begin_tiles() {
  TORCH_CHECK(request_tiles(), "tokenloom_amx: the kernel refused AMX tile permission");
  _tile_loadconfig(&kConfig);
}

// Where one 32-column panel's weights come from, as bf16 k-pair rows of 32 columns (64 bf16, 128
// bytes each): `panel(p, buf)` returns a pointer to K2p rows (K2p = K2 rounded up to KB), either
// the packed weights themselves or `buf` filled with them, and `group_blocks` k-blocks share one
// scale (`scale(p, g, col)`: 1 for bf16).
struct Bf16Panels {
  static constexpr bool kInPlace = true;  // block() reads the weights where they lie
  const uint16_t* w;
  int64_t K2, K2p;
  const uint16_t* panel(int64_t p, uint16_t* buf) const {
    const uint16_t* src = w + p * K2 * PANEL * 2;
    if (K2 == K2p) return src;
    std::memcpy(buf, src, K2 * PANEL * 2 * 2);
    std::memset(buf + K2 * PANEL * 2, 0, (K2p - K2) * PANEL * 2 * 2);
    return buf;
  }
  // k-block kb of panel p alone (KB pair rows, 2 KiB): in place unless it is the padded last one.
  const uint16_t* block(int64_t p, int64_t kb, uint16_t* buf) const {
    const uint16_t* src = w + (p * K2 + kb * KB) * PANEL * 2;
    if ((kb + 1) * KB <= K2) return src;
    const int64_t live = K2 - kb * KB;
    std::memcpy(buf, src, live * PANEL * 2 * 2);
    std::memset(buf + live * PANEL * 2, 0, (KB - live) * PANEL * 2 * 2);
    return buf;
  }
};

// int8 k-quad panels [P, K4, 32, 4] -> bf16 pairs: quad row q gives pair rows 2q (k 4q, 4q+1)
// and 2q+1 (k 4q+2, 4q+3).  Each 16-column half (64 bytes: 16 columns x 4 k) is widened in
// float32 (exact for -128..127; a float32 holding a small integer is its bf16 in the top half).
struct Int8Panels {
  static constexpr bool kInPlace = false;  // block() widens: worth doing once per k-block
  const int8_t* w;
  int64_t K4, K2p;
  // Quad rows [q0, q1) of panel p as pair rows 2 q0 .. 2 q1 into dst.
  void widen(int64_t p, int64_t q0, int64_t q1, uint16_t* dst) const {
    const int8_t* src = w + p * K4 * PANEL * 4;
    const __m512i hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t q = q0; q < q1; ++q) {
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(src + (q * PANEL + h * 16) * 4);
        const __m512i f0 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24)));
        const __m512i f1 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)));
        const __m512i f2 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24)));
        const __m512i f3 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24)));
        const __m512i r0 = _mm512_or_si512(_mm512_srli_epi32(f0, 16), _mm512_and_si512(f1, hi16));
        const __m512i r1 = _mm512_or_si512(_mm512_srli_epi32(f2, 16), _mm512_and_si512(f3, hi16));
        _mm512_storeu_si512(dst + ((2 * (q - q0)) * PANEL + h * 16) * 2, r0);
        _mm512_storeu_si512(dst + ((2 * (q - q0) + 1) * PANEL + h * 16) * 2, r1);
      }
    }
  }
  const uint16_t* panel(int64_t p, uint16_t* buf) const {
    widen(p, 0, K4, buf);
    std::memset(buf + 2 * K4 * PANEL * 2, 0, (K2p - 2 * K4) * PANEL * 2 * 2);
    return buf;
  }
  const uint16_t* block(int64_t p, int64_t kb, uint16_t* buf) const {
    const int64_t q0 = kb * KB / 2, q1 = std::min(K4, q0 + KB / 2);
    widen(p, q0, q1, buf);
    std::memset(buf + 2 * (q1 - q0) * PANEL * 2, 0, (KB - 2 * (q1 - q0)) * PANEL * 2 * 2);
    return buf;
  }
};

// int4 panels [P, Kp, 16] (byte c at k: column c in the low nibble, column 16 + c in the high
// one, each + 8) -> bf16 pairs through a table of the 16 values.
struct Int4Panels {
  static constexpr bool kInPlace = false;
  const uint8_t* w;
  int64_t Kp, K2p;
  // Pair rows [j0, j1) of panel p into dst.
  void widen(int64_t p, int64_t j0, int64_t j1, uint16_t* dst) const {
    alignas(64) static const uint16_t table[32] = {
        0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,  // -8 .. -1
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,  // 0 .. 7
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    const __m512i tab = _mm512_load_si512(table);
    const __m512i low = _mm512_set1_epi16(0x0F);
    const uint8_t* src = w + p * Kp * 16;
    for (int64_t j = j0; j < j1; ++j) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (2 * j) * 16));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (2 * j + 1) * 16));
      const __m256i ab = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
      const __m512i v = _mm512_cvtepu8_epi16(ab);  // column c's (k, k+1) bytes in words 2c, 2c+1
      _mm512_storeu_si512(dst + (j - j0) * PANEL * 2, _mm512_permutexvar_epi16(_mm512_and_si512(v, low), tab));
      _mm512_storeu_si512(dst + ((j - j0) * PANEL + 16) * 2,
                          _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), tab));
    }
  }
  const uint16_t* panel(int64_t p, uint16_t* buf) const {
    widen(p, 0, Kp / 2, buf);
    std::memset(buf + (Kp / 2) * PANEL * 2, 0, (K2p - Kp / 2) * PANEL * 2 * 2);
    return buf;
  }
  const uint16_t* block(int64_t p, int64_t kb, uint16_t* buf) const {  // Kp is whole groups: whole k-blocks
    widen(p, kb * KB, (kb + 1) * KB, buf);
    return buf;
  }
};

// Scales of the sums: none (bf16), per column (int8: float32 [P * 32]), per column and group
// (int4: [P, groups, 32] bf16 or float16).
struct NoScale {
  int64_t group_blocks;
  __m512 get(int64_t, int64_t, int) const { return _mm512_set1_ps(1.f); }
};
struct ColScale {
  const float* s;
  int64_t group_blocks;
  __m512 get(int64_t p, int64_t, int h) const { return _mm512_loadu_ps(s + p * PANEL + h * 16); }
};
struct GroupScale {
  const uint16_t* s;
  int64_t groups, group_blocks;
  bool fp16;
  __m512 get(int64_t p, int64_t g, int h) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (p * groups + g) * PANEL + h * 16));
    if (fp16) return _mm512_cvtph_ps(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
};

// The activations as AMX A tiles: rows of `lda` bf16 (K2p pairs), 16 rows a tile.  Rows below
// `full` are read in place from `main`; the rest from `tail`, a copy padded with zeros to a
// whole tile.  A bf16 x whose K is already whole k-blocks is read where it lies (no copy of a
// long prefill's activations per linear), only its last partial tile copied.
struct RowTiles {
  const uint16_t* main = nullptr;
  const uint16_t* tail = nullptr;
  int64_t full = 0, lda = 0;
  const uint16_t* tile(int64_t m) const { return m < full ? main + m * lda : tail + (m - full) * lda; }
};

// Rows [m0, m0 + 32) (those below M) times panel p: for each k-block, two activation tiles
// (rows m0.., m0 + 16..) times the panel's two 16-column weight tiles; at each group's end
// the four sum tiles are scaled into `acc` [32 x 32] float32.
template <typename Scale, typename Block>
inline void panel_rows(const RowTiles& a, const RowTiles& alo, int64_t M, int64_t m0, const Block& block,
                       int64_t nkb, const Scale& scale, int64_t p, float* acc, float* ctile) {
  const bool two = m0 + 16 < M;
  const int64_t rows = std::min<int64_t>(32, M - m0);
  std::fill(acc, acc + 32 * 32, 0.f);
  for (int64_t kb0 = 0, g = 0; kb0 < nkb; kb0 += scale.group_blocks, ++g) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const int64_t kb1 = std::min(nkb, kb0 + scale.group_blocks);
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const uint16_t* bt = block(kb);
      _tile_loadd(6, bt, PANEL * 4);
      _tile_loadd(7, bt + 32, PANEL * 4);
      _tile_loadd(4, a.tile(m0) + kb * KB * 2, a.lda * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (alo.main) {
        _tile_loadd(4, alo.tile(m0) + kb * KB * 2, alo.lda * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two) {
        _tile_loadd(5, a.tile(m0 + 16) + kb * KB * 2, a.lda * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (alo.main) {
          _tile_loadd(5, alo.tile(m0 + 16) + kb * KB * 2, alo.lda * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
    _tile_stored(0, ctile, 64);
    _tile_stored(1, ctile + 256, 64);
    if (two) {
      _tile_stored(2, ctile + 512, 64);
      _tile_stored(3, ctile + 768, 64);
    }
    const __m512 s0 = scale.get(p, g, 0), s1 = scale.get(p, g, 1);
    for (int64_t i = 0; i < rows; ++i) {
      const float* c = ctile + (i >= 16 ? 512 : 0) + (i & 15) * 16;
      float* ai = acc + i * 32;
      _mm512_storeu_ps(ai, _mm512_fmadd_ps(_mm512_loadu_ps(c), s0, _mm512_loadu_ps(ai)));
      _mm512_storeu_ps(ai + 16, _mm512_fmadd_ps(_mm512_loadu_ps(c + 256), s1, _mm512_loadu_ps(ai + 16)));
    }
  }
}

// Rows [m0, m0 + 16) (those below M; one activation tile, a bf16 x) times panels p and q = p + 1
// at once, over k-blocks [kb_begin, kb_end) (kb_begin starts a group, unless one scale covers
// all of K), added into acc:
// each k-block's activation tile is loaded once for the four weight tiles (tiles 0-3 the sums,
// 4 the activations, 5-7 the weights in turn), where `panel_rows` loads it once for two.  Tile
// loads, not multiplies, are what a decode step's AMX work costs.  acc [16 x 64]: p's columns,
// then q's.  block(0 | 1, kb): k-block kb of p or q.
template <typename Scale, typename Block>
inline void panel_pair_rows(const RowTiles& a, int64_t m0, int64_t M, const Block& block, int64_t kb_begin,
                            int64_t kb_end, const Scale& scale, int64_t p, float* acc, float* ctile) {
  for (int64_t kb0 = kb_begin; kb0 < kb_end; kb0 += scale.group_blocks) {
    const int64_t g = kb0 / scale.group_blocks;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t kb1 = std::min(kb_end, kb0 + scale.group_blocks);
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const uint16_t* pt = block(0, kb);
      const uint16_t* qt = block(1, kb);
      _tile_loadd(4, a.tile(m0) + kb * KB * 2, a.lda * 2);
      _tile_loadd(5, pt, PANEL * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, pt + 32, PANEL * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, qt, PANEL * 4);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, qt + 32, PANEL * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, ctile, 64);
    _tile_stored(1, ctile + 256, 64);
    _tile_stored(2, ctile + 512, 64);
    _tile_stored(3, ctile + 768, 64);
    const __m512 s[4] = {scale.get(p, g, 0), scale.get(p, g, 1), scale.get(p + 1, g, 0), scale.get(p + 1, g, 1)};
    for (int64_t i = 0; i < std::min<int64_t>(16, M - m0); ++i)
      for (int t = 0; t < 4; ++t) {
        float* ai = acc + i * 64 + 16 * t;
        _mm512_storeu_ps(ai, _mm512_fmadd_ps(_mm512_loadu_ps(ctile + 256 * t + i * 16), s[t], _mm512_loadu_ps(ai)));
      }
  }
}

// k-blocks per chunk of `panel_pair_rows` passes over 17-32 rows: about 16 (a thread's pair of
// panels then 64 KiB of weights, in L2 for the second row tile's pass), whole groups.
inline int64_t pair_chunk(int64_t group_blocks, int64_t nkb) {
  constexpr int64_t kChunk = 16;
  if (group_blocks >= nkb) return kChunk;  // one scale over all of K: any split
  return std::max<int64_t>(1, kChunk / group_blocks) * group_blocks;
}

// The GEMM: x in bf16 row blocks padded to 16 rows and K2p pairs, panels split over threads
// (gemm_driver.h), each thread widening one panel at a time into its scratch (up to 32 rows, one
// k-block at a time into L1, and up to 16 rows -- 32 for bf16 weights -- two panels at once:
// `panel_pair_rows`).  A float32 x is
// split into two bf16 planes, x = hi + lo (hi = x rounded to bf16, lo = the rest rounded to
// bf16), each multiplied into the same sums: x is then kept to 2^-17 of each value, as the
// AVX-512 kernels keep float32 activations, not rounded to bf16's 2^-9.  A bf16 x (bf16 and
// quantized models) has no lo plane.
template <typename Panels, typename Scale>
at::Tensor amx_linear(const at::Tensor& x, int64_t K, int64_t K2p, int64_t panels, int64_t n, const Panels& src,
                      const Scale& scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu(), "tokenloom_amx runs on CPU");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(panels * PANEL >= n, "n exceeds the packed panels");
  const at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  const int64_t lda = K2p * 2;
  // x in place when it is bf16 rows of whole k-blocks, else one padded bf16 copy (hi) and, for a
  // float32 x, the remainder plane (lo).
  const bool in_place = x.scalar_type() == at::kBFloat16 && K == lda && x2.is_contiguous();
  const int64_t full = in_place ? M / 16 * 16 : 0;
  const int64_t rest = M - full, padded = (rest + 15) / 16 * 16;
  at::Tensor a;
  if (x.scalar_type() == at::kBFloat16 && x2.is_contiguous()) {
    // The rows past `full` copied and padded by hand: for a decode call's few rows ATen's
    // zeros / narrow / copy_ cost more than the copy itself.
    a = at::empty({padded, lda}, x.options().dtype(at::kBFloat16));
    uint16_t* dst = reinterpret_cast<uint16_t*>(a.data_ptr<at::BFloat16>());
    const uint16_t* rows = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>()) + full * K;
    for (int64_t r = 0; r < rest; ++r) {
      std::memcpy(dst + r * lda, rows + r * K, K * sizeof(uint16_t));
      std::memset(dst + r * lda + K, 0, (lda - K) * sizeof(uint16_t));
    }
    std::memset(dst + rest * lda, 0, (padded - rest) * lda * sizeof(uint16_t));
  } else {  // a float32 x is rounded to bf16 (its hi plane) by copy_
    a = at::zeros({padded, lda}, x.options().dtype(at::kBFloat16));
    a.narrow(0, 0, rest).narrow(1, 0, K).copy_(x2.narrow(0, full, rest));
  }
  at::Tensor alo_t;
  if (x.scalar_type() != at::kBFloat16) {
    alo_t = at::zeros_like(a);
    alo_t.narrow(0, 0, M).narrow(1, 0, K).copy_(x2.to(at::kFloat) - a.narrow(0, 0, M).narrow(1, 0, K).to(at::kFloat));
  }
  const auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const RowTiles ap{in_place ? bits(x2) : nullptr, bits(a), full, lda};
  const RowTiles alo{alo_t.defined() ? bits(alo_t) : nullptr, nullptr, alo_t.defined() ? alo_t.size(0) : 0, lda};
  const tokenloom::amx::Output out(x, M, n, bias);
  const float* bp = out.bias();
  const int64_t nkb = K2p / KB;
  // Rows in blocks of `mb` (a block's activations stay in L2 while the thread's panels pass
  // by; without it every panel re-read all of a long prefill's x from L3), each panel's rows of
  // the block in tiles of 32.  Panels are widened again for every row block: mb rows of tile
  // multiplies amortize it.
  const int64_t mb = std::max<int64_t>(32, (int64_t{1} << 20) / (lda * 2 * (alo.main ? 2 : 1)) / 32 * 32);
  const bool stream = M <= 32;
  // Two panels at once (`panel_pair_rows`) for a bf16 x of up to 16 rows, and of up to 32 for
  // weights read in place (bf16): one pass per row tile over a chunk of k-blocks whose weights
  // (4 KiB a k-block for the pair) the second pass finds in L2.  Widened weights keep
  // `panel_rows` there, which widens each k-block once for both row tiles.
  const bool pairs = M <= (Panels::kInPlace ? 32 : 16) && !alo.main;
  const int64_t chunk = M <= 16 ? nkb : pair_chunk(scale.group_blocks, nkb);
  // Rows [m0, m0 + 32) (those below M) of panel p from acc (rows `stride` floats apart), the bias
  // added, into y.
  const auto emit = [&](int64_t p, int64_t m0, const float* acc, int64_t stride) {
    const int64_t ncols = std::min<int64_t>(PANEL, n - p * PANEL);
    const __mmask16 m0k = static_cast<__mmask16>(ncols >= 16 ? 0xFFFF : (1u << ncols) - 1);
    const __mmask16 m1k = static_cast<__mmask16>(ncols >= 32 ? 0xFFFF : ncols > 16 ? (1u << (ncols - 16)) - 1 : 0);
    const __m512 b0 = bp ? _mm512_maskz_loadu_ps(m0k, bp + p * PANEL) : _mm512_setzero_ps();
    const __m512 b1 = bp ? _mm512_maskz_loadu_ps(m1k, bp + p * PANEL + 16) : _mm512_setzero_ps();
    for (int64_t i = 0; i < std::min<int64_t>(32, M - m0); ++i) {
      const int64_t at = (m0 + i) * n + p * PANEL;
      out.store(at, m0k, _mm512_add_ps(_mm512_loadu_ps(acc + i * stride), b0));
      if (m1k) out.store(at + 16, m1k, _mm512_add_ps(_mm512_loadu_ps(acc + i * stride + 16), b1));
    }
  };
  // Rows of one block (decode): the panels shared as the threads finish (gemm_driver.h), in
  // pairs where pairs are taken; more blocks keep one run per thread, each block over all of it.
  // int4 keeps its runs too: its widening and group scales make its tile work the bound, which
  // sharing does not shorten, and shared it measured ~3% slower at 12 and 16 rows.
  const auto body = [&](auto& pieces) {
    begin_tiles();
    std::vector<uint16_t> buf(stream ? 0 : K2p * PANEL * 2 + 32);
    alignas(64) uint16_t kbuf[2][KB * PANEL * 2];
    alignas(64) float acc[32 * 64];
    alignas(64) float ctile[4 * 256];
    int64_t p0, p1;
    while (pieces.next(p0, p1)) {
      for (int64_t r0 = 0; r0 < M; r0 += mb) {
        for (int64_t p = p0; p < p1; ++p) {
          if (pairs && p + 1 < p1) {  // this panel and the next, one activation load for both
            const auto block = [&](int64_t which, int64_t kb) { return src.block(p + which, kb, kbuf[which]); };
            std::fill(acc, acc + (M + 15) / 16 * 16 * 64, 0.f);
            for (int64_t kc = 0; kc < nkb; kc += chunk)
              for (int64_t m0 = 0; m0 < M; m0 += 16)
                panel_pair_rows(ap, m0, M, block, kc, std::min(nkb, kc + chunk), scale, p, acc + m0 * 64, ctile);
            emit(p, 0, acc, 64);
            emit(p + 1, 0, acc + 32, 64);
            ++p;
            continue;
          }
          // One row tile pair (a decode step): each k-block is widened just before its multiplies,
          // into a buffer that stays in L1 (two, alternating), not the whole panel into L2 first.
          const uint16_t* b = stream ? nullptr : src.panel(p, buf.data());
          const auto whole = [&](int64_t kb) { return b + kb * KB * PANEL * 2; };
          const auto streamed = [&](int64_t kb) { return src.block(p, kb, kbuf[kb & 1]); };
          for (int64_t m0 = r0; m0 < std::min(M, r0 + mb); m0 += 32) {
            if (stream)
              panel_rows(ap, alo, M, m0, streamed, nkb, scale, p, acc, ctile);
            else
              panel_rows(ap, alo, M, m0, whole, nkb, scale, p, acc, ctile);
            emit(p, m0, acc, 32);
          }
        }
      }
    }
    _tile_release();
  };
  if (M <= mb && !std::is_same_v<Panels, Int4Panels>)
    tokenloom::for_panel_pieces(panels, body, pairs ? 2 : 1);
  else
    tokenloom::for_whole_runs(panels, body);
  return out.result(x, n);
}

int64_t pad_pairs(int64_t k2) { return (k2 + KB - 1) / KB * KB; }

// bf16 weights in `pack_pairs` panels [P, K2, 32, 2].
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 4 && w.size(2) == PANEL && w.size(3) == 2 &&
              w.is_contiguous(), "tokenloom_amx::linear_bf16 takes pack_pairs panels");
  const int64_t K = x.size(-1), K2 = w.size(1);
  TORCH_CHECK((K + 1) / 2 == K2, "x has ", K, " features, the packed weight ", K2, " pairs");
  const Bf16Panels src{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K2, pad_pairs(K2)};
  return amx_linear(x, K, src.K2p, w.size(0), n, src, NoScale{src.K2p / KB}, bias);
}

// int8 weights in k-quad panels [P, K4, 32, 4], float32 column scales [P * 32].
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 4 && q.size(2) == PANEL && q.size(3) == 4 &&
              q.is_contiguous(), "tokenloom_amx::linear_int8 takes k-quad int8 panels");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() >= q.size(0) * PANEL && scales.is_contiguous(),
              "int8 scales: float32, one per padded column");
  const int64_t K = x.size(-1), K4 = q.size(1);
  TORCH_CHECK((K + 3) / 4 == K4, "x has ", K, " features, the packed weight ", K4, " quads");
  const Int8Panels src{q.data_ptr<int8_t>(), K4, pad_pairs(2 * K4)};
  return amx_linear(x, K, src.K2p, q.size(0), n, src, ColScale{scales.data_ptr<float>(), src.K2p / KB}, bias);
}

// int4 weights in panels [P, Kp, 16] uint8, group scales [P, Kp / G, 32] bf16 or float16; G a
// multiple of 32.
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n, int64_t group,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 3 && q.size(2) == 16 && q.is_contiguous(),
              "tokenloom_amx::linear_int4 takes int4 panels");
  TORCH_CHECK(group % (KB * 2) == 0, "tokenloom_amx::linear_int4 needs groups of a multiple of 32, not ", group);
  TORCH_CHECK((scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kHalf) && scales.dim() == 3 &&
              scales.is_contiguous() && scales.size(0) == q.size(0) && scales.size(2) == PANEL,
              "int4 scales: [P, groups, 32] bfloat16 or float16");
  const int64_t K = x.size(-1), Kp = q.size(1);
  TORCH_CHECK(Kp % group == 0 && K <= Kp && Kp - K < group, "x has ", K, " features, the packed weight ", Kp);
  const Int4Panels src{q.data_ptr<uint8_t>(), Kp, Kp / 2};
  const GroupScale sc{reinterpret_cast<const uint16_t*>(scales.data_ptr()), scales.size(1), group / (KB * 2),
                      scales.scalar_type() == at::kHalf};
  return amx_linear(x, K, src.K2p, q.size(0), n, src, sc, bias);
}

// int8 weights multiplied as bytes by AMX int8 tiles (TDPBSSD: [16 x 64] int8 x [64 x 16] int8
// into int32), straight from the k-quad panels, which are AMX's int8 B-tile layout (a tile is
// 16 k-quads of one 16-column half, rows 128 bytes apart): nothing is widened.  Each activation
// row is split into two int8 planes: hi = round(x / s) with s = max|x| / 127, and lo = the
// remainder in steps of s / 254, so x = s * hi + (s / 254) * lo to within s / 508 (2^-15.9 of
// the row's largest value; bf16 rounding is 2^-9 of each value).  Two multiplies per tile pair.
struct SplitRows {
  at::Tensor hi, lo;      // [M rounded up to 16, Kq] int8, K zero-padded to Kq
  std::vector<float> s;   // per row: s (hi's step); lo's is s / 254
};

SplitRows split_rows(const at::Tensor& x2, int64_t Kq) {
  const int64_t M = x2.size(0), K = x2.size(1);
  const at::Tensor xf = x2.to(at::kFloat).contiguous();
  SplitRows r;
  const int64_t Mp = (M + 15) / 16 * 16;
  r.hi = at::zeros({Mp, Kq}, x2.options().dtype(at::kChar));
  r.lo = at::zeros({Mp, Kq}, x2.options().dtype(at::kChar));
  r.s.assign(Mp, 0.f);
  const float* xp = xf.data_ptr<float>();
  int8_t* hp = r.hi.data_ptr<int8_t>();
  int8_t* lp = r.lo.data_ptr<int8_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
      const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s, inv_lo = 254.f / s;
      r.s[m] = s;
      for (int64_t k = 0; k < K; ++k) {
        const float h = std::nearbyint(row[k] * inv);
        hp[m * Kq + k] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, h)));
        const float rest = row[k] - h * s;
        lp[m * Kq + k] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(rest * inv_lo))));
      }
    }
  });
  return r;
}

at::Tensor linear_int8_tiles(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu(), "tokenloom_amx runs on CPU");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 4 && q.size(2) == PANEL && q.size(3) == 4 &&
              q.is_contiguous(), "tokenloom_amx::linear_int8_tiles takes k-quad int8 panels");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() >= q.size(0) * PANEL && scales.is_contiguous(),
              "int8 scales: float32, one per padded column");
  const int64_t K = x.size(-1), K4 = q.size(1), panels = q.size(0);
  TORCH_CHECK((K + 3) / 4 == K4, "x has ", K, " features, the packed weight ", K4, " quads");
  TORCH_CHECK(panels * PANEL >= n, "n exceeds the packed panels");
  const int64_t K4p = (K4 + 15) / 16 * 16, Kq = K4p * 4, nkb = K4p / 16;
  const at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  const SplitRows a = split_rows(x2, Kq);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  at::Tensor y = at::empty({M, n}, x.options().dtype(at::kFloat));
  at::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() >= n, "bias shorter than n");
    bp = bias_f.data_ptr<float>();
  }
  const int8_t* wp = q.data_ptr<int8_t>();
  const int8_t* hp = a.hi.data_ptr<int8_t>();
  const int8_t* lp = a.lo.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  tokenloom::for_panel_pieces(panels, [&](auto& pieces) {
    begin_tiles();
    std::vector<int8_t> buf(K4 == K4p ? 0 : K4p * PANEL * 4);
    alignas(64) int32_t ct[4 * 256];
    int64_t p0, p1;
    while (pieces.next(p0, p1)) {
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* b = wp + p * K4 * PANEL * 4;
        if (K4 != K4p) {
          std::memcpy(buf.data(), b, K4 * PANEL * 4);
          std::memset(buf.data() + K4 * PANEL * 4, 0, (K4p - K4) * PANEL * 4);
          b = buf.data();
        }
        const int64_t ncols = std::min<int64_t>(PANEL, n - p * PANEL);
        const __mmask16 mk[2] = {static_cast<__mmask16>(ncols >= 16 ? 0xFFFF : (1u << ncols) - 1),
                                 static_cast<__mmask16>(ncols >= 32   ? 0xFFFF
                                                        : ncols > 16 ? (1u << (ncols - 16)) - 1
                                                                     : 0)};
        __m512 cs[2], bs[2];
        for (int h = 0; h < 2; ++h) {
          cs[h] = _mm512_loadu_ps(sp + p * PANEL + h * 16);
          bs[h] = bp ? _mm512_maskz_loadu_ps(mk[h], bp + p * PANEL + h * 16) : _mm512_setzero_ps();
        }
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t kb = 0; kb < nkb; ++kb) {
            const int8_t* bt = b + kb * 16 * PANEL * 4;
            _tile_loadd(6, bt, PANEL * 4);
            _tile_loadd(7, bt + 64, PANEL * 4);
            _tile_loadd(4, hp + m0 * Kq + kb * 64, Kq);
            _tile_loadd(5, lp + m0 * Kq + kb * 64, Kq);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
          }
          _tile_stored(0, ct, 64);
          _tile_stored(1, ct + 256, 64);
          _tile_stored(2, ct + 512, 64);
          _tile_stored(3, ct + 768, 64);
          for (int64_t i = 0; i < std::min<int64_t>(16, M - m0); ++i) {
            const __m512 sh = _mm512_set1_ps(a.s[m0 + i]), sl = _mm512_set1_ps(a.s[m0 + i] / 254.f);
            float* yi = yp + (m0 + i) * n + p * PANEL;
            for (int h = 0; h < 2; ++h) {
              if (!mk[h]) continue;
              const __m512 hi = _mm512_cvtepi32_ps(_mm512_loadu_si512(ct + h * 256 + i * 16));
              const __m512 lo = _mm512_cvtepi32_ps(_mm512_loadu_si512(ct + 512 + h * 256 + i * 16));
              const __m512 v = _mm512_fmadd_ps(_mm512_fmadd_ps(hi, sh, _mm512_mul_ps(lo, sl)), cs[h], bs[h]);
              _mm512_mask_storeu_ps(yi + h * 16, mk[h], v);
            }
          }
        }
      }
    }
    _tile_release();
  });
  return y.view(out_sizes).to(x.scalar_type());
}

// One int8 and one bf16 tile multiply on known values, checked against plain loops:
// [permission granted, int8 correct, bf16 correct].  Traps (SIGILL) where the CPU or VM does
// not run tile instructions: kernels/amx_probe.py calls it only in a child process.
at::Tensor probe() {
  at::Tensor out = at::zeros({3}, at::kLong);
  auto o = out.data_ptr<int64_t>();
  o[0] = request_tiles();
  if (!o[0]) return out;
  _tile_loadconfig(&kConfig);
  alignas(64) int8_t a8[16 * 64], b8[16 * 64];
  alignas(64) int32_t c32[16 * 16];
  alignas(64) uint16_t a16[16 * 32], b16[16 * 32];
  alignas(64) float cf[16 * 16];
  for (int i = 0; i < 16 * 64; ++i) {
    a8[i] = static_cast<int8_t>((i * 7) % 23 - 11);
    b8[i] = static_cast<int8_t>((i * 5) % 19 - 9);
  }
  for (int i = 0; i < 16 * 32; ++i) {
    const float fa = static_cast<float>((i * 3) % 17 - 8), fb = static_cast<float>((i * 11) % 13 - 6);
    uint32_t ua, ub;
    std::memcpy(&ua, &fa, 4);
    std::memcpy(&ub, &fb, 4);
    a16[i] = static_cast<uint16_t>(ua >> 16);
    b16[i] = static_cast<uint16_t>(ub >> 16);
  }
  _tile_zero(0);
  _tile_loadd(4, a8, 64);
  _tile_loadd(6, b8, 64);
  _tile_dpbssd(0, 4, 6);
  _tile_stored(0, c32, 64);
  _tile_zero(1);
  _tile_loadd(5, a16, 64);
  _tile_loadd(7, b16, 64);
  _tile_dpbf16ps(1, 5, 7);
  _tile_stored(1, cf, 64);
  _tile_release();
  bool ok8 = true, ok16 = true;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      int32_t s = 0;
      float f = 0;
      for (int k = 0; k < 64; ++k) s += a8[i * 64 + k] * b8[(k / 4) * 64 + j * 4 + k % 4];
      for (int k = 0; k < 32; ++k)
        f += static_cast<float>((i * 32 + k) * 3 % 17 - 8) *
             static_cast<float>(((k / 2) * 32 + j * 2 + k % 2) * 11 % 13 - 6);
      ok8 = ok8 && s == c32[i * 16 + j];
      ok16 = ok16 && f == cf[i * 16 + j];
    }
  o[1] = ok8;
  o[2] = ok16;
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_amx, m) {
  m.def("linear_bf16(Tensor x, Tensor weight_packed, int n, Tensor? bias) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor qweight, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("linear_int8_tiles(Tensor x, Tensor qweight, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor qweight, Tensor scales, int n, int group, Tensor? bias) -> Tensor");
  m.def("probe() -> Tensor", &probe);
}

TORCH_LIBRARY_IMPL(tokenloom_amx, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int8_tiles", &linear_int8_tiles);
  m.impl("linear_int4", &linear_int4);
}
