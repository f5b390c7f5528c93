// Paged decode attention for bfloat16 KV caches on CPUs with usable AMX (kernels/amx.py): the
// two products of cpu_attention.cpp's loop as tile multiplies.
//
// cpu_attention.cpp's 512-bit loop spends its time in FMAs: per cached token and query head,
// D / 16 of them for q.k and as many for p.v, and a bf16 cache widened on every load.  With G
// query heads sharing a KV head (grouped-query attention), each 32-token chunk of a request's
// history (its tokens gathered from their blocks) is, for up to 16 of the G heads at a time:
//
//   S [16 heads x 32 tokens] = Q [heads x D] . K^T       A = the heads' q rows (bf16, as the
//                                                        model made them), B = the chunk's keys
//                                                        as dimension pairs (a 32-bit transpose)
//   online softmax over S's rows, as cpu_attention.cpp   scaled by `scale` here, not folded into q
//   O [16 heads x D] += P . V                            A = P rounded to bf16 (as PyTorch's CPU
//                                                        flash attention and transformers' eager
//                                                        attention round it), B = the chunk's
//                                                        values as token pairs (interleaved rows)
//
// Sums are float32.  Rows past G and tokens past the context are zeros in both operands.
// Block sizes of whole 16-token tiles take `attend_amx_set` where it fills the lanes: keys read
// in place as the A operand, several KV heads a pass (below).
// Registers tokenloom_amx::paged_decode_attention (same schema as the others), for bf16 q and
// caches and a head size that is a multiple of 32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "simd_avx512.h"

namespace {

using tokenloom::amx::TileConfig;

constexpr int64_t kChunk = 32;  // tokens per step: two B tiles of 16 keys, one A tile of 32 weights
constexpr int64_t kRows = 16;   // query heads per tile (more are done 16 at a time)

// `attend_amx`: 0: q, 32 dims of 16 heads; 1: k, 16 dim pairs x 16 tokens; 2, 3: S [16 x 16]
// float32 of the chunk's two halves; 4: P, 16 heads x 32 tokens bf16; 5: v, 16 token pairs x 16
// dims; 6: O, 16 heads x 16 dims.  `attend_amx_set`: 0, 5: 16 tokens' keys (32 dims), 1: q^T,
// 2, 3: S^T of the two halves, then with 6, 7 four O tiles; 4: P; 0, 1, 5: v.  Every tile is 16
// rows of 64 bytes.
alignas(64) static const TileConfig kConfig = tokenloom::amx::uniform_config(8, 16, 64);

// The 16 x 16 matrix of 32-bit elements in r transposed in place (three rounds of unpacks and
// lane shuffles).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4i + j] now holds, in each 128-bit lane L, row (4i + 0..3)'s column 4L + j.
  for (int i = 0; i < 4; ++i) {
    t[4 * i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);       // lanes 0, 2 of each
    t[4 * i + 1] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xDD);   // lanes 1, 3
    t[4 * i + 2] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[4 * i + 3] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[4 * i], t[4 * i + 2], 0x88);        // column i
    r[8 + i] = _mm512_shuffle_i32x4(t[4 * i], t[4 * i + 2], 0xDD);    // column 8 + i
    r[4 + i] = _mm512_shuffle_i32x4(t[4 * i + 1], t[4 * i + 3], 0x88);  // column 4 + i
    r[12 + i] = _mm512_shuffle_i32x4(t[4 * i + 1], t[4 * i + 3], 0xDD);  // column 12 + i
  }
}

