// What every AMX kernel (cpu_gemm_amx*.cpp) needs before its first tile instruction: the
// process's permission to use the tile registers, and a tile configuration to load.
//
// Linux hands out tile registers only to a process that asked (arch_prctl
// ARCH_REQ_XCOMP_PERM); each worker thread asks once, lazily.  A kernel loads its configuration
// at every call (other code -- oneDNN, the other AMX kernels -- may have loaded another) and
// releases the tiles after.  Configurations are constants in static storage: gcc 12's
// _tile_loadconfig declares only an 8-byte read, so it may drop the stores that fill a
// configuration built on the stack.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "panel_linear.h"

namespace tokenloom::amx {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Palette 1: per tile, its bytes per row (colsb) and rows.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0 .. count-1 shaped rows x colsb each; more shapes are set by the caller.
constexpr TileConfig uniform_config(int count, uint8_t rows, uint16_t colsb) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < count; ++t) {
    c.colsb[t] = colsb;
    c.rows[t] = rows;
  }
  return c;
}

// Tile permission for the calling thread's process (asked once per thread; harmless to repeat).
inline bool request_tiles() {
  static thread_local int granted = -1;
  if (granted < 0) granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 1 : 0;
  return granted == 1;
}

// n float32 values to bfloat16, rounded as `round_to_bf16` (by `convert_to_bf16`: AMX CPUs have AVX512-BF16).
inline void store_bf16(uint16_t* dst, const float* src, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), convert_to_bf16(_mm512_loadu_ps(src + j)));
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm256_mask_storeu_epi16(dst + j, m, convert_to_bf16(_mm512_maskz_loadu_ps(m, src + j)));
  }
}

// An AMX GEMM's output y [M, n] and its bias: a bf16 x gets its bf16 y written directly,
// rounded once (no float32 copy to convert after); any other x a float32 y.  `store` writes 16
// sums (plus nothing: the caller adds `bias()`) at element `at` under a column mask.
class Output {
 public:
  Output(const at::Tensor& x, int64_t M, int64_t n, const c10::optional<at::Tensor>& bias)
      : y_(at::empty({M, n}, x.options().dtype(x.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat))) {
    if (bias.has_value() && bias->defined()) {
      bias_ = bias->to(at::kFloat).contiguous();
      TORCH_CHECK(bias_.numel() >= n, "bias shorter than n");
      bp_ = bias_.data_ptr<float>();
    }
    if (y_.scalar_type() == at::kBFloat16) yh_ = reinterpret_cast<uint16_t*>(y_.data_ptr<at::BFloat16>());
    else yf_ = y_.data_ptr<float>();
  }
  const float* bias() const { return bp_; }
  void store(int64_t at, __mmask16 mk, __m512 v) const {
    if (yh_) _mm256_mask_storeu_epi16(yh_ + at, mk, convert_to_bf16(v));
    else _mm512_mask_storeu_ps(yf_ + at, mk, v);
  }
  // y shaped as x with n features, in x's dtype.
  at::Tensor result(const at::Tensor& x, int64_t n) const {
    auto sizes = x.sizes().vec();
    sizes.back() = n;
    return y_.view(sizes).to(x.scalar_type());
  }

 private:
  at::Tensor y_, bias_;
  const float* bp_ = nullptr;
  float* yf_ = nullptr;
  uint16_t* yh_ = nullptr;
};

}  // namespace tokenloom::amx
