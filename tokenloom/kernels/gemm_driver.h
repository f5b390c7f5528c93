// The loops every CPU GEMM runs around its micro-kernel (cpu_gemm*.cpp): packing the
// activations into row tiles, and walking the weight panels across the thread pool.  Each
// kernel is compiled as its own extension with its own ISA flags, so they share these as
// inline templates rather than as one compiled function; a kernel supplies only what differs
// (the element conversion of a tile, the work on one panel), and the iteration order stays
// the one every kernel relies on for its memory access pattern and summation order.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace tokenloom {

// The row tiles of M rows, `mr` rows each (the last one shorter): `tile(m, rows)` for each,
// m its first row, in parallel over tiles.  A micro-kernel reads a tile's activations of one
// k side by side, so each kernel packs x into tiles once per call before its GEMM.
template <typename F>
inline void for_row_tiles(int64_t M, int64_t mr, F&& tile) {
  const int64_t tiles = (M + mr - 1) / mr;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) tile(t * mr, std::min(mr, M - t * mr));
  });
}

// x [M, K] row-major -> tiles of `mr` rows, each [K][rows] (k-major), the tile at row m
// starting at out + m * K: the layout a micro-kernel broadcasts from, one contiguous stream.
// `convert` maps an element of x to one of out (identity where they are the same type).
template <typename In, typename Out, typename Convert>
inline void pack_row_tiles(const In* x, int64_t M, int64_t K, int64_t mr, Out* out, Convert convert) {
  for_row_tiles(M, mr, [&](int64_t m, int64_t r) {
    const In* src = x + m * K;
    Out* dst = out + m * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < r; ++i) dst[k * r + i] = convert(src[i * K + k]);
  });
}

template <typename T>
inline void pack_row_tiles(const T* x, int64_t M, int64_t K, int64_t mr, T* out) {
  pack_row_tiles(x, M, K, mr, out, [](T v) { return v; });
}

// The weight panels [0, panels) split across the thread pool, each thread one contiguous run
// [p0, p1): its weights are then one sequential stream, which the hardware prefetchers serve
// best, and every output column is computed by exactly one thread.  `run(p0, p1)` per thread.
template <typename F>
inline void for_panel_runs(int64_t panels, F&& run) {
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) { run(p0, p1); });
}

// Within each thread's run, rows in blocks of `mc` (the activations of one k-block of a row
// block stay in L2 while the run's panels pass by), and for each row block the run's panels in
// order: `panel(p, p1, m0, m1)` multiplies rows [m0, m1) by panel p; p1 is the end of the
// run (the weights a thread may prefetch ahead reach no further).  mc = M: one row block,
// each panel visited once.
template <typename F>
inline void for_panels(int64_t panels, int64_t M, int64_t mc, F&& panel) {
  for_panel_runs(panels, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
      const int64_t m1 = std::min(M, m0 + mc);
      for (int64_t p = p0; p < p1; ++p) panel(p, p1, m0, m1);
    }
  });
}

}  // namespace tokenloom
