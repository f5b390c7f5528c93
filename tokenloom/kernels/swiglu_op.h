// The op around a SwiGLU row loop, shared by the AVX2 and AVX-512 builds (cpu_fused.cpp,
// cpu_fused_avx512.cpp): argument checks, the output, the dispatch on dtype.  `rows(x, y,
// rows, I)` runs SiLU(gate) * up over rows of [gate | up] (I each) for float or BFloat16 data.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tokenloom {

// x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]: the SwiGLU activation on the fused
// gate/up projection's output.
template <typename Rows>
at::Tensor silu_and_mul_op(const at::Tensor& x, const char* name, Rows&& rows) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), name,
              " takes float32 or bfloat16 CPU tensors");
  const int64_t I2 = x.size(-1);
  TORCH_CHECK(I2 % 2 == 0, "the last dimension must hold gate and up halves");
  const int64_t I = I2 / 2;
  const auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = I;
  auto y = at::empty(sizes, xc.options());
  const int64_t n = I2 ? xc.numel() / I2 : 0;
  if (xc.scalar_type() == at::kBFloat16)
    rows(xc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), n, I);
  else
    rows(xc.data_ptr<float>(), y.data_ptr<float>(), n, I);
  return y;
}

}  // namespace tokenloom