// Indices that interleave two token rows' 16 dims from half h of a 32-dim vector (0: dims
// 0-15, 1: 16-31): the values as token pairs.
alignas(64) static const uint16_t kPairIdx[2][32] = {
    {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
    {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};

// Row j of the value tiles at vp (tile d16: dims 16 d16 .. +15) from two token rows of D = 32
// pieces dims: ra's and rb's values interleaved, zeros for a missing row (past the context).
inline void pair_row(const uint16_t* ra, const uint16_t* rb, int64_t pieces, const __m512i pair_idx[2], uint16_t* vp,
                     int64_t j) {
  for (int64_t p = 0; p < pieces; ++p) {
    const __m512i a = ra ? _mm512_loadu_si512(ra + 32 * p) : _mm512_setzero_si512();
    const __m512i b = rb ? _mm512_loadu_si512(rb + 32 * p) : _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h)
      _mm512_storeu_si512(vp + ((2 * p + h) * 16 + j) * 32, _mm512_permutex2var_epi16(a, pair_idx[h], b));
  }
}

// One (request, KV head, up to 16 of its query heads): q [gn, D] bf16, out [gn, D] float32.
// Scratch: kt (2 halves x D / 32 tiles of 16 x 64 bytes), vp (D / 16 tiles of 16 x 64 bytes),
// qt (16 x D bf16), pt (16 x 32 bf16), s (16 x 32) and o (16 x D) float32, acc (16 x D).
struct Scratch {
  std::vector<uint16_t> kt, vp, qt, pt;
  std::vector<float> s, o, acc;
  explicit Scratch(int64_t D)
      : kt(D * kChunk), vp(D * kChunk), qt(kRows * D), pt(kRows * kChunk), s(kRows * kChunk), o(kRows * D),
        acc(kRows * D) {}
};

void attend_amx(const uint16_t* q, int64_t gn, int64_t D, const uint16_t* k_cache, const uint16_t* v_cache,
                const int64_t* table, int64_t ctx, int64_t bs, int64_t token_stride, float scale, float* out,
                Scratch& w) {
  std::fill(w.qt.begin(), w.qt.end(), 0);
  std::copy(q, q + gn * D, w.qt.begin());
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  std::fill(w.pt.begin(), w.pt.end(), 0);
  float m[kRows], l[kRows];
  std::fill(m, m + kRows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + kRows, 0.0f);
  const int64_t pieces = D / 32;
  const __m512i pair_idx[2] = {_mm512_load_si512(kPairIdx[0]), _mm512_load_si512(kPairIdx[1])};
  const uint16_t* krow[kChunk];
  const uint16_t* vrow[kChunk];
  for (int64_t c0 = 0; c0 < ctx; c0 += kChunk) {
    // the chunk's tokens, wherever their blocks lie; past the context, none
    const int64_t n = std::min(kChunk, ctx - c0);
    for (int64_t t = 0, blk = c0 / bs, off = c0 % bs; t < n; ++t) {  // one division a chunk, not two a token
      const int64_t at = (table[blk] * bs + off) * token_stride;
      krow[t] = k_cache + at;
      vrow[t] = v_cache + at;
      if (++off == bs) {
        off = 0;
        ++blk;
      }
    }
    // K^T as dimension pairs: half h, piece p's tile row i is dims (32p + 2i, +1) of tokens 16h..16h+15
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t p = 0; p < pieces; ++p) {
        __m512i r[16];
        for (int64_t t = 0; t < 16; ++t)
          r[t] = 16 * h + t < n ? _mm512_loadu_si512(krow[16 * h + t] + 32 * p) : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(w.kt.data() + ((h * pieces + p) * 16 + i) * 32, r[i]);
      }
    // V as token pairs: tile d16's row j is dims 16 d16 .. +15 of tokens 2j and 2j + 1, interleaved
    for (int64_t j = 0; j < kChunk / 2; ++j)
      pair_row(2 * j < n ? vrow[2 * j] : nullptr, 2 * j + 1 < n ? vrow[2 * j + 1] : nullptr, pieces, pair_idx,
               w.vp.data(), j);
    // S = Q K^T, the chunk's two halves of 16 tokens
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p = 0; p < pieces; ++p) {
      _tile_loadd(0, w.qt.data() + 32 * p, D * 2);
      _tile_loadd(1, w.kt.data() + p * 16 * 32, 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(1, w.kt.data() + (pieces + p) * 16 * 32, 64);
      _tile_dpbf16ps(3, 0, 1);
    }
    _tile_stored(2, w.s.data(), kChunk * 4);
    _tile_stored(3, w.s.data() + 16, kChunk * 4);
    // online softmax per head over the chunk's n tokens; P rounded to bf16 for the product
    const __mmask16 live0 = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    const __mmask16 live1 = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0);
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < gn; ++g) {
      const __m512 x0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(live0, w.s.data() + g * kChunk), sv);
      const __m512 x1 = _mm512_mul_ps(_mm512_maskz_loadu_ps(live1, w.s.data() + g * kChunk + 16), sv);
      const __m512 mx = _mm512_max_ps(_mm512_mask_blend_ps(live0, _mm512_set1_ps(-INFINITY), x0),
                                      _mm512_mask_blend_ps(live1, _mm512_set1_ps(-INFINITY), x1));
      const float mb = std::max(m[g], _mm512_reduce_max_ps(mx));
      const float alpha = mb == m[g] ? 1.0f : std::exp(m[g] - mb);  // exp(-inf) = 0 on the first chunk
      const __m512 mv = _mm512_set1_ps(mb);
      const __m512 e0 = _mm512_maskz_mov_ps(live0, tokenloom::exp16(_mm512_sub_ps(x0, mv)));
      const __m512 e1 = _mm512_maskz_mov_ps(live1, tokenloom::exp16(_mm512_sub_ps(x1, mv)));
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
      m[g] = mb;
      uint16_t* pg = w.pt.data() + g * kChunk;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg), tokenloom::convert_to_bf16(e0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + 16), tokenloom::convert_to_bf16(e1));
      if (alpha != 1.0f) {
        const __m512 av = _mm512_set1_ps(alpha);
        float* ag = w.acc.data() + g * D;
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(ag + d, _mm512_mul_ps(av, _mm512_loadu_ps(ag + d)));
      }
    }
    // O = P V, 16 dims at a time, added to the running output
    _tile_loadd(4, w.pt.data(), kChunk * 2);
    for (int64_t d16 = 0; d16 < D / 16; ++d16) {
      _tile_zero(6);
      _tile_loadd(5, w.vp.data() + d16 * 16 * 32, 64);
      _tile_dpbf16ps(6, 4, 5);
      _tile_stored(6, w.o.data() + d16 * 16, D * 4);
    }
    for (int64_t g = 0; g < gn; ++g)
      for (int64_t d = 0; d < D; d += 16) {
        float* ag = w.acc.data() + g * D + d;
        _mm512_storeu_ps(ag, _mm512_add_ps(_mm512_loadu_ps(ag), _mm512_loadu_ps(w.o.data() + g * D + d)));
      }
  }
  for (int64_t g = 0; g < gn; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = w.acc[g * D + d] * inv;
  }
}

