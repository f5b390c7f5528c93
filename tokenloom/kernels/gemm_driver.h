// The loops every CPU GEMM runs around its micro-kernel (cpu_gemm*.cpp): packing the
// activations into row tiles, and walking the weight panels across the thread pool.  Each
// kernel is compiled as its own extension with its own ISA flags, so they share these as
// inline templates rather than as one compiled function; a kernel supplies only what differs
// (the element conversion of a tile, the work on one panel), and the iteration order stays
// the one every kernel relies on for its memory access pattern and summation order.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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

// The panels [0, panels) shared across the thread pool as in `for_panel_runs`, each thread
// starting on its own contiguous run, but a thread that finishes its run early goes on with
// panels from the end of another's.  Two threads on one memory bus do not finish equal halves
// together (one of them also runs the serial ops between calls; the hypervisor takes turns),
// and at one row a GEMM lasts a few hundred microseconds, so the faster thread's wait at the
// join was a measurable part of a decode step (docs/performance.md, "Panels shared at the
// join").  Every panel is still computed whole, by one thread, with the same code, so the
// result does not depend on which thread took it.
//
// `body(pieces)` runs once per thread (its set-up: tile configuration, buffers), then takes
// its panels as `while (pieces.next(p0, p1))`: consecutive pieces of its own run from the
// front, then pieces from the back of whichever run has the most left.  For kernels whose
// prefetching runs a fixed distance ahead of the panel at hand: a piece's end is not the end
// of what the thread reads next.
class PanelPieces {
 public:
  static constexpr int64_t kMaxThreads = 64;

  // `align`: runs and pieces start at multiples of it (a kernel that takes panels in pairs).
  PanelPieces(int64_t panels, int64_t threads, int64_t align)
      : threads_(threads),
        align_(align),
        piece_((std::max<int64_t>(1, std::min<int64_t>(8, panels / (threads * 16))) + align - 1) / align * align) {
    const int64_t units = (panels + align - 1) / align;
    for (int64_t t = 0; t < threads; ++t)
      runs_[t].span.store(pack(std::min(panels, units * t / threads * align),
                               std::min(panels, units * (t + 1) / threads * align)),
                          std::memory_order_relaxed);
  }

  // The pieces thread `t` works through.
  class Cursor {
   public:
    Cursor(PanelPieces& all, int64_t t) : all_(all), t_(t) {}
    // The next piece [p0, p1) for this thread; false once every run is empty.
    bool next(int64_t& p0, int64_t& p1) {
      if (own_ && all_.take(t_, true, p0, p1)) return true;
      own_ = false;
      for (;;) {
        int64_t victim = -1, most = 0;
        for (int64_t u = 0; u < all_.threads_; ++u) {
          const int64_t left = all_.left(u);
          if (left > most) most = left, victim = u;
        }
        if (victim < 0) return false;
        if (all_.take(victim, false, p0, p1)) return true;
      }
    }

   private:
    PanelPieces& all_;
    int64_t t_;
    bool own_ = true;
  };

 private:
  // A run's unclaimed panels [front, back) in one word, so both ends move atomically.
  struct alignas(64) Run {
    std::atomic<uint64_t> span;
  };
  static uint64_t pack(int64_t front, int64_t back) { return uint64_t(front) | (uint64_t(back) << 32); }
  int64_t left(int64_t t) const {
    const uint64_t s = runs_[t].span.load(std::memory_order_relaxed);
    return int64_t(s >> 32) - int64_t(s & 0xffffffffu);
  }
  // Up to `piece_` panels from run t's front (its owner) or back (another thread).
  bool take(int64_t t, bool front, int64_t& p0, int64_t& p1) {
    uint64_t s = runs_[t].span.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = int64_t(s & 0xffffffffu), b = int64_t(s >> 32);
      if (f >= b) return false;
      p0 = front ? f : std::max(f, (b - piece_) / align_ * align_);
      p1 = front ? std::min(b, f + piece_) : b;
      if (runs_[t].span.compare_exchange_weak(s, front ? pack(p1, b) : pack(f, p0), std::memory_order_relaxed))
        return true;
    }
  }

  int64_t threads_, align_, piece_;
  Run runs_[kMaxThreads];
};

// A thread's whole run [p0, p1) as one piece: a `for_panel_pieces` body run over static runs.
struct OneRun {
  int64_t p0, p1;
  bool done = false;
  bool next(int64_t& a, int64_t& b) {
    if (done || p0 >= p1) return false;
    a = p0, b = p1, done = true;
    return true;
  }
};

// A `for_panel_pieces` body over `for_panel_runs`' static runs, each run one piece: for calls
// that keep their order (several row blocks over a thread's whole run).
template <typename F>
inline void for_whole_runs(int64_t panels, F&& body) {
  for_panel_runs(panels, [&](int64_t p0, int64_t p1) {
    OneRun run{p0, p1};
    body(run);
  });
}

template <typename F>
inline void for_panel_pieces(int64_t panels, F&& body, int64_t align = 1) {
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), (panels + align - 1) / align);
  if (nt < 2 || nt > PanelPieces::kMaxThreads || panels >= (int64_t(1) << 31)) {  // one run per thread
    for_whole_runs(panels, body);
    return;
  }
  PanelPieces all(panels, nt, align);
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      PanelPieces::Cursor c(all, t);
      body(c);
    }
  });
}

// Within each thread's run, rows in blocks of `mc` (the activations of one k-block of a row
// block stay in L2 while the run's panels pass by), and for each row block the run's panels in
// order: `panel(p, p1, m0, m1)` multiplies rows [m0, m1) by panel p; p1 is the end of the
// stretch the thread is on (the weights it may prefetch ahead reach no further).  mc >= M: one
// row block, each panel visited once, and the panels shared in pieces (`for_panel_pieces`),
// p1 then a piece's end.
template <typename F>
inline void for_panels(int64_t panels, int64_t M, int64_t mc, F&& panel) {
  if (M <= mc) {  // one row block (decode): the panels shared as the threads finish (above)
    for_panel_pieces(panels, [&](auto& pieces) {
      int64_t p0, p1;
      while (pieces.next(p0, p1))
        for (int64_t p = p0; p < p1; ++p) panel(p, p1, 0, M);
    });
    return;
  }
  for_panel_runs(panels, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
      const int64_t m1 = std::min(M, m0 + mc);
      for (int64_t p = p0; p < p1; ++p) panel(p, p1, m0, m1);
    }
  });
}

}  // namespace tokenloom
