// What every packed-linear op does besides its kernel (cpu_gemm*.cpp): flatten x to
// [M, K] in the dtype the kernel reads, allocate the float32 output, widen a bias padded
// to the panels, and give the output back in x's shape and dtype.  Shared by the AVX2,
// AVX-512 and AVX512-BF16 extensions, which are compiled separately with their own ISA
// flags and so cannot share one compiled function.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace tokenloom {

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

}  // namespace tokenloom