// Keys read in place, several KV heads a pass (block sizes of whole 16-token tiles, up to 16
// query heads in the pass).  `attend_amx` transposes every cached key into dimension pairs on
// every step (a quarter of its time); here the keys are the *A* operand, 16 tokens of a block
// straight from the cache (a tile load takes a row stride), and the query heads the B operand:
//
//   S^T [16 tokens x 16 lanes] = K [tokens x D] . Q^T    lane = one query head of the set's
//                                                        KV heads (KV head h's lanes take its
//                                                        keys: the other heads' B columns are 0)
//   online softmax per lane (a query head) over the chunk's token rows, as `attend_amx`
//   O [16 lanes x D] += P_h . V_h over the set's heads    P_h = P's rows of h's lanes (others 0),
//                                                        transposed from the token rows once a
//                                                        chunk; V_h as token pairs
//
// With grouped-query attention of 7 query heads per KV head, two KV heads fill 14 of the 16
// lanes: a request's softmax is 33 16-lane exponentials a 32-token chunk for both KV heads, as
// `attend_amx` spends 14 per KV head.  Tokens past the context are masked out of the softmax
// (their keys may be any bits: an unwritten slot) and their values read as zeros.  The causal
// prefill (`prefill_tile`) runs the same loop with 16 query positions of one head for lanes.
struct SetScratch {
  std::vector<uint16_t> bq, pt, vp;
  std::vector<float> s, o, acc;
  SetScratch(int64_t ns, int64_t D)
      : bq(ns * (D / 32) * 512), pt(ns * kRows * kChunk), vp(2 * ns * (D / 16) * 512), s(kChunk * kRows), o(kRows * D),
        acc(kRows * D) {}
};

// Token t of a request (t a multiple of 16: the first of 16 tokens in one block, bs being a
// multiple of 16) in `cache`, through its block table; its next 15 tokens follow token_stride apart.
inline const uint16_t* block_tokens(const uint16_t* cache, const int64_t* table, int64_t t, int64_t bs,
                                    int64_t token_stride) {
  return cache + (table[t / bs] * bs + t % bs) * token_stride;
}

// Q^T as B tiles into bq, per KV head h < ns and 32-dim piece: tile row i is dims (32p + 2i, +1)
// of each lane c, read from row(h, c) (nullptr: the lane is not h's, a zero column).
template <typename Row>
void transpose_queries(int64_t ns, int64_t D, const Row& row, uint16_t* bq) {
  for (int64_t h = 0; h < ns; ++h)
    for (int64_t p = 0; p < D / 32; ++p) {
      __m512i r[16];
      for (int64_t c = 0; c < 16; ++c) {
        const uint16_t* qc = row(h, c);
        r[c] = qc ? _mm512_loadu_si512(qc + 32 * p) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(bq + ((h * (D / 32) + p) * 16 + i) * 32, r[i]);
    }
}

// The lanes' attention over keys [0, ctx), with w.bq filled (`transpose_queries`): lanes [0, lanes)
// are live, lane c belongs to KV head c / G (of ns); reach(c0, t) is the mask of lanes that key
// c0 + t reaches (t below the chunk's count); values.tiles(c0, h) KV head h's values of the chunk
// at c0 as token pairs (D / 16 tiles), values.ahead(c0) a hint that the chunk at c0 comes next.
// out [lanes, D] float32.
template <typename Reach, typename Values>
void attend_lanes(int64_t ns, int64_t G, int64_t lanes, int64_t D, const uint16_t* k_cache, const int64_t* table,
                  int64_t ctx, int64_t bs, int64_t token_stride, float scale, const Reach& reach, Values& values,
                  float* out, SetScratch& w) {
  const int64_t pieces = D / 32, vtiles = D / 16, kstride = token_stride * 2;  // bytes between a block's tokens
  std::fill(w.pt.begin(), w.pt.end(), 0);  // each head's P keeps only its own lanes' rows
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t c0 = 0; c0 < ctx; c0 += kChunk) {
    const int64_t n = std::min(kChunk, ctx - c0), halves = (n + 15) / 16;
    const uint16_t* kbase[2] = {block_tokens(k_cache, table, c0, bs, token_stride),
                                halves > 1 ? block_tokens(k_cache, table, c0 + 16, bs, token_stride) : nullptr};
    // S^T, a tile per half (2: tokens 0-15, 3: 16-31), both halves beside each other: two
    // chains of tile products, one query tile load for both
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t h = 0; h < ns; ++h)
      for (int64_t p = 0; p < pieces; ++p) {
        _tile_loadd(1, w.bq.data() + (h * pieces + p) * 16 * 32, 64);
        _tile_loadd(0, kbase[0] + h * D + 32 * p, kstride);
        _tile_dpbf16ps(2, 0, 1);
        if (halves > 1) {
          _tile_loadd(5, kbase[1] + h * D + 32 * p, kstride);
          _tile_dpbf16ps(3, 5, 1);
        }
      }
    _tile_stored(2, w.s.data(), 64);
    if (halves > 1) _tile_stored(3, w.s.data() + 16 * kRows, 64);
    // online softmax per lane over the chunk's token rows each reaches
    __m512 mc = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; ++t)
      mc = _mm512_mask_max_ps(mc, reach(c0, t), mc, _mm512_mul_ps(_mm512_loadu_ps(w.s.data() + t * kRows), sv));
    const __m512 mb = _mm512_max_ps(m, mc);
    // exp(-inf - mb) on the first chunk: exp16 clamps, so the old sums (zeros) are scaled by ~1e-38
    const __m512 alpha = tokenloom::exp16(_mm512_sub_ps(m, mb));
    m = mb;
    __m512 lc = _mm512_setzero_ps();
    __m512i pairs[16];
    for (int64_t i = 0; i < 16; ++i) {
      __m512i two[2];
      for (int u = 0; u < 2; ++u) {
        const int64_t t = 2 * i + u;
        __m512 e = _mm512_setzero_ps();
        if (t < n)
          e = _mm512_maskz_mov_ps(reach(c0, t),
                                  tokenloom::exp16(_mm512_fmsub_ps(_mm512_loadu_ps(w.s.data() + t * kRows), sv, mb)));
        lc = _mm512_add_ps(lc, e);
        two[u] = _mm512_cvtepu16_epi32(tokenloom::convert_to_bf16(e));
      }
      pairs[i] = _mm512_or_si512(two[0], _mm512_slli_epi32(two[1], 16));  // lane c: tokens 2i, 2i + 1
    }
    l = _mm512_fmadd_ps(l, alpha, lc);
    transpose16(pairs);  // row c: lane c's 32 weights, token pairs in order
    for (int64_t c = 0; c < lanes; ++c)
      _mm512_storeu_si512(w.pt.data() + ((c / G) * kRows + c) * kChunk, pairs[c]);
    if (c0 + kChunk < ctx) values.ahead(c0 + kChunk);
    // O = sum over the heads of P_h V_h, up to 64 dims at a time in four sum tiles (2, 3, 6, 7:
    // independent chains of products)
    for (int64_t g0 = 0; g0 < vtiles; g0 += 4) {
      const int64_t cnt = std::min<int64_t>(4, vtiles - g0);
      _tile_zero(2);
      if (cnt > 1) _tile_zero(3);
      if (cnt > 2) _tile_zero(6);
      if (cnt > 3) _tile_zero(7);
      for (int64_t h = 0; h < ns; ++h) {
        _tile_loadd(4, w.pt.data() + h * kRows * kChunk, kChunk * 2);
        const uint16_t* vt = values.tiles(c0, h) + g0 * 16 * 32;
        _tile_loadd(5, vt, 64);
        _tile_dpbf16ps(2, 4, 5);
        if (cnt > 1) {
          _tile_loadd(0, vt + 512, 64);
          _tile_dpbf16ps(3, 4, 0);
        }
        if (cnt > 2) {
          _tile_loadd(1, vt + 1024, 64);
          _tile_dpbf16ps(6, 4, 1);
        }
        if (cnt > 3) {
          _tile_loadd(5, vt + 1536, 64);
          _tile_dpbf16ps(7, 4, 5);
        }
      }
      _tile_stored(2, w.o.data() + g0 * 16, D * 4);
      if (cnt > 1) _tile_stored(3, w.o.data() + (g0 + 1) * 16, D * 4);
      if (cnt > 2) _tile_stored(6, w.o.data() + (g0 + 2) * 16, D * 4);
      if (cnt > 3) _tile_stored(7, w.o.data() + (g0 + 3) * 16, D * 4);
    }
    // the running output rescaled to the new maxima, plus the chunk's
    alignas(64) float av[16];
    _mm512_store_ps(av, alpha);
    for (int64_t c = 0; c < lanes; ++c) {
      const __m512 a = _mm512_set1_ps(av[c]);
      for (int64_t d = 0; d < D; d += 16) {
        float* ac = w.acc.data() + c * D + d;
        _mm512_storeu_ps(ac, _mm512_fmadd_ps(_mm512_loadu_ps(ac), a, _mm512_loadu_ps(w.o.data() + c * D + d)));
      }
    }
  }
  alignas(64) float lv[16];
  _mm512_store_ps(lv, l);
  for (int64_t c = 0; c < lanes; ++c) {
    const float inv = lv[c] > 0.0f ? 1.0f / lv[c] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[c * D + d] = w.acc[c * D + d] * inv;
  }
}

// One request's ns KV heads (G query heads each: q [ns * G, D] bf16) over its ctx cached tokens.
void attend_amx_set(const uint16_t* q, int64_t ns, int64_t G, int64_t D, const uint16_t* k_cache,
                    const uint16_t* v_cache, const int64_t* table, int64_t ctx, int64_t bs, int64_t token_stride,
                    float scale, float* out, SetScratch& w) {
  const int64_t lanes = ns * G;
  transpose_queries(ns, D, [&](int64_t h, int64_t c) { return c / G == h && c < lanes ? q + c * D : nullptr; },
                    w.bq.data());
  // The values paired a chunk ahead, into two alternating buffers, so that the stores have left
  // for the cache before the tile loads read them.
  struct Ahead {
    const uint16_t* v_cache;
    const int64_t* table;
    int64_t ns, D, ctx, bs, token_stride;
    uint16_t* vp;
    __m512i pair_idx[2];
    uint16_t* buf(int64_t c0) const { return vp + (c0 / kChunk % 2) * ns * (D / 16) * 512; }
    void ahead(int64_t c0) const {  // KV head h's tile (h, d16) row j: dims 16 d16 .. +15 of tokens 2j, 2j + 1
      const int64_t n = std::min(kChunk, ctx - c0);
      const uint16_t* half[2] = {block_tokens(v_cache, table, c0, bs, token_stride),
                                 n > 16 ? block_tokens(v_cache, table, c0 + 16, bs, token_stride) : nullptr};
      const auto row = [&](int64_t t) { return t < n ? half[t / 16] + (t % 16) * token_stride : nullptr; };
      for (int64_t h = 0; h < ns; ++h)
        for (int64_t j = 0; j < kChunk / 2; ++j) {
          const uint16_t* ra = row(2 * j);
          const uint16_t* rb = row(2 * j + 1);
          pair_row(ra ? ra + h * D : nullptr, rb ? rb + h * D : nullptr, D / 32, pair_idx, buf(c0) + h * (D / 16) * 512, j);
        }
    }
    const uint16_t* tiles(int64_t c0, int64_t h) const { return buf(c0) + h * (D / 16) * 512; }
  } values{v_cache, table, ns, D, ctx, bs, token_stride, w.vp.data(),
           {_mm512_load_si512(kPairIdx[0]), _mm512_load_si512(kPairIdx[1])}};
  values.ahead(0);
  attend_lanes(ns, G, lanes, D, k_cache, table, ctx, bs, token_stride, scale,
               [](int64_t, int64_t) { return static_cast<__mmask16>(0xFFFF); }, values, out, w);
}

// q [N, Hq, D] bf16; k_cache, v_cache [num_blocks, block_size, Hk, D] bf16; block_tables
// [N, max_blocks] int64; context_lens [N] int64.  Returns [N, Hq, D] bf16.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "tokenloom_amx attention takes bfloat16 q and caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 32 == 0 && Hq % Hk == 0, "head_dim must be a multiple of 32");
  const int64_t G = Hq / Hk;
  const auto qc = q.contiguous();
  const auto bt = block_tables.to(at::kLong).contiguous();
  const auto cl = context_lens.to(at::kLong).contiguous();
  TORCH_CHECK(bt.size(0) == N && cl.size(0) == N, "one block table and context length per query");
  auto out = at::empty({N, Hq, D}, qc.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* clp = cl.data_ptr<int64_t>();
  const int64_t nb = bt.size(1), token_stride = Hk * D, groups = (G + kRows - 1) / kRows;
  // Keys in place (`attend_amx_set`) where a pass fills most of the 16 lanes: as many KV heads
  // a pass as fit, while every thread still gets a pass.  Fewer live lanes (a batch-1 step's one
  // KV head a thread) spend more exponentials per head than `attend_amx`'s rows, which wins there.
  int64_t ns = G <= kRows ? std::min(Hk, kRows / G) : 1;
  while (ns > 1 && N * ((Hk + ns - 1) / ns) < at::get_num_threads()) --ns;
  if (bs % 16 == 0 && G <= kRows && ns * G >= 12) {
    const int64_t sets = (Hk + ns - 1) / ns;
    at::parallel_for(0, N * sets, 1, [&](int64_t i0, int64_t i1) {
      TORCH_CHECK(tokenloom::amx::request_tiles(), "tokenloom_amx: the kernel refused AMX tile permission");
      _tile_loadconfig(&kConfig);
      SetScratch w(ns, D);
      std::vector<float> o32(kRows * D);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / sets, h0 = i % sets * ns, nh = std::min(ns, Hk - h0), ctx = clp[r];
        TORCH_CHECK(ctx >= 0 && ctx <= nb * bs, "context length exceeds the block table");
        const int64_t off = (r * Hq + h0 * G) * D;
        attend_amx_set(qp + off, nh, G, D, kc + h0 * D, vc + h0 * D, btp + r * nb, ctx, bs, token_stride,
                       static_cast<float>(scale), o32.data(), w);
        tokenloom::amx::store_bf16(reinterpret_cast<uint16_t*>(op + off), o32.data(), nh * G * D);
      }
      _tile_release();
    });
    return out;
  }
  at::parallel_for(0, N * Hk * groups, 1, [&](int64_t i0, int64_t i1) {
    TORCH_CHECK(tokenloom::amx::request_tiles(), "tokenloom_amx: the kernel refused AMX tile permission");
    _tile_loadconfig(&kConfig);
    Scratch w(D);
    std::vector<float> o32(kRows * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / (Hk * groups), h = i / groups % Hk, g0 = i % groups * kRows;
      const int64_t gn = std::min(kRows, G - g0), ctx = clp[r];
      TORCH_CHECK(ctx >= 0 && ctx <= nb * bs, "context length exceeds the block table");
      const int64_t off = (r * Hq + h * G + g0) * D;
      attend_amx(qp + off, gn, D, kc + h * D, vc + h * D, btp + r * nb, ctx, bs, token_stride,
                 static_cast<float>(scale), o32.data(), w);
      tokenloom::amx::store_bf16(reinterpret_cast<uint16_t*>(op + off), o32.data(), gn * D);
    }
    _tile_release();
  });
  return out;
}

// Causal prefill from a request's first token, one (chunk, KV head, query head, 16 query rows)
// at a time: `attend_lanes` with the lanes 16 query positions i0 .. i0 + 15 of one head instead
// of 16 heads of one position.  Key t reaches lane c where t <= i0 + c (the causal mask, per row
// of S^T), and the chunks of keys stop at the tile's last position.  The chunk's keys are
// already in the cache (written before attention); its values come paired (`vpairs`: per 32
// keys, D / 16 tiles of token pairs, zeros past the chunk), once for every query head and tile
// that reads them.
void prefill_tile(const uint16_t* q, int64_t q_stride, int64_t rows, int64_t i0, int64_t D, const uint16_t* k_cache,
                  const uint16_t* vpairs, const int64_t* table, int64_t bs, int64_t token_stride, float scale,
                  float* out, SetScratch& w) {
  transpose_queries(1, D, [&](int64_t, int64_t c) { return c < rows ? q + c * q_stride : nullptr; }, w.bq.data());
  struct Paired {
    const uint16_t* vpairs;
    int64_t vtiles;
    void ahead(int64_t) const {}
    const uint16_t* tiles(int64_t c0, int64_t) const { return vpairs + c0 / kChunk * vtiles * 512; }
  } values{vpairs, D / 16};
  const __mmask16 live = static_cast<__mmask16>(rows >= 16 ? 0xFFFF : (1u << rows) - 1);
  const auto reach = [&](int64_t c0, int64_t t) -> __mmask16 {  // key c0 + t reaches lanes c >= c0 + t - i0
    const int64_t first = c0 + t - i0;
    return first <= 0 ? live : first >= 16 ? 0 : static_cast<__mmask16>(live & (0xFFFFu << first));
  };
  attend_lanes(1, kRows, rows, D, k_cache, table, i0 + rows, bs, token_stride, scale, reach, values, out, w);
}

// Causal attention of prefill chunks that start their requests: q [T, Hq, D] bf16 (rows from
// `row0` on are the chunks', chunk i at rows starts[i] .. + lens[i]), each over its own first
// lens[i] keys, already written to the caches (block tables [P, max_blocks]).  Returns the
// chunks' rows [T - row0, Hq, D] bf16.  Block sizes of whole 16-token tiles, head sizes a
// multiple of 32.
at::Tensor causal_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& block_tables, const at::Tensor& starts, const at::Tensor& lens,
                                    int64_t row0, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "tokenloom_amx prefill attention takes bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hk = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 32 == 0 && Hq % Hk == 0 && bs % 16 == 0,
              "head size a multiple of 32 and blocks of whole 16-token tiles");
  const int64_t G = Hq / Hk;
  const auto qc = q.contiguous();
  const auto bt = block_tables.to(at::kLong).contiguous();
  const auto st = starts.to(at::kLong).contiguous(), ln = lens.to(at::kLong).contiguous();
  const int64_t P = bt.size(0), nb = bt.size(1), token_stride = Hk * D;
  TORCH_CHECK(st.numel() == P && ln.numel() == P && row0 >= 0 && row0 <= T, "one start and length per chunk");
  const int64_t* stp = st.data_ptr<int64_t>();
  const int64_t* lnp = ln.data_ptr<int64_t>();
  // work items: (chunk, KV head, query head, tile of 16 rows), the longest tiles first
  std::vector<std::array<int64_t, 4>> items;
  for (int64_t c = 0; c < P; ++c) {
    TORCH_CHECK(stp[c] >= row0 && lnp[c] >= 0 && stp[c] + lnp[c] <= T && lnp[c] <= nb * bs, "chunk out of range");
    for (int64_t i0 = 0; i0 < lnp[c]; i0 += 16)
      for (int64_t h = 0; h < Hk; ++h)
        for (int64_t g = 0; g < G; ++g) items.push_back({c, h, g, i0});
  }
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a[3] > b[3]; });
  auto out = at::zeros({T - row0, Hq, D}, qc.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t* btp = bt.data_ptr<int64_t>();
  // each chunk's values as token pairs, once per (chunk, KV head, 32 keys) for all its query tiles
  const int64_t vtiles = D / 16;
  std::vector<int64_t> vbase(P + 1, 0);  // first 32-key block of chunk c, over all chunks
  for (int64_t c = 0; c < P; ++c) vbase[c + 1] = vbase[c] + (lnp[c] + kChunk - 1) / kChunk;
  std::vector<uint16_t> vpairs(vbase[P] * Hk * vtiles * 512);
  const auto pairs_of = [&](int64_t c, int64_t h) { return vpairs.data() + (vbase[c] * Hk + h * (vbase[c + 1] - vbase[c])) * vtiles * 512; };
  at::parallel_for(0, vbase[P] * Hk, 1, [&](int64_t b0, int64_t b1) {
    const __m512i pair_idx[2] = {_mm512_load_si512(kPairIdx[0]), _mm512_load_si512(kPairIdx[1])};
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t k = b / Hk, h = b % Hk;
      const int64_t c = std::upper_bound(vbase.begin(), vbase.end(), k) - vbase.begin() - 1, c0 = (k - vbase[c]) * kChunk;
      const int64_t n = std::min(kChunk, lnp[c] - c0);
      uint16_t* dst = pairs_of(c, h) + (c0 / kChunk) * vtiles * 512;
      const uint16_t* half[2] = {block_tokens(vc + h * D, btp + c * nb, c0, bs, token_stride),
                                 n > 16 ? block_tokens(vc + h * D, btp + c * nb, c0 + 16, bs, token_stride) : nullptr};
      const auto row = [&](int64_t t) { return t < n ? half[t / 16] + (t % 16) * token_stride : nullptr; };
      for (int64_t j = 0; j < kChunk / 2; ++j) pair_row(row(2 * j), row(2 * j + 1), D / 32, pair_idx, dst, j);
    }
  });
  const int64_t n_items = static_cast<int64_t>(items.size()), threads = at::get_num_threads();
  // thread t takes items t, t + threads, ...: each gets its share of the long tiles
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    TORCH_CHECK(tokenloom::amx::request_tiles(), "tokenloom_amx: the kernel refused AMX tile permission");
    _tile_loadconfig(&kConfig);
    SetScratch w(1, D);
    std::vector<float> o32(kRows * D);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = t; i < n_items; i += threads) {
        const auto [c, h, g, i0] = items[i];
        const int64_t rows = std::min<int64_t>(16, lnp[c] - i0), head = h * G + g;
        prefill_tile(qp + ((stp[c] + i0) * Hq + head) * D, Hq * D, rows, i0, D, kc + h * D, pairs_of(c, h), btp + c * nb,
                     bs, token_stride, static_cast<float>(scale), o32.data(), w);
        for (int64_t r = 0; r < rows; ++r)
          tokenloom::amx::store_bf16(reinterpret_cast<uint16_t*>(op + ((stp[c] - row0 + i0 + r) * Hq + head) * D),
                                     o32.data() + r * D, D);
      }
    _tile_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_amx, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("causal_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor starts, "
        "Tensor lens, int row0, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_amx, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("causal_prefill_attention", &causal_prefill_attention);
}
